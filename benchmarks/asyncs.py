"""Async save: how long a save blocks the training thread, against a plain copy and DCP's async_save.

The state is the benchmark's fp32 CPU state (2 GiB by default). Three tools, one fresh
process each per repeat, each timing SAVES saves of the same state, each save's background
work finished (untimed) before the next one starts:

- ``copy into preallocated buffer``: ``buf.copy_(tensor)`` for every tensor into buffers
  allocated (and touched) beforehand: the least a save that lets the state change at once can
  block.
- ``ckptkit``: ``CheckpointManager.save`` (root on the same disk, keep_last=1); the first save
  allocates the buffer pool, the next ones reuse it. RSS is sampled after every save commits,
  and a Python loop counts while the background write runs (against the same loop idle), to
  show how much the background work slows the training thread.
- ``dcp async_save``: ``torch.distributed.checkpoint.async_save`` (no process group, thread
  executor, default stager), blocking until it returns its future.

Reported per tool: the median blocking time over saves 2..SAVES (and the first save's).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any

TOOLS = ("copy into preallocated buffer", "ckptkit", "dcp async_save")
SAVES = 10
LOOP_S = 0.5


def run(request: dict[str, Any], specs: list[Any]) -> dict[str, Any]:
    """Run one tool's saves of the state (in a fresh worker process)."""
    import torch

    from .memory import rss_bytes
    from .state import build_state

    tool = request["tool"]
    directory = request["directory"]
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    state = build_state(specs)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    saves = request.get("saves", SAVES)
    blocking: list[float] = []
    extra: dict[str, Any] = {}
    if tool == "copy into preallocated buffer":
        buffers = {k: torch.empty_like(v) for k, v in state.items()}
        for k, v in state.items():
            buffers[k].copy_(v)  # touch every page once
        for _ in range(saves):
            start = time.perf_counter()
            for k, v in state.items():
                buffers[k].copy_(v)
            blocking.append(time.perf_counter() - start)
    elif tool == "ckptkit":
        from ckptkit.writer.manager import CheckpointManager

        idle = _loop_rate(lambda: False, LOOP_S)
        rss = []
        busy = []
        with CheckpointManager(directory, keep_last=1) as manager:
            for step in range(1, saves + 1):
                start = time.perf_counter()
                handle = manager.save(step, {"model": state})
                blocking.append(time.perf_counter() - start)
                busy.append(_loop_rate(handle.committed.done, None))
                manager.wait()
                rss.append(rss_bytes())
        extra = {"rss_after_each_save": rss, "loop_rate_idle": idle, "loop_rate_during_background": statistics.median(busy),
                 "pool_bytes": manager._buffers.allocated_bytes}
    else:
        from torch.distributed.checkpoint import async_save

        for step in range(1, min(saves, 4) + 1):
            path = os.path.join(directory, f"step{step}")
            start = time.perf_counter()
            future = async_save(state, checkpoint_id=path, no_dist=True)
            blocking.append(time.perf_counter() - start)
            (future if hasattr(future, "result") else future.upload_completion).result()
            shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    steady = blocking[1:] or blocking
    return {"seconds": statistics.median(steady), "first_s": blocking[0], "all_s": blocking, "state_bytes": nbytes, **extra}


def _loop_rate(stop: Any, seconds: float | None) -> float:
    """Iterations per second of a plain Python loop, until `stop()` or for `seconds`."""
    count = 0
    start = time.perf_counter()
    while True:
        count += 1
        if count % 1000 == 0:
            elapsed = time.perf_counter() - start
            if (seconds is not None and elapsed >= seconds) or stop():
                return count / elapsed


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians per tool, ckptkit's blocking time over the copy's and over DCP's (paired per
    repeat), and the RSS growth over consecutive saves."""
    from .report import tool_summary

    block = tool_summary(runs, {"vs_copy": "copy into preallocated buffer", "vs_dcp": "dcp async_save"})
    block.pop("rss_bound_bytes")
    for tool, results in runs.items():
        firsts = [r["first_s"] for r in results if "error" not in r]
        if firsts:
            block["tools"][tool]["first_s"] = statistics.median(firsts)
    ours = [r for r in runs.get("ckptkit", []) if "error" not in r]
    growth = max((max(r["rss_after_each_save"][1:]) - r["rss_after_each_save"][0] for r in ours), default=None)
    slowdown = statistics.median(r["loop_rate_during_background"] / r["loop_rate_idle"] for r in ours) if ours else None
    return {**block, "rss_growth_bytes": growth, "loop_rate_during_background": slowdown,
            "state_bytes": ours[0]["state_bytes"] if ours else None}
