"""The attention endpoint's maps: the layers and heads a request selects, within a cap on their size.

Every map is layers x heads x queries x keys floats: a short request for a long input would otherwise be
answered with megabytes (7.2 MB for 531 bytes at the default models' max_len). A response holds at most
``MAX_ATTENTION_VALUES`` weights; a request over it is refused with a 422 that says how many it asked for,
so the client selects fewer layers or heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.errors import InvalidRequest

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
            raise InvalidRequest(f"layers: the selected maps hold {total} weights ({shapes}), over the limit of "
                                 f"{MAX_ATTENTION_VALUES}; select fewer layers or heads (fields layers, heads)")
        return {kind: t.float().tolist() for kind, t in chosen.items()}


ALL_MAPS = MapSelection()


def _check_indices(field: str, indices: tuple[int, ...] | None, count: int, what: str) -> None:
    bad = [i for i in indices or () if not 0 <= i < count]
    if bad:
        raise InvalidRequest(f"{field}: {bad} out of range; this model has {count} {what} (0-{count - 1})")
