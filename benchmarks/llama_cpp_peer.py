"""llama.cpp as a peer of the Llama-style decoders: its benchmark environment, the GGUF files, a worker process.

The environment is a virtual environment apart from the project's (benchmarks/llama_cpp_setup.sh makes it in
``.venv-bench``; ``TSERVE_LLAMA_CPP_VENV`` names another): llama-cpp-python built from its source distribution with
this machine's flags (cmake, GGML_NATIVE), and that distribution's llama.cpp tree unpacked under ``sdist/``. The
tree's own convert_hf_to_gguf.py (with its own gguf-py) writes the GGUF files, F32 and Q8_0 (``--outtype``); it
needs torch and transformers, so it runs in the project's Python: ``python -m benchmarks.llama_cpp_peer SOURCE HF PRE
OUT:OUTTYPE...`` (:func:`convert` runs that, every file in one process). The engine runs in the environment's Python
(benchmarks/llama_cpp_worker.py), one process per GGUF file and thread count.

The converter names a byte-level BPE's pre-tokenizer by hashing the ids its tokenizer gives a fixed text, which only
the real checkpoint's vocabulary reproduces; the benchmark's directories have a small trained BPE, so the conversion
is given the name the real checkpoint's GGUF carries (``Shape.gguf_pre``: "smollm", "qwen2"). That name only
decides how llama.cpp would split text; every engine here is fed token ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks import shapes

VENV_VARIABLE = "TSERVE_LLAMA_CPP_VENV"
DEFAULT_VENV = Path(__file__).resolve().parents[1] / ".venv-bench"
KINDS = {"F32": "f32", "Q8_0": "q8_0"}  # our name of each GGUF file -> the converter's --outtype
WORKER = Path(__file__).with_name("llama_cpp_worker.py")


@dataclass(frozen=True)
class Environment:
    """The benchmark environment: its Python and the llama.cpp tree its llama-cpp-python was built from."""

    python: Path
    source: Path
    version: str


def environment() -> Environment | None:
    """The llama.cpp benchmark environment, or None where it is not set up (or holds no built llama_cpp)."""
    venv = Path(os.environ.get(VENV_VARIABLE, DEFAULT_VENV))
    python = venv / "bin" / "python"
    sources = sorted(venv.glob("sdist/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not python.is_file() or not sources or not any(venv.glob("lib/python*/site-packages/llama_cpp/lib/*")):
        return None
    version = sources[-1].parents[2].name.removeprefix("llama_cpp_python-")
    return Environment(python, sources[-1].parent, version)


def gguf_files(files: shapes.ShapeFiles, env: Environment) -> dict[str, Path]:
    """The shape's GGUF files (kind -> path), converted now unless already there."""
    out = {kind: files.gguf / f"{kind.lower()}.gguf" for kind in KINDS}
    missing = {out[kind]: outtype for kind, outtype in KINDS.items() if not out[kind].is_file()}
    if missing:
        convert(env, files.hf, missing, files.shape.gguf_pre)
    return out


def convert(env: Environment, hf: Path, outputs: dict[Path, str], pre: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py of HF directory ``hf`` into each path of ``outputs`` (path -> --outtype),
    each written beside its place, then renamed into it."""
    tmp = {out: out.with_name(f".{out.name}.{os.getpid()}.tmp") for out in outputs}
    for out in outputs:
        out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-m", "benchmarks.llama_cpp_peer", str(env.source), str(hf), pre,
                           *(f"{tmp[out]}:{outtype}" for out, outtype in outputs.items())],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py of {hf} failed:\n{done.stderr[-4000:]}")
    for out, path in tmp.items():
        os.replace(path, out)


def _convert_here(source: str, hf: str, pre: str, *outputs: str) -> None:
    """The converter's main() with the pre-tokenizer's name given (see the module's docstring), once per
    ``PATH:OUTTYPE``."""
    sys.path.insert(0, source)
    import convert_hf_to_gguf
    from conversion.base import TextModel

    TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
    for output in outputs:
        path, outtype = output.rsplit(":", 1)
        sys.argv = ["convert_hf_to_gguf.py", hf, "--outfile", path, "--outtype", outtype]
        convert_hf_to_gguf.main()


class LlamaCppProcess:
    """benchmarks/llama_cpp_worker.py on one GGUF file in the benchmark environment, over its stdin/stdout; its
    llama.cpp log goes to ``log``."""

    def __init__(self, env: Environment, gguf: Path, threads: int, cells: int, sequences: int, log: Path) -> None:
        self._log = log
        with log.open("a") as stderr:
            self._process = subprocess.Popen([str(env.python), str(WORKER), str(gguf), str(threads), str(cells),
                                              str(sequences)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=stderr, text=True)
        self._reply()  # "ready", or the worker's error

    @property
    def pid(self) -> int:
        return self._process.pid

    def _reply(self):
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited without answering (its log: {self._log})")
        reply = json.loads(line)
        if isinstance(reply, dict):
            raise RuntimeError(f"llama.cpp worker: {reply['error']} (its log: {self._log})")
        return reply

    def _ask(self, prompts: list[list[int]], beams: int, new_tokens: int, tokens: bool):
        request = {"prompts": prompts, "beams": beams, "new_tokens": new_tokens, "tokens": tokens}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return self._reply()

    def generate(self, prompts: list[list[int]], beams: int, new_tokens: int) -> list[int]:
        """Tokens generated per prompt."""
        return self._ask(prompts, beams, new_tokens, False)

    def tokens(self, prompts: list[list[int]], beams: int, new_tokens: int) -> list[list[int]]:
        """The new tokens of each prompt (beam: the best beam's)."""
        return self._ask(prompts, beams, new_tokens, True)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(10)
        self._process.stdout.close()


if __name__ == "__main__":
    _convert_here(*sys.argv[1:])
