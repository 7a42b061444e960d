"""Rotary position embeddings (RoPE, half-split layout as Llama's) with transformers' scaling types.

The inverse frequencies and the attention factor are computed as transformers' ``ROPE_INIT_FUNCTIONS`` compute
them (float32, the same operations in the same order), and cos/sin as its ``*RotaryEmbedding.forward`` does:
angles in float32 whatever the model's dtype, cos and sin multiplied by the attention factor (yarn, longrope),
then cast to the model's dtype. A ``rotary_dim`` below the head width rotates the first ``rotary_dim`` features of
each head and passes the rest through (Phi-3's ``partial_rotary_factor``).

Scaling (``rope_scaling``: the HF ``rope_parameters`` we honour, :data:`SCALING_KEYS`; None = plain RoPE):

- linear: frequencies / factor;
- dynamic (NTK): while a forward's largest position + 1 (over the whole batch) exceeds
  ``original_max_position_embeddings`` (HF's ``max_position_embeddings``), the base grows with it and the
  frequencies are recomputed for that forward, as transformers' ``dynamic_rope_update`` does under ``generate()``:
  keys already in the KV cache stay rotated with the frequencies of the step that wrote them. Differences from
  transformers: ours keeps no state across calls (its module keeps the largest frequencies of an earlier call
  until a call stays within the original length), and the largest position is over the rows still decoding (a
  finished row leaves our batch, transformers decodes it on as padding; the engine batches rows its own way);
- llama3: low/high-frequency factors around ``original_max_position_embeddings``;
- yarn: interpolation ramped between beta_fast and beta_slow, attention factor from mscale / mscale_all_dim or
  given;
- longrope: ``short_factor`` per frequency while a forward's largest position + 1 is within
  ``original_max_position_embeddings``, ``long_factor`` beyond; attention factor from ``factor`` or given. Keys
  cached before the switch keep the short factors, as under transformers' ``generate()`` for Llama; Phi-3's
  ``generate()`` instead discards its cache and recomputes the whole sequence when the batch's width first passes
  that length (``Phi3ForCausalLM.prepare_inputs_for_generation``), which ours does not do: outputs of a sequence
  that crosses it while decoding may differ from there on (a prompt already past it matches).

A forward over several new tokens (a prefill, a speculative block) takes one set of frequencies for all of them
(its largest position), as transformers does: under dynamic or longrope, past the original length, a speculative
step may therefore differ from decoding the same tokens one by one.
Keys of a shared prefix (model/prefix_cache.py) were rotated when the prefix was first computed: with dynamic
or longrope, a prefix reused by a longer batch keeps the frequencies of the batch that wrote it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

# rope_type -> (required keys, optional keys) of a rope_scaling dict, besides "rope_type"
SCALING_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "linear": (("factor",), ()),
    "dynamic": (("factor", "original_max_position_embeddings"), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate")),
    "longrope": (("factor", "short_factor", "long_factor", "original_max_position_embeddings"), ("attention_factor",)),
}
ROPE_TYPES = ("default", *SCALING_KEYS)


def check_scaling(scaling: Mapping[str, Any] | None, rotary_dim: int) -> None:
    """ValueError naming what is wrong with ``scaling`` for a rotary width of ``rotary_dim``."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SCALING_KEYS:
        raise ValueError(f"rope_type {rope_type!r} is not one of {sorted(SCALING_KEYS)}")
    required, optional = SCALING_KEYS[rope_type]
    missing = sorted(set(required) - set(scaling))
    unknown = sorted(set(scaling) - {"rope_type", *required, *optional})
    if missing or unknown:
        raise ValueError(f"({rope_type}) lacks {missing} or has unknown keys {unknown}")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim"):
        value = scaling.get(key)
        if value is not None and (not _is_number(value) or value < 0 or (key == "factor" and value <= 0)):
            raise ValueError(f"({rope_type}) {key}={value!r} must be a non-negative number (factor > 0)")
    original = scaling.get("original_max_position_embeddings", 1)
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ValueError(f"({rope_type}) original_max_position_embeddings={original!r} must be a positive integer")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError("(llama3) high_freq_factor must be greater than low_freq_factor")
    if rope_type == "dynamic" and rotary_dim <= 2:
        raise ValueError("(dynamic) needs a rotary width above 2")
    if not isinstance(scaling.get("truncate", True), bool):
        raise ValueError("(yarn) truncate must be true or false")
    for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
        values = scaling[key]
        if not isinstance(values, list) or len(values) != rotary_dim // 2 or not all(
                _is_number(v) and v > 0 for v in values):
            raise ValueError(f"({rope_type}) {key} must be a list of {rotary_dim // 2} positive numbers "
                             "(rotary width / 2)")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def inverse_frequencies(rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None = None,
                        seq_len: int | torch.Tensor | None = None,
                        device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (rotary_dim/2,) float32, attention factor) as transformers computes them.

    ``seq_len`` (a forward's largest position + 1, an int64 tensor for dynamic) matters to dynamic and longrope
    only; None is the initial (original) frequencies.
    """
    rope_type = "default" if scaling is None else scaling["rope_type"]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    if rope_type == "default":
        return 1.0 / (theta**exponents), 1.0
    factor = scaling["factor"]
    if rope_type == "linear":
        return 1.0 / (theta**exponents) / factor, 1.0
    original = scaling["original_max_position_embeddings"]
    if rope_type == "dynamic":
        return _dynamic(rotary_dim, theta, factor, original, seq_len, exponents), 1.0
    if rope_type == "llama3":
        return _llama3(1.0 / (theta**exponents), scaling), 1.0
    if rope_type == "yarn":
        return _yarn(rotary_dim, theta, scaling, exponents)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    long = seq_len is not None and seq_len > original
    ext_factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
    return 1.0 / (ext_factors * theta**exponents), attention


def _dynamic(rotary_dim: int, theta: float, factor: float, original: int, seq_len: int | torch.Tensor | None,
             exponents: torch.Tensor) -> torch.Tensor:
    """NTK: the base grows with seq_len past ``original`` (in float32 for a tensor seq_len, as transformers)."""
    if seq_len is None:
        seq_len = original
    elif isinstance(seq_len, torch.Tensor):
        seq_len = torch.maximum(seq_len, torch.tensor(original, dtype=seq_len.dtype, device=seq_len.device))
    else:
        seq_len = max(seq_len, original)
    base = theta * ((factor * seq_len / original) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    return 1.0 / (base**exponents)


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: low frequencies / factor, high ones kept, a smooth mix between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rotary_dim: int, theta: float, scaling: Mapping[str, Any], exponents: torch.Tensor
          ) -> tuple[torch.Tensor, float]:
    """YaRN: extrapolated high frequencies, interpolated low ones, a linear ramp between; an attention factor."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return (rotary_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32, device=exponents.device) - low)
                       / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = theta**exponents
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, Dh) rotated by cos/sin (B|1, T, R) on its first R features (half-split pairs); the rest kept."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    width = cos.shape[-1]
    rot = x[..., :width]
    half = width // 2
    rotated = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return rotated if width == x.shape[-1] else torch.cat((rotated, x[..., width:]), dim=-1)


class Rotary(nn.Module):
    """Rotary positions of one attention layer: q and k of each row rotated at its positions.

    ``theta`` is explicit so a model can hold two (Gemma 3's local layers have their own base). The frequencies
    are kept per device outside the module's buffers, so a model cast to bfloat16 keeps them in float32.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.rotary_dim = rotary_dim or head_dim
        check_scaling(scaling, self.rotary_dim)
        self.scaling = dict(scaling) if scaling is not None else None
        self.rope_type = "default" if scaling is None else scaling["rope_type"]
        # computed on the CPU even where a model is built on the meta device (model.build.build_empty)
        self.attention_factor = inverse_frequencies(self.rotary_dim, theta, scaling, device=torch.device("cpu"))[1]
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._angle_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # cos, sin (1, N, R)

    @classmethod
    def from_config(cls, config: Any) -> Rotary:
        """The rotary positions of a config's (global) layers."""
        return cls(config.head_dim, config.rope_theta, config.rope_scaling, config.rotary_dim)

    def _frequencies(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(initial frequencies, longrope's long ones) on ``device``."""
        tables = self._tables.get(device)
        if tables is None:
            initial, _ = inverse_frequencies(self.rotary_dim, self.theta, self.scaling, device=device)
            long = None
            if self.rope_type == "longrope":
                past = self.scaling["original_max_position_embeddings"] + 1
                long, _ = inverse_frequencies(self.rotary_dim, self.theta, self.scaling, past, device)
            tables = self._tables[device] = (initial, long)
        return tables

    def frequencies(self, positions: torch.Tensor) -> torch.Tensor:
        """Inverse frequencies (R/2,) float32 for a forward at ``positions``: dynamic and longrope pick them by the
        largest position + 1 over the whole batch (no host sync), the other types have one set."""
        initial, long = self._frequencies(positions.device)
        if self.rope_type not in ("dynamic", "longrope"):
            return initial
        seq_len = positions.max() + 1
        original = self.scaling["original_max_position_embeddings"]
        if self.rope_type == "longrope":
            return torch.where(seq_len > original, long, initial)
        grown, _ = inverse_frequencies(self.rotary_dim, self.theta, self.scaling, seq_len, positions.device)
        return torch.where(seq_len > original, grown, initial)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (B|1, T, R) float32 at ``positions`` (B|1, T), times the attention factor: the one
        computation of the angles, for the PyTorch path and the C++ step alike."""
        freqs = positions[..., None].float() * self.frequencies(positions)  # (B, T, R/2)
        angles = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor

    def cos_sin_from(self, start: int, tokens: int, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`cos_sin` at positions ``start`` .. ``start + tokens - 1`` of one row, (1, tokens, R) contiguous,
        sliced from a table that :meth:`cos_sin` computed for positions 0 .. N - 1 (the same float32 operations
        element by element, so the same bits; grown by doubling): a step's angles without its trig (37 us of a
        SmolLM2 step). None for dynamic and longrope, whose frequencies depend on the batch's positions."""
        if self.rope_type in ("dynamic", "longrope"):
            return None
        end = start + tokens
        table = self._angle_tables.get(device)
        if table is None or table[0].shape[1] < end:
            size = max(end, 2 * table[0].shape[1] if table is not None else 256)
            table = self._angle_tables[device] = self.cos_sin(torch.arange(size, device=device)[None])
        cos, sin = table
        return cos[:, start:end], sin[:, start:end]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, Dh) rotated at ``positions`` (B|1, T)."""
        cos, sin = self.cos_sin(positions)
        return apply_rotary(x, cos, sin)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, theta={self.theta}, rope_type={self.rope_type}"
