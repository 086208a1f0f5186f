"""The measured phases: each operation runs in a fresh worker process, tools interleaved per repeat.

Within one repeat every tool of a phase runs once, in an order rotated from repeat to repeat,
so that slow drift of a noisy machine touches every tool alike and ratios can be paired by
repeat. Before every operation the cached pages of the whole scratch directory are dropped;
a worker that reads also drops the machine's page cache (see `benchmarks.worker`).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .cache import evict_files

WORKER_TIMEOUT_S = 900
WRITE_LIMIT = "write limit"
READ_LIMIT = "read limit"
# Reads in parallel ranges, as ckptkit verify's threads do; a cold load's second target is 0.9 x this.
PARALLEL_READ_LIMIT = "read limit, 4 threads"
PARALLEL_THREADS = 4
PARALLEL_WRITE_LIMIT = "write limit, 4 threads"
# Informative, no target: the 4-thread read of ckptkit's own payload files (the bytes its load
# reads, where the disk put them), beside the limit's file (on a virtual disk one file of the same
# size can read 2 times faster than another).
FILES_READ_LIMIT = "read limit, 4 threads, its files"

PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "safetensors.torch",
    "ckptkit.ops.save",
    "ckptkit.ops.load",
    "ckptkit.ops.verify",
    "benchmarks.worker",
)

Runs = dict[str, list[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Settings:
    """What every phase needs: state size, repeats, scratch directory, and a progress printer."""

    size_mib: int
    repeats: int
    work: str
    say: Callable[[str], None]

    def save_dir(self, tool: str) -> str:
        return os.path.join(self.work, "save", tool.replace(" ", "-").replace(",", ""))


def run_worker(request: dict[str, Any]) -> dict[str, Any]:
    """Run one operation in a fresh process; return its figures, or ``{"error": ...}``."""
    from .worker import serve

    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=serve, args=(request, sender), name=f"bench-{request['kind']}")
    process.start()
    sender.close()
    try:
        if not receiver.poll(WORKER_TIMEOUT_S):
            process.kill()
            return {"error": f"timed out after {WORKER_TIMEOUT_S} s"}
        result: dict[str, Any] = receiver.recv()
    except EOFError:
        result = {"error": "the worker process died without a result"}
    finally:
        process.join()
        receiver.close()
    if process.exitcode and "error" not in result:
        result = {"error": f"the worker process exited with status {process.exitcode}"}
    return result


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    # Workers fork from a server that has imported torch and every tool once: a fresh process
    # per operation without paying seconds of imports each time. Nothing has run in the
    # server, so no thread or allocator state is inherited.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


def rotated(tools: list[str], repeat: int) -> list[str]:
    shift = repeat % len(tools)
    return tools[shift:] + tools[:shift]


def run_rounds(settings: Settings, phase: str, tools: list[str], request_for: Callable[[str], dict[str, Any]]) -> Runs:
    """Run every tool once per repeat, rotating the order; return each tool's runs."""
    runs: Runs = {tool: [] for tool in tools}
    for repeat in range(settings.repeats):
        for tool in rotated(tools, repeat):
            request = {"size_mib": settings.size_mib, **request_for(tool)}
            if request["kind"] in ("save", "write-limit", "checksums-save"):
                _clear(request["directory"])
            evict_files(settings.work)
            result = run_worker(request)
            runs[tool].append(result)
            settings.say(f"[{phase} {repeat + 1}/{settings.repeats}] {tool:<22} {_brief(result)}")
    return runs


def _clear(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    # Deleting gigabytes queues discards and journal work; let it finish before timing a write.
    os.sync()


def _brief(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"FAILED: {result['error']}"
    return f"{result['seconds']:.2f} s"


def save_phase(settings: Settings, dcp_threads: list[int]) -> Runs:
    """Time a durable save of the state by every tool, and the machine's durable write limits (one
    stream, and 4 threads writing a quarter of the file each)."""
    tools = [WRITE_LIMIT, PARALLEL_WRITE_LIMIT, "ckptkit", "torch.save", "safetensors"] + [f"dcp-t{n}" for n in dcp_threads]
    return run_rounds(settings, "save", tools, lambda tool: _save_request(settings, tool))


def _save_request(settings: Settings, tool: str) -> dict[str, Any]:
    if tool in (WRITE_LIMIT, PARALLEL_WRITE_LIMIT):
        threads = PARALLEL_THREADS if tool == PARALLEL_WRITE_LIMIT else 1
        return {"kind": "write-limit", "tool": tool, "directory": settings.save_dir(tool), "threads": threads}
    return {"kind": "save", "tool": tool, "directory": settings.save_dir(tool)}


def load_phase(settings: Settings, dcp_source: str, *, warm: bool = False) -> Runs:
    """Time a cold load of every tool's checkpoint, and the machine's cold read limits (one
    stream, several); with `warm`, of checkpoints read once just before (in the page cache), and
    the page-cache read limits.

    Checkpoints missing from the scratch directory (no save phase in this run) are written
    first, untimed. `dcp_source` names the DCP save whose checkpoint ``dcp`` loads.
    """
    from .loads import SOURCES

    sources = {tool: dcp_source if source == "dcp" else source for tool, source in SOURCES.items()}
    _ensure_saved(settings, sorted({WRITE_LIMIT, *sources.values()}))

    def request_for(tool: str) -> dict[str, Any]:
        if tool in (READ_LIMIT, PARALLEL_READ_LIMIT):
            return {**_read_limit_request(settings, tool), "warm": warm}
        if tool == FILES_READ_LIMIT:
            return {"kind": "read-limit", "tool": tool, "directory": settings.save_dir("ckptkit"), "threads": PARALLEL_THREADS,
                    "payload_files": True, "warm": warm}
        return {"kind": "load", "tool": tool, "directory": settings.save_dir(sources[tool]), "warm": warm}

    limits = [READ_LIMIT, PARALLEL_READ_LIMIT] + ([] if warm else [FILES_READ_LIMIT])
    return run_rounds(settings, "load-warm" if warm else "load", [*limits, *SOURCES], request_for)


def _read_limit_request(settings: Settings, tool: str) -> dict[str, Any]:
    threads = PARALLEL_THREADS if tool == PARALLEL_READ_LIMIT else 1
    return {"kind": "read-limit", "tool": tool, "directory": settings.save_dir(WRITE_LIMIT), "threads": threads}


def verify_phase(settings: Settings, workers: int) -> Runs:
    """Time ckptkit's full verify of its checkpoint, cold, against the cold read limit."""
    _ensure_saved(settings, [WRITE_LIMIT, "ckptkit"])

    def request_for(tool: str) -> dict[str, Any]:
        if tool in (READ_LIMIT, PARALLEL_READ_LIMIT):
            return _read_limit_request(settings, tool)
        return {"kind": "verify", "tool": tool, "directory": settings.save_dir("ckptkit"), "workers": workers}

    return run_rounds(settings, "verify", [READ_LIMIT, PARALLEL_READ_LIMIT, "ckptkit verify"], request_for)


def _ensure_saved(settings: Settings, tools: list[str]) -> None:
    for tool in tools:
        if not os.path.exists(settings.save_dir(tool)):
            settings.say(f"[prepare] writing the {tool} checkpoint (untimed)")
            result = run_worker({"size_mib": settings.size_mib, **_save_request(settings, tool)})
            if "error" in result:
                settings.say(f"[prepare] {tool} FAILED: {result['error']}")
                _clear(settings.save_dir(tool))
