"""Start a few torch.distributed ranks on this machine (gloo), for the demo, tests and tools."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """Return a TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` in `world_size` spawned processes joined in one process group.

    `fn` must be importable (a module-level function). Raises if any rank fails.
    """
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
        _entry, args=(fn, world_size, port, backend, args), nprocs=world_size, join=True, start_method="spawn"
    )


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str, args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
