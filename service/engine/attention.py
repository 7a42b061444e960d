"""The attention endpoint's maps: computed per family, the layers and heads a request selects, within a cap.

Every map is layers x heads x queries x keys floats: a short request for a long input would otherwise be
answered with megabytes (7.2 MB for 531 bytes at the default models' max_len). A response holds at most
``MAX_ATTENTION_VALUES`` weights; a request over it is refused with a 422 that says how many it asked for,
so the client selects fewer layers or heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from model.checkpoint import Checkpoint
from model.decoding import GenerationConfig
from model.generation import generate_seq2seq
from service.engine.errors import InvalidRequest
from service.engine.inputs import InputChecks
from service.engine.types import AttentionOutput

MAX_ATTENTION_VALUES = 1 << 18  # weights in one response (about 5 MB of JSON)


@dataclass(frozen=True)
class MapSelection:
    """Which layers and heads to return (None: all of them), in the order given."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None

    def check_heads(self, n_heads: int) -> None:
        """Refuse head indices the model does not have (before any work is queued)."""
        _check_indices("heads", self.heads, n_heads, "heads")

    def apply(self, maps: dict[str, list[torch.Tensor]]) -> dict[str, list]:
        """kind -> [layer][head][query][key] floats, from kind -> per-layer (1, H, Tq, Tk) weights."""
        chosen = {}
        for kind, layers in maps.items():
            _check_indices("layers", self.layers, len(layers), f"{kind} layers")
            picked = torch.stack([layers[i][0] for i in (self.layers or range(len(layers)))])  # (L', H, Tq, Tk)
            chosen[kind] = picked if self.heads is None else picked[:, list(self.heads)]
        total = sum(t.numel() for t in chosen.values())
        if total > MAX_ATTENTION_VALUES:
            shapes = ", ".join(f"{kind} {'x'.join(map(str, t.shape))}" for kind, t in chosen.items())
            raise InvalidRequest("layers", f"the selected maps hold {total} weights ({shapes}), over the limit of "
                                 f"{MAX_ATTENTION_VALUES}; select fewer layers or heads (fields layers, heads)")
        return {kind: t.float().tolist() for kind, t in chosen.items()}


ALL_MAPS = MapSelection()


def _check_indices(field: str, indices: tuple[int, ...] | None, count: int, what: str) -> None:
    bad = [i for i in indices or () if not 0 <= i < count]
    if bad:
        raise InvalidRequest(field, f"{bad} out of range; this model has {count} {what} (0-{count - 1})")


def classifier_maps(model: nn.Module, tokenizer: Any, ids: list[int], segments: list[int],
                    selection: MapSelection) -> AttentionOutput:
    """A classifier's "encoder_self" maps of one (pair) input."""
    device = next(model.parameters()).device
    _, maps = model.encode(torch.tensor([ids], device=device), torch.tensor([segments], device=device),
                           attention_weights=True)
    return AttentionOutput(tokenizer.token_strings(ids), None, selection.apply({"encoder_self": _of(maps, "self")}))


def seq2seq_maps(model: nn.Module, checkpoint: Any, src: list[int], tgt_in: list[int],
                 selection: MapSelection) -> AttentionOutput:
    """A translator's "encoder_self", "decoder_self" and "cross" maps, decoder queries ``tgt_in``."""
    device = next(model.parameters()).device
    _, maps = model.forward_with_attention(torch.tensor([src], device=device), torch.tensor([tgt_in], device=device))
    kinds = {"encoder_self": _of(maps["encoder"], "self"), "decoder_self": _of(maps["decoder"], "self"),
             "cross": _of(maps["decoder"], "cross")}
    return AttentionOutput(checkpoint.src_tokenizer.token_strings(src), checkpoint.tokenizer.token_strings(tgt_in),
                           selection.apply(kinds))


def causal_maps(model: nn.Module, tokenizer: Any, prompt: list[int], target: list[int] | None,
                selection: MapSelection) -> AttentionOutput:
    """A language model's "self" maps over prompt + target (target tokens listed only when given)."""
    device = next(model.parameters()).device
    _, maps = model.forward_with_attention(torch.tensor([prompt + (target or [])], device=device))
    shown = tokenizer.token_strings(target) if target is not None else None
    return AttentionOutput(tokenizer.token_strings(prompt), shown, selection.apply({"self": _of(maps, "self")}))


def _of(layers: list[dict[str, torch.Tensor]], kind: str) -> list[torch.Tensor]:
    """Per-layer (1, H, Tq, Tk) weights of one kind."""
    return [layer[kind] for layer in layers]



def prepare_maps(checkpoint: Checkpoint, inputs: InputChecks, text: str, target: str | None,
                 selection: MapSelection, greedy: GenerationConfig, vocab_map: Any = None
                 ) -> Callable[[], AttentionOutput]:
    """Encode and check one attention request (on the tokenizer pool); the returned call computes its maps on the
    worker thread. A seq2seq without ``target`` attends over its own greedy translation (``greedy``)."""
    model, config, tokenizer = checkpoint.model, checkpoint.config, checkpoint.tokenizer
    if checkpoint.family == "classifier":
        ids, segments = inputs.length(0, tokenizer.encode_pair(text, target))
        return lambda: classifier_maps(model, tokenizer, ids, segments, selection)
    prompt = inputs.length(0, checkpoint.encode_prompts([text])[0])
    tgt = tokenizer.encode(target) if target is not None else None
    if checkpoint.family == "causal_lm":
        if len(prompt) + len(tgt or []) > config.max_len:
            raise InvalidRequest("target", f"prompt + target ({len(prompt) + len(tgt or [])} tokens) exceeds the "
                                 f"model's max_len={config.max_len}")
        return lambda: causal_maps(model, tokenizer, prompt, tgt, selection)
    if tgt is not None and len(tgt) + 1 > config.max_len:
        raise InvalidRequest("target", f"{len(tgt)} tokens exceeds the model's max_len={config.max_len} - 1")

    def run() -> AttentionOutput:
        out = tgt
        if out is None:  # attend over the model's own greedy translation (from its forced first token, BART's <s>)
            forced = checkpoint.generation.forced_bos if checkpoint.generation is not None else None
            out = generate_seq2seq(model, [prompt], greedy, vocab_map=vocab_map, forced_first=[forced])[0][0].tokens
        return seq2seq_maps(model, checkpoint, prompt, [config.bos_id, *out], selection)

    return run
