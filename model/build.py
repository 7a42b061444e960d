"""A model of a config, and where it runs: its family's class, the device and the dtype.

A leaf below model.checkpoint and model.hf, which both build models. A model whose weights are read next is built
empty (:func:`build_empty`: parameters on the meta device, no memory, no random init) and takes the tensors read
as its parameters (:func:`load_into`): loading holds the weights once, not a random copy beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from model.causal_lm import CausalLM
from model.classifier import TransformerClassifier
from model.config import TransformerConfig
from model.seq2seq import Seq2SeqTransformer

MODELS: dict[str, type[nn.Module]] = {
    "seq2seq": Seq2SeqTransformer,
    "classifier": TransformerClassifier,
    "causal_lm": CausalLM,
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def build_model(config: TransformerConfig) -> nn.Module:
    """Instantiate the model class of ``config.family``."""
    return MODELS[config.family](config)


class _NoInitOnMeta(TorchFunctionMode):
    """torch.nn.init's functions leave a meta tensor as it is: they would compute nothing, yet the first of them on
    the meta device imports torch._dynamo and sympy (~75 MB and a second, once in a process)."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def build_empty(config: TransformerConfig) -> nn.Module:
    """The model of ``config`` with its parameters on the meta device and not initialised, for :func:`load_into`;
    what a module computes from the config (sinusoids, rotary factors: made on the CPU explicitly) is real."""
    with torch.device("meta"), _NoInitOnMeta():
        return build_model(config)


def load_into(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make ``tensors`` (every state-dict key of ``model``, tied ones included) the parameters and buffers of
    ``model`` built by :func:`build_empty`, without copying those that own their storage; tied parameters stay one
    Parameter (the first name's tensor), and parameters that are not tied never share storage (a tensor given
    twice is copied). Raises RuntimeError (load_state_dict's) for a missing or unexpected key or a shape mismatch."""
    first: dict[int, str] = {}
    ties = {}  # a tied parameter's later name -> its first
    for name, parameter in model.named_parameters(remove_duplicate=False):
        ties[name] = first.setdefault(id(parameter), name)
    state, storages = {}, set()
    for name, tensor in tensors.items():
        if ties.get(name, name) == name:  # a later tied name's tensor is replaced by its first's Parameter below
            tensor = _owning(tensor)
            if tensor.untyped_storage().data_ptr() in storages:
                tensor = tensor.clone()
            storages.add(tensor.untyped_storage().data_ptr())
        state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    for name, source in ties.items():
        if name != source:
            module, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(module), attribute, model.get_parameter(source))
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{left[0]} was not loaded ({len(left)} tensors in all)")


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy where it is a view of a larger one (an importer's slice or transpose)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """ "auto" -> CUDA when available, else CPU."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """ "auto"/None -> bf16 on CUDA (fp16 where bf16 is unsupported), fp32 on CPU. Raises ValueError for a name
    not in DTYPES."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]
