"""Run one measured operation in a fresh process.

`serve` is the target of the process `benchmarks.phases` starts for every operation; by
hand, ``python -m benchmarks.worker '<request JSON>'`` runs one and prints its figures. A
fresh process per operation keeps peak-memory figures honest (no allocator caches or page
mappings left by an earlier tool) and lets every operation start from the same state. The
request names the ``kind`` (save, load, verify, write-limit, read-limit, scale, convert, checksums...), the
``tool``, the ``directory`` and the state ``size_mib``; the figures have ``seconds``,
``rss_before``, ``rss_peak`` and ``state_bytes``.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .cache import drop_caches, evict_files, files_under, rewarm_libraries, warm_files
from .limits import read_files_limit, read_limit, write_limit
from .memory import PeakRss
from .state import TensorSpec, build_state, build_tensor, state_bytes, state_specs


def go_cold(request: dict[str, Any]) -> dict[str, Any]:
    """Evict the checkpoint at ``request["directory"]`` from the page cache; call once the tool is imported.

    Unless the request says ``"drop_caches": false``, the machine's whole page cache is
    dropped too, and the libraries this process maps are read back (untimed): cold means
    cold checkpoint files, not cold code. A request with ``"warm": true`` gets the opposite:
    its checkpoint's files read once (untimed), so that the measured read finds them cached.
    """
    figures: dict[str, Any] = {}
    if request.get("warm"):
        figures["warmed_bytes"] = warm_files(request["directory"])
        return figures
    if request.get("drop_caches", True):
        figures["drop_caches"] = drop_caches()
        figures["rewarmed_bytes"] = rewarm_libraries()
    evict_files(request["directory"])
    return figures


def measure(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once; return its result and the seconds and peak RSS it took."""
    gc.collect()
    with PeakRss() as mem:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    figures = {"seconds": seconds, "rss_before": mem.before, "rss_peak": mem.peak, "memory_method": mem.method}
    return result, figures


def import_all(names: tuple[str, ...]) -> None:
    """Import a tool's modules now, so that import time stays out of the measurement."""
    for name in names:
        importlib.import_module(name)


def run_save(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from .saves import modules_for, saver_for

    import_all(modules_for(request["tool"]))
    save = saver_for(request["tool"])
    state = build_state(specs)
    _, figures = measure(lambda: save(state, request["directory"]))
    return figures


def run_load(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from .loads import LOADERS, REQUIRES, touch_pages

    import_all(REQUIRES[request["tool"]])
    load = LOADERS[request["tool"]]
    cold = go_cold(request)

    def load_and_touch() -> dict[str, Any]:
        state = load(request["directory"], specs)
        touch_pages(state)
        return state

    state, figures = measure(load_and_touch)
    figures.update(cold)
    figures["mismatches"] = spot_check(state, specs)
    return figures


def spot_check(state: dict[str, Any], specs: list[TensorSpec]) -> list[str]:
    """Return what is wrong with a loaded state: names, shapes, and the values of three tensors."""
    import torch

    problems = sorted(set(s.name for s in specs) ^ set(state))[:5]
    for spec in specs:
        got = state.get(spec.name)
        if got is not None and tuple(got.shape) != spec.shape:
            problems.append(f"{spec.name}: shape {tuple(got.shape)}, expected {spec.shape}")
    sampled = {s.index: s for s in (specs[0], specs[len(specs) // 2], specs[-1])}
    for spec in sampled.values():
        got = state.get(spec.name)
        if got is not None and not torch.equal(got, build_tensor(spec)):
            problems.append(f"{spec.name}: values differ from the saved ones")
    return problems


def run_verify(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from .loads import REQUIRES, verify_ckptkit

    import_all(REQUIRES["ckptkit verify"])
    cold = go_cold(request)
    _, figures = measure(lambda: verify_ckptkit(request["directory"], request.get("workers", 4)))
    return {**figures, **cold}


def run_limit(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    nbytes = state_bytes(specs)
    if request["kind"] == "write-limit":
        return {"seconds": write_limit(request["directory"], nbytes, request.get("threads", 1))}
    cold = go_cold(request)
    if request.get("payload_files"):
        paths = [p for p in files_under(request["directory"]) if p.endswith(".safetensors")]
        return {"seconds": read_files_limit(paths, request["threads"]), "bytes_read": sum(map(os.path.getsize, paths)), **cold}
    return {"seconds": read_limit(request["directory"], nbytes, request.get("threads", 1)), **cold}


def run_scale(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from dataclasses import asdict

    from .scale import run_scale as measure_scale

    return asdict(measure_scale(request["tensors"], request["ranks"], request["dp"]))


def run_scale_131k(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import deepseek

    return deepseek.run()


def run_scale_ranks(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import rank_plans

    return rank_plans.run()


def run_s3(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import s3s

    return s3s.run(request, specs)


def run_async(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import asyncs

    return asyncs.run(request, specs)


def run_export(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import exports

    return exports.run(request)


def run_convert(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import converts

    if request["kind"] == "convert-prepare":
        return converts.prepare_deepspeed(request["work"], request["size_mib"])
    return converts.run(request)


def run_checksums(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import checksums

    return checksums.run(request, specs)


def run_reshard(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    from . import reshards

    if request["kind"] == "reshard-prepare":
        meta = reshards.prepare(request["work"], request["size_mib"])
        reshards.write_meta(request["work"], meta)
        return meta
    if request["kind"] == "reshard-plan":
        return reshards.plan_at_scale()
    return reshards.run(request)


def run_incremental(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    import os

    from . import incremental

    if request["kind"] == "incremental-speed":
        return {"encode": incremental.encode_speed(), "codec": incremental.codec(os.path.join(request["work"], "codec")),
                "seconds": 0.0}
    return incremental.run(request)


RUNNERS = {
    "save": run_save,
    "load": run_load,
    "verify": run_verify,
    "write-limit": run_limit,
    "read-limit": run_limit,
    "scale": run_scale,
    "scale-131k": run_scale_131k,
    "scale-ranks": run_scale_ranks,
    "reshard": run_reshard,
    "reshard-prepare": run_reshard,
    "reshard-plan": run_reshard,
    "export": run_export,
    "convert": run_convert,
    "convert-prepare": run_convert,
    "async": run_async,
    "s3": run_s3,
    "checksums": run_checksums,
    "checksums-save": run_checksums,
    "checksums-prepare": run_checksums,
    "checksums-reads": run_checksums,
    "incremental": run_incremental,
    "incremental-speed": run_incremental,
}


def run_request(request: dict[str, Any]) -> dict[str, Any]:
    """Run one operation in this process and return its figures."""
    # DCP warns that it runs without a process group, which is what it is asked to do.
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    specs = state_specs(request["size_mib"])
    figures = RUNNERS[request["kind"]](request, specs)
    figures.setdefault("state_bytes", state_bytes(specs))
    return figures


def serve(request: dict[str, Any], conn: Connection) -> None:
    """Run one operation and send its figures, or ``{"error": ...}``, through `conn`."""
    try:
        figures = run_request(request)
    except Exception as exc:  # reported in the results; the other tools still run
        figures = {"error": f"{type(exc).__name__}: {exc}"}
    conn.send(figures)
    conn.close()


def main(argv: list[str]) -> int:
    print(json.dumps(run_request(json.loads(argv[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
