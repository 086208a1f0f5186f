"""Loads of one state by each tool, every byte read into tensors, plus ckptkit's verify.

Each loader takes the directory its saver wrote and the state's specs and returns the flat
state. safetensors maps files lazily, so every page of every tensor is touched afterwards
(`touch_pages`); the other loaders get the same touch, which costs them next to nothing.
As for saves, the worker imports ``REQUIRES[tool]`` before it starts the clock.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from .state import TensorSpec, empty_state

if TYPE_CHECKING:
    import torch

State = dict[str, "torch.Tensor"]
PAGE = 4096
MAPPED = "ckptkit, mapped"  # ckptkit.load(..., mapped=True): tensors that view the page cache, locked and checked
REQUIRES = {
    "ckptkit": ("torch", "ckptkit.ops.load"),
    MAPPED: ("torch", "ckptkit.ops.load"),
    "torch.load": ("torch",),
    "safetensors": ("torch", "safetensors.torch"),
    "safetensors-pread": ("torch", "safetensors.torch"),
    "dcp": ("torch", "torch.distributed.checkpoint"),
    "ckptkit verify": ("ckptkit.ops.verify",),
}


def touch_pages(state: State) -> int:
    """Read one byte of every page of every tensor (and its last byte); return a checksum of them."""
    import torch

    total = 0
    for tensor in state.values():
        raw = tensor.reshape(-1).view(torch.uint8)
        if raw.numel():
            total += int(raw[::PAGE].sum()) + int(raw[-1])
    return total


def load_ckptkit(directory: str, specs: list[TensorSpec]) -> State:
    from ckptkit.ops.load import load

    return load(os.path.join(directory, "step_1"))


def load_ckptkit_mapped(directory: str, specs: list[TensorSpec]) -> State:
    from ckptkit.ops.load import load

    return load(os.path.join(directory, "step_1"), mapped=True)


def load_torch(directory: str, specs: list[TensorSpec]) -> State:
    import torch

    state: State = torch.load(os.path.join(directory, "state.pt"), mmap=False, weights_only=True)
    return state


def safetensors_loader(backend: str) -> Callable[[str, list[TensorSpec]], State]:
    """Return a load by safetensors ``load_file`` with the given backend ("mmap" or "pread")."""

    def load_safetensors(directory: str, specs: list[TensorSpec]) -> State:
        from safetensors.torch import load_file

        return load_file(os.path.join(directory, "state.safetensors"), backend=backend)

    return load_safetensors


def load_dcp(directory: str, specs: list[TensorSpec]) -> State:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    state = empty_state(specs)  # DCP loads in place, into tensors of the right shapes
    load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    return state


LOADERS: dict[str, Callable[[str, list[TensorSpec]], State]] = {
    "ckptkit": load_ckptkit,
    MAPPED: load_ckptkit_mapped,
    "torch.load": load_torch,
    "safetensors": safetensors_loader("mmap"),
    "safetensors-pread": safetensors_loader("pread"),
    "dcp": load_dcp,
}

# The save whose output each loader reads ("dcp" is resolved to the fastest DCP save).
SOURCES = {
    "ckptkit": "ckptkit",
    MAPPED: "ckptkit",
    "torch.load": "torch.save",
    "safetensors": "safetensors",
    "safetensors-pread": "safetensors",
    "dcp": "dcp",
}


def verify_ckptkit(directory: str, workers: int) -> None:
    """Run ckptkit's full verify (every checksum); raise if it finds anything."""
    from ckptkit.ops.verify import verify

    report = verify(os.path.join(directory, "step_1"), quick=False, workers=workers)
    if not report.ok:
        raise RuntimeError(f"verify found problems: {[f.message for f in report.findings][:5]}")
