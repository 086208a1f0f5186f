"""Run a test job on gloo ranks in processes of their own, failing in bounded time rather than hanging."""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

JOB_SECONDS = 600  # far above any job's time here (the first DeepSpeed engine builds its C++ op: about a minute)


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, *, seconds: float = JOB_SECONDS) -> None:
    """Run ``fn(rank, *args)`` on `nprocs` processes of their own and wait for all of them.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank failed (its traceback in the message).
        TimeoutError: the ranks did not all finish within `seconds` (a hung rendezvous or a stale
            build lock); they are terminated.
    """
    # Forked from a server that imported torch and `fn`'s module once (as ckptkit's own launcher
    # does); each rank takes this process's environment as it is now.
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", fn.__module__])
    context = mp.start_processes(_entry, args=(fn, dict(os.environ), args), nprocs=nprocs, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + seconds
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {nprocs} rank(s) did not finish in {seconds:.0f} s")


def _entry(rank: int, fn: Callable[..., None], environ: dict[str, str], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)
