"""Durable saves of one state by each tool: every function returns once the bytes are fsynced.

Each function takes the flat state and a directory it creates, and returns nothing; the
caller times it. The peers write one file where that is their usual layout. A tool's
modules are imported inside its function, so a worker loads only the tool it measures; the
worker imports ``REQUIRES[tool]`` before it starts the clock, for import time is not save time.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

State = dict[str, torch.Tensor]
DCP_PREFIX = "dcp-t"
REQUIRES = {
    "ckptkit": ("ckptkit.ops.save",),
    "torch.save": (),
    "safetensors": ("safetensors.torch",),
    "dcp": ("torch.distributed.checkpoint",),
}


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_ckptkit(state: State, directory: str) -> None:
    from ckptkit.ops.save import save

    save(state, os.path.join(directory, "step_1"), step=1)


def save_torch(state: State, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "state.pt"), "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_safetensors(state: State, directory: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "state.safetensors")
    save_file(state, path)
    fsync_file(path)


def dcp_saver(thread_count: int) -> Callable[[State, str], None]:
    """Return a save by torch.distributed.checkpoint with `thread_count` writer threads."""

    def save_dcp(state: State, directory: str) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        # No process group: one process saving alone, as DCP allows with no_dist.
        writer = FileSystemWriter(directory, sync_files=True, thread_count=thread_count)
        save(state, storage_writer=writer, no_dist=True)

    return save_dcp


SAVERS: dict[str, Callable[[State, str], None]] = {
    "ckptkit": save_ckptkit,
    "torch.save": save_torch,
    "safetensors": save_safetensors,
}


def saver_for(tool: str) -> Callable[[State, str], None]:
    """Return the save function of a tool name ("dcp-t<threads>" for DCP)."""
    if tool.startswith(DCP_PREFIX):
        return dcp_saver(int(tool.removeprefix(DCP_PREFIX)))
    return SAVERS[tool]


def modules_for(tool: str) -> tuple[str, ...]:
    """Return the modules a save by `tool` imports."""
    return REQUIRES["dcp" if tool.startswith(DCP_PREFIX) else tool]
