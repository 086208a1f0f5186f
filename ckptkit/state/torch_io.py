"""The torch side of payloads: dtype names, zero-copy byte views of tensors, leaf detection."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import LayoutError
from .sharded import ShardedTensor

_TO_NAME: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
    torch.complex64: "complex64",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
    if hasattr(torch, _name):
        _TO_NAME[getattr(torch, _name)] = _name
_FROM_NAME = {v: k for k, v in _TO_NAME.items()}


def dtype_name(dtype: torch.dtype, *, fqn: str = "") -> str:
    """Return the manifest name of a torch dtype."""
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise LayoutError(f"{fqn or 'tensor'}: dtype {dtype} cannot be saved") from None


def torch_dtype(name: str) -> torch.dtype:
    """Return the torch dtype of a manifest dtype name."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise LayoutError(f"dtype {name!r} has no torch equivalent in this torch {torch.__version__}") from None


def byte_view(tensor: torch.Tensor) -> memoryview:
    """Return the bytes of a contiguous CPU tensor, without copying."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def byte_array(tensor: torch.Tensor) -> Any:
    """Return the bytes of a contiguous CPU tensor as a writable uint8 numpy array of its byte
    shape (its shape, the last dim times the item size; 0-d: one row), without copying."""
    size = tensor.element_size()
    shape = (*tensor.shape[:-1], tensor.shape[-1] * size) if tensor.dim() else (size,)
    if tensor.numel() == 0:
        return np.empty(shape, np.uint8)
    return tensor.reshape(-1).view(torch.uint8).numpy().reshape(shape)


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """Return `tensor` detached, on the CPU and contiguous (a copy only when needed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous()


def is_leaf(value: Any) -> bool:
    """Tensor leaves of a state: tensors, ShardedTensors, and lists of ShardedTensors."""
    if isinstance(value, (torch.Tensor, ShardedTensor)):
        return True
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, ShardedTensor) for v in value)


def leaf_shards(value: Any) -> list[ShardedTensor]:
    """Return the boxes a tensor leaf stands for (a plain tensor is the whole tensor)."""
    if isinstance(value, torch.Tensor):
        return [ShardedTensor(value, tuple(value.shape), (0,) * value.dim())]
    if isinstance(value, ShardedTensor):
        return [value]
    return list(value)
