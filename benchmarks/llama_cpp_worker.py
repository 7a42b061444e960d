"""llama.cpp on one GGUF file, driven over stdin/stdout: benchmarks/llama_cpp_peer.py starts it with the benchmark
environment's Python (llama-cpp-python built from source), so it imports only the standard library, numpy and
``llama_cpp`` (its C API: no Python sampling loop of the high-level ``Llama`` class).

Arguments: GGUF path, threads, context cells, sequences. Each request is a JSON line ``{"prompts": [[ids]],
"new_tokens": n, "beams": k, "tokens": bool}``; the answer a JSON line: the new tokens of each prompt (or their
counts), or ``{"error": ...}``; ``ready`` first.

- Greedy: every prompt one sequence of one batch: the prompts in one ``llama_decode`` (logits of each last token),
  then one row per sequence per step; the argmax of each row with the EOS id masked (min_new_tokens =
  max_new_tokens, as the other engines run).
- Beam k (batch 1, llama.cpp has no beam search of its own): k sequences over a unified KV cache, the prompt's cells
  shared; each step the k best of the k x vocabulary log-probabilities plus the beams' scores (EOS masked after the
  log-softmax, as transformers' min_new_tokens does); a beam whose parent is another sequence is re-pointed to the
  parent's cells (``llama_memory_seq_cp`` shares cells, copies nothing); the best beam is returned.
"""

from __future__ import annotations

import json
import sys

import llama_cpp as L  # noqa: N812 (the C API's own prefix)
import numpy as np


class Engine:
    """One model and one context: ``cells`` KV cells shared by up to ``sequences`` sequences."""

    def __init__(self, path: str, threads: int, cells: int, sequences: int) -> None:
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = cells
        params.n_seq_max, params.kv_unified = sequences, True
        params.n_threads = params.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab, self.eos = L.llama_vocab_n_tokens(vocab), L.llama_vocab_eos(vocab)
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(cells, 0, 1)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Decode (token, position, sequence, wants logits) entries; the logits of the rows that want them."""
        batch = self.batch
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
            batch.seq_id[i][0] = sequence
        batch.n_tokens = len(entries)
        if (status := L.llama_decode(self.ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        rows = sum(1 for entry in entries if entry[3])
        return np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(rows, self.n_vocab))

    def prefill(self, prompts: list[list[int]]) -> np.ndarray:
        L.llama_memory_clear(self.memory, True)
        return self.decode([(token, position, sequence, position == len(prompt) - 1)
                            for sequence, prompt in enumerate(prompts) for position, token in enumerate(prompt)])

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        logits, out = self.prefill(prompts), [[] for _ in prompts]
        for step in range(new_tokens):
            logits[:, self.eos] = -np.inf
            chosen = logits.argmax(1).tolist()
            for row, token in zip(out, chosen, strict=True):
                row.append(token)
            if step + 1 < new_tokens:
                logits = self.decode([(token, len(prompts[s]) + step, s, True) for s, token in enumerate(chosen)])
        return out

    def beam(self, prompt: list[int], new_tokens: int, beams: int) -> list[int]:
        logits = self.prefill([prompt])
        for sequence in range(1, beams):
            L.llama_memory_seq_cp(self.memory, 0, sequence, -1, -1)
        scores, hypotheses = np.zeros(1), [[]]
        for step in range(new_tokens):
            logp = logits.astype(np.float64)
            logp -= logp.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            logp[:, self.eos] = -np.inf
            flat = (logp + scores[:, None]).ravel()
            top = np.argpartition(-flat, beams)[:beams]
            top = top[np.argsort(-flat[top], kind="stable")]
            parents, tokens = np.divmod(top, self.n_vocab)
            scores, hypotheses = flat[top], [hypotheses[p] + [int(t)] for p, t in zip(parents, tokens, strict=True)]
            if step + 1 == new_tokens:
                break
            if step:  # after the first, every sequence already shares the prompt's cells
                self.repoint(parents.tolist())
            logits = self.decode([(int(t), len(prompt) + step, j, True) for j, t in enumerate(tokens)])
        return hypotheses[0]

    def repoint(self, parents: list[int]) -> None:
        """Sequence j takes the cells of sequence parents[j] (through temporary sequences k + j)."""
        k = len(parents)
        moved = [j for j, p in enumerate(parents) if p != j]
        for j in moved:
            L.llama_memory_seq_cp(self.memory, parents[j], k + j, -1, -1)
        for j in moved:
            L.llama_memory_seq_rm(self.memory, j, -1, -1)
            L.llama_memory_seq_cp(self.memory, k + j, j, -1, -1)
            L.llama_memory_seq_rm(self.memory, k + j, -1, -1)

    def run(self, request: dict) -> list:
        prompts, new_tokens, beams = request["prompts"], request["new_tokens"], request["beams"]
        if beams > 1:
            out = [self.beam(prompt, new_tokens, beams) for prompt in prompts]
        else:
            out = self.greedy(prompts, new_tokens)
        return out if request["tokens"] else [len(row) for row in out]


def main(argv: list[str]) -> None:
    path, threads, cells, sequences = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    try:
        engine = Engine(path, threads, cells, sequences)
    except Exception as exc:  # reported to the parent, which raises it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        try:
            answer = engine.run(json.loads(line))
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
