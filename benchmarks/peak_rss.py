"""Peak resident memory of each engine of benchmarks/decoder_compare.py, each alone in a fresh process.

Every engine loads the shape's files and runs one greedy batch-1 cell (a ``prompt``-token prompt of random ids,
``new_tokens`` new tokens); the process's VmHWM (/proc/PID/status) is its peak. Ours, HF and CTranslate2 run as
``python -m benchmarks.peak_rss ENGINE HF_DIR THREADS PROMPT NEW_TOKENS``, which imports only what that engine
needs (CTranslate2 without torch); llama.cpp in its own worker (benchmarks/llama_cpp_worker.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

IN_PROCESS = ("ours", "ours int8", "ours bf16", "HF", "CT2 fp32", "CT2 int8")


def vm_hwm(pid: int) -> int:
    """Peak resident bytes of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def prompt_ids(hf: Path, prompt: int) -> list[int]:
    """Random ids below the vocabulary's last (the EOS id of benchmarks/shapes.py's decoders)."""
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    rng = random.Random(prompt)
    return [rng.randrange(vocab - 1) for _ in range(prompt)]


def peak_rss_rows(files, threads: int, prompt: int, new_tokens: int) -> list[list[str]]:
    """[engine, peak RSS] of every engine installed, each measured in a fresh process."""
    from benchmarks import llama_cpp_peer, shapes

    rows = []
    ct2 = shapes.ct2_directory(files)
    for engine in IN_PROCESS:
        if engine.startswith("CT2") and ct2 is None:
            continue
        done = subprocess.run([sys.executable, "-m", "benchmarks.peak_rss", engine, str(files.hf), str(threads),
                               str(prompt), str(new_tokens)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"peak RSS of {engine} failed:\n{done.stderr[-3000:]}")
        rows.append([engine, _mib(int(done.stdout.split()[-1]))])
    env = llama_cpp_peer.environment()
    if env is not None:
        for kind, path in llama_cpp_peer.gguf_files(files, env).items():
            process = llama_cpp_peer.LlamaCppProcess(env, path, threads, prompt + new_tokens, 1,
                                                files.root / "llama-cpp.log")
            try:
                process.generate([prompt_ids(files.hf, prompt)], 1, new_tokens)
                rows.append([f"llama.cpp {kind}", _mib(vm_hwm(process.pid))])
            finally:
                process.close()
    return rows


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.0f} MiB"


def _run(engine: str, hf: Path, threads: int, prompt: int, new_tokens: int) -> None:
    ids = prompt_ids(hf, prompt)
    if engine.startswith("CT2"):
        import ctranslate2

        ct2 = hf.parent / "ct2"
        vocabulary = json.loads((ct2 / "vocabulary.json").read_text())
        generator = ctranslate2.Generator(str(ct2), device="cpu", intra_threads=threads, inter_threads=1,
                                          compute_type="int8" if engine.endswith("int8") else "float32")
        generator.generate_batch([[vocabulary[i] for i in ids]], max_length=new_tokens, min_length=new_tokens,
                                 include_prompt_in_result=False)
        return
    import torch

    torch.set_num_threads(threads)
    inputs = torch.tensor([ids])
    if engine == "HF":
        import transformers

        from benchmarks.shape_engines import hf_generate

        hf_generate(transformers.AutoModelForCausalLM.from_pretrained(hf).eval(), inputs, 1, new_tokens)
        return
    from benchmarks.shape_engines import OURS_QUANTIZED, ours_tokens
    from model.checkpoint import load_checkpoint
    from model.quantize import prepare_for_inference

    checkpoint = load_checkpoint(hf, device="cpu")
    prepare_for_inference(checkpoint.model, OURS_QUANTIZED.get(engine, "none"))
    ours_tokens(checkpoint, inputs, 1, new_tokens)


if __name__ == "__main__":
    name, directory, n, length, new = sys.argv[1:]
    _run(name, Path(directory), int(n), int(length), int(new))
    print(vm_hwm(os.getpid()))
