"""Start a few torch.distributed ranks on this machine (gloo), for the demo, tests and tools."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

from .. import CkptkitError


def free_port() -> int:
    """Return a TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` in `world_size` processes joined in one process group.

    `fn` must be importable (a module-level function).

    Raises:
        CkptkitError: a rank failed; the message names the rank that failed first and its error
            (the other ranks' failures usually follow from it: a peer closed the connection).
    """
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    port = free_port()
    # When one rank fails torch stops the others and logs a line per rank ("Terminating process
    # ... via signal SIGTERM"); the one error this raises says what happened. The spawned ranks
    # inherit the environment.
    quieted = "TORCH_CPP_LOG_LEVEL" not in os.environ
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # nor the peers' c10d warnings, stack and all
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    # The ranks are forked from a server process that imported torch and `fn`'s module once (not
    # an interpreter started and torch imported per rank, seconds each); the server has not
    # touched CUDA, so each rank initialises its own. A rank takes the caller's environment as
    # it is now (the server's is the one it started with).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", fn.__module__])
    with tempfile.TemporaryDirectory(prefix="ckptkit-ranks-") as errors:
        try:
            mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
                _entry, args=(fn, world_size, port, backend, errors, dict(os.environ), args), nprocs=world_size,
                join=True, start_method="forkserver",
            )
        except (ProcessRaisedException, ProcessExitedException) as exc:
            raise CkptkitError(_first_failure(errors) or f"rank {exc.error_index} failed") from exc
        finally:
            spawn_log.setLevel(level)
            if quieted:
                os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def _first_failure(directory: str) -> str:
    reports = []
    for name in os.listdir(directory):
        if not name.endswith(".json"):  # a report a rank was stopped while writing (its temporary)
            continue
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            reports.append(json.load(f))
    if not reports:
        return ""
    first = min(reports, key=lambda r: r["time"])
    return f"rank {first['rank']} failed: {first['error']}"


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str, errors: str, environ: dict[str, str],
    args: tuple[Any, ...],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException as exc:
        report = {"rank": rank, "time": time.time(), "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        # written whole, then renamed: torch stops the other ranks as soon as one fails, maybe mid-write
        path = os.path.join(errors, f"rank{rank}.json")
        with open(f"{path}.tmp", "w", encoding="utf-8") as f:
            json.dump(report, f)
        os.replace(f"{path}.tmp", path)
        raise
    finally:
        dist.destroy_process_group()
