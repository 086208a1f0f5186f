"""Run a test job on gloo ranks in fresh processes, failing in bounded time rather than hanging."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

JOB_SECONDS = 600  # far above any job's time here (the first DeepSpeed engine builds its C++ op: about a minute)


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, *, seconds: float = JOB_SECONDS) -> None:
    """Run ``fn(rank, *args)`` on `nprocs` spawned processes and wait for all of them.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback in the message).
        TimeoutError: the ranks did not all finish within `seconds` (a hung rendezvous or a stale
            build lock); they are terminated.
    """
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {nprocs} rank(s) did not finish in {seconds:.0f} s")
