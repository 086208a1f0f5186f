"""The GPU benchmark's measurements, in this process on the current CUDA device.

- A *step* is a fixed run of bf16 matrix products on the current stream, about `--step-ms`
  long: the training's compute. `normal` is its median time alone.
- A save's *stall* is the time from calling the save to the end of the next step (the host
  synchronized with the current stream before and after), minus `normal`: what the save costs the training, whether it
  blocks the host or makes the current stream wait. DCP's stagers that return before staging
  ends are waited for (``staging_completion``) before the step, since the state may not change
  until then.
- The *background slowdown* is the median time of the steps run while the save is still being
  written, over `normal`, less one.
- Host memory is the peak resident set added during one whole save (`benchmarks.memory`).

Each tool runs `repeats + 1` saves; the first (which allocates buffers) is reported apart and
left out of the medians.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.cache import evict_files, files_under
from benchmarks.gpu_state import empty_like_state, tensors_of
from benchmarks.memory import PeakRss

DCP_VARIANTS = ("defaults", "BlockingAsyncStager(cache_staged_state_dict=True)", "DefaultStager(pinned)")
_MATRIX = 8192


@dataclass
class Step:
    """`iters` bf16 products of two square matrices on the current stream."""

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor
    iters: int

    def run(self) -> None:
        for _ in range(self.iters):
            torch.mm(self.a, self.b, out=self.out)


def timed(fn: Callable[[], Any]) -> float:
    """The time of `fn` and of the work it queued on the current stream. Only the current stream
    is waited for: a save's work on other streams (a device snapshot's drain to the host, on the
    side stream) is not the training's time, and the steps that overlap it count as slowed."""
    stream = torch.cuda.current_stream()
    stream.synchronize()
    start = time.perf_counter()
    fn()
    stream.synchronize()
    return time.perf_counter() - start


def calibrated_step(target_s: float) -> Step:
    """A step of about `target_s` on this GPU."""
    a = torch.randn(_MATRIX, _MATRIX, device="cuda", dtype=torch.bfloat16)
    step = Step(a, a.clone(), torch.empty_like(a), 10)
    timed(step.run)  # warm up
    per_iter = statistics.median(timed(step.run) for _ in range(3)) / step.iters
    step.iters = max(1, round(target_s / per_iter))
    return step


def normal_step_s(step: Step, repeats: int = 5) -> float:
    return statistics.median(timed(step.run) for _ in range(repeats))


def _stall(save: Callable[[], Any], step: Step, normal: float) -> tuple[float, Any]:
    stream = torch.cuda.current_stream()  # as in `timed`: the training's stream alone
    stream.synchronize()
    start = time.perf_counter()
    result = save()
    step.run()
    stream.synchronize()
    return time.perf_counter() - start - normal, result


def _steps_while(step: Step, busy: Callable[[], bool], normal: float) -> float | None:
    times = []
    while busy():
        times.append(timed(step.run))
    return statistics.median(times) / normal - 1 if times else None


def _summary(stalls: list[float], slowdowns: list[float | None], peaks: list[int], **extra: Any) -> dict[str, Any]:
    measured = [s for s in slowdowns[1:] if s is not None]
    return {
        "stall_s": statistics.median(stalls[1:]), "first_stall_s": stalls[0], "all_stall_s": stalls,
        "slowdown": statistics.median(measured) if measured else None,
        "host_peak_added_bytes": max(peaks[1:]), "first_host_peak_added_bytes": peaks[0], **extra,
    }


def release() -> None:
    """Give back the memory of the tools measured before: GPU and pinned host caches."""
    gc.collect()
    torch.cuda.empty_cache()
    # Freed pinned blocks stay cached by torch unless given back.
    host_empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()


def measure_copy(state: dict[str, Any], to: str, repeats: int) -> dict[str, Any]:
    """Time copying every tensor into preallocated buffers: pinned host ("host") or GPU ("device")."""
    tensors = tensors_of(state)
    if to == "host":
        bufs = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    else:
        bufs = [torch.empty_like(t) for t in tensors]

    def copy() -> None:
        for buf, t in zip(bufs, tensors):
            buf.copy_(t, non_blocking=True)

    times = [timed(copy) for _ in range(repeats + 1)]
    del bufs
    release()
    return {"seconds": statistics.median(times[1:]), "all_s": times}


def measure_manager(state: dict[str, Any], kind: str, root: str, step: Step, repeats: int) -> dict[str, Any]:
    """Stalls, slowdowns and host memory of CheckpointManager saves with ``snapshot=kind``."""
    from ckptkit.writer.manager import CheckpointManager

    normal = normal_step_s(step)
    stalls: list[float] = []
    calls: list[float] = []
    slowdowns: list[float | None] = []
    peaks: list[int] = []
    with CheckpointManager(root, keep_last=1, snapshot=kind) as manager:
        for i in range(repeats + 1):
            with PeakRss() as rss:
                stall, handle = _stall(lambda: manager.save(i + 1, state), step, normal)
                slowdowns.append(_steps_while(step, lambda: not handle.committed.done(), normal))
                manager.wait()
            stalls.append(stall)
            calls.append(handle.stall_s)
            peaks.append(rss.peak - rss.before)
        choice = handle.snapshot
        pools = {"host_buffer_bytes": manager.host_buffer_bytes, "device_buffer_bytes": manager.device_buffer_bytes}
        profile = _profiled_save(manager, repeats + 2, state) if kind == "device" else None
    del manager
    release()
    # save_call_s: how long save() itself held the host (the rest of the stall is the GPU's); the
    # profile (device snapshots) comes after the measured saves, so its overhead is in none of them
    return _summary(stalls, slowdowns, peaks, normal_step_s=normal, snapshot=choice.kind if choice else None,
                    snapshot_reason=choice.reason if choice else None, save_call_s=statistics.median(calls[1:]),
                    all_save_call_s=calls, **({"profile": profile} if profile is not None else {}), **pools)


def _profiled_save(manager: Any, step_no: int, state: dict[str, Any]) -> list[dict[str, Any]]:
    """The 15 operations that took the most host time in one more save() call, by torch.profiler
    (CPU and CUDA activity): where a save's fixed cost goes."""
    from torch.profiler import ProfilerActivity, profile

    try:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            manager.save(step_no, state)
            torch.cuda.synchronize()
        manager.wait()
        rows = sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total)[:15]
        return [{"op": e.key, "calls": e.count, "cpu_total_ms": e.cpu_time_total / 1e3,
                 "device_total_ms": (e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total) / 1e3}
                for e in rows]
    except Exception as exc:  # the profile is a diagnosis: its failure leaves the measurements
        return [{"op": f"profile failed: {type(exc).__name__}: {exc}".splitlines()[0], "calls": 0, "cpu_total_ms": 0.0,
                 "device_total_ms": 0.0}]


def _stager(variant: str) -> Any:
    from torch.distributed.checkpoint.staging import BlockingAsyncStager, DefaultStager, StagingOptions

    if variant == "defaults":
        return None
    if variant.startswith("BlockingAsyncStager"):
        return BlockingAsyncStager(cache_staged_state_dict=True)
    return DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True))


LEFT_BEHIND: list[threading.Thread] = []  # measurements `within` gave up on, still running


def within(seconds: float, measure: Callable[[dict[str, str]], dict[str, Any]],
           progress: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``measure(progress)`` in a daemon thread for at most `seconds`; return its result, or
    ``{"error": ...}`` naming the last `progress["at"]` it reached when it did not finish in time
    (the thread is left behind, in `LEFT_BEHIND`: a tool that hangs must not stop the measurements
    after it)."""
    progress = {"at": "starting"} if progress is None else progress
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = measure(progress)
        except BaseException as exc:  # reported by the caller's thread
            box["result"] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}

    thread = threading.Thread(target=target, name="measure", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        LEFT_BEHIND.append(thread)
        return {"error": f"did not finish within {seconds:g} s (stuck at: {progress['at']})", "timed_out": True}
    result: dict[str, Any] = box["result"]
    return result


def measure_dcp(state: dict[str, Any], variant: str, directory: str, step: Step, repeats: int,
                progress: dict[str, str] | None = None) -> dict[str, Any]:
    """Stalls, slowdowns and host memory of DCP ``async_save`` with one of DCP_VARIANTS' stagers;
    a failure is reported as ``{"error": ...}``; each phase is noted in `progress["at"]` (for
    `within`)."""
    progress = {} if progress is None else progress
    stager = None
    try:
        from torch.distributed.checkpoint import async_save

        stager = _stager(variant)
        normal = normal_step_s(step)
        stalls: list[float] = []
        slowdowns: list[float | None] = []
        peaks: list[int] = []
        for i in range(repeats + 1):
            path = os.path.join(directory, f"dcp{i}")
            save_no = f"save {i + 1} of {repeats + 1}"

            def save() -> Any:
                progress["at"] = f"{save_no}: async_save"
                response = async_save(state, checkpoint_id=path, no_dist=True, async_stager=stager)
                if hasattr(response, "staging_completion"):
                    progress["at"] = f"{save_no}: staging_completion"
                    response.staging_completion.result()  # the state may change only after this
                progress["at"] = f"{save_no}: the step after the save"
                return getattr(response, "upload_completion", response)

            with PeakRss() as rss:
                stall, upload = _stall(save, step, normal)
                progress["at"] = f"{save_no}: steps while the upload runs"
                slowdowns.append(_steps_while(step, lambda: not upload.done(), normal))
                upload.result()
            stalls.append(stall)
            peaks.append(rss.peak - rss.before)
            shutil.rmtree(path, ignore_errors=True)
        return _summary(stalls, slowdowns, peaks, normal_step_s=normal)
    except Exception as exc:  # reported, not raised: one DCP variant failing leaves the others
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    finally:
        progress["at"] = "closing the stager"
        if stager is not None:
            stager.close()
        shutil.rmtree(directory, ignore_errors=True)
        stager = None
        release()


def cold_read(path: str, repeats: int) -> dict[str, Any]:
    """Time reading every file under `path` from a cold page cache into one reused buffer."""
    names = files_under(path)
    buffer = memoryview(bytearray(64 << 20))
    times = []
    for _ in range(repeats):
        evict_files(path)
        start = time.perf_counter()
        total = 0
        for name in names:
            with open(name, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    total += n
        times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "all_s": times, "bytes": total}


def load_pool_bytes() -> int | None:
    """The pinned bounce pool ``ckptkit.load`` reads CUDA targets through (its default size),
    or None if this ckptkit's load has none."""
    import inspect

    import ckptkit

    default = inspect.signature(ckptkit.load).parameters.get("pinned_bytes")
    return default.default if default is not None and isinstance(default.default, int) else None


def measure_load(tool: str, path: str, state: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Time a cold load of `path` into CUDA tensors shaped as `state`: ``ckptkit.load`` or DCP's
    ``load``; check one tensor against `state`. A failure, or a load that does not fill the CUDA
    targets, is reported as ``{"unavailable": ...}``."""
    target = empty_like_state(state)
    times, peaks = [], []
    try:
        for _ in range(repeats):
            evict_files(path)
            with PeakRss() as rss:
                torch.cuda.synchronize()
                start = time.perf_counter()
                if tool == "ckptkit":
                    import ckptkit

                    out = ckptkit.load(path, target)
                else:
                    import torch.distributed.checkpoint as dcp

                    dcp.load(target, checkpoint_id=path, no_dist=True)
                    out = target
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            peaks.append(rss.peak - rss.before)
        got = out["optimizer"]["master"]["embed.weight"]
        if got.device.type != "cuda" or not torch.equal(got, state["optimizer"]["master"]["embed.weight"]):
            return {"unavailable": f"{tool} load did not fill the CUDA targets with the saved values (got {got.device})"}
    except Exception as exc:
        return {"unavailable": f"{type(exc).__name__}: {exc}".splitlines()[0]}
    finally:
        del target
        release()
    return {"seconds": statistics.median(times), "all_s": times, "host_peak_added_bytes": max(peaks)}
