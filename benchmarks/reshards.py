"""Offline reshard: ckptkit against DCP's load-with-resharding plus save, and the disk's limits.

The source is a Llama-shaped checkpoint (parameters and both Adam moments, fp32) of about
the state size, saved as ranks of (tp 4, pp 2, dp 2, ZeRO 1) would; the target is
(tp 2, pp 1, dp 4, ZeRO 2). Three tools, one fresh process each, the source cold:

- ``ckptkit reshard``: the real command line, as a child process (start-up included, its
  modules read back into the page cache first, untimed); its peak RSS is the child's
  high-water mark.
- ``dcp load+save``: the same tensors as a DCP checkpoint; one process loads them into
  freshly allocated tensors with ``torch.distributed.checkpoint.load`` (DCP's resharding
  load) and saves them with ``save`` (2 writer threads, fsync), as an offline job does with
  DCP when no process group of the target size is at hand.
- ``disk limit``: a durable sequential write of the target's bytes plus a cold sequential
  read of the source's bytes (``benchmarks.limits``), the time any reshard must at least take.

The planning benchmark plans 4,096 -> 2,048 ranks of a checkpoint of 1,953 tensors (an 8B-class
model of 72 layers: 651 parameters and their two Adam moments) from the layout alone:
(tp 8, pp 8, dp 64, ZeRO 1) -> (tp 4, pp 4, dp 128, ZeRO 2).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from typing import Any

SOURCE = (4, 2, 2, 1)
TARGET = (2, 1, 4, 2)
PLAN_SOURCE = (8, 8, 64, 1)
PLAN_TARGET = (4, 4, 128, 2)
PLAN_LAYERS = 72
DCP_THREADS = 2


def model_config(size_mib: int) -> Any:
    """A Llama config whose parameters and two Adam moments (fp32) come to about `size_mib` MiB."""
    from ckptkit.trainer.config import ModelConfig

    big = size_mib >= 512
    h, f, vocab = (1024, 2816, 32000) if big else (256, 704, 8000)
    per_layer = 4 * h * h - 2 * h * (h // 2) + 3 * h * f + 2 * h  # q, o full; k, v half (8 of 16 heads); mlp; norms
    fixed = 2 * vocab * h + h
    layers = max(2, round((size_mib * (1 << 20) / 12 - fixed) / per_layer / 2) * 2)
    return ModelConfig(vocab_size=vocab, hidden_size=h, intermediate_size=f, num_layers=layers,
                       num_heads=16, num_kv_heads=8)


def topology(combo: tuple[int, int, int, int]) -> Any:
    from ckptkit.manifest import Topology

    tp, pp, dp, zero = combo
    return Topology(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, zero_stage=zero)


def paths(work: str) -> dict[str, str]:
    base = os.path.join(work, "reshard")
    return {name: os.path.join(base, name) for name in ("seed", "src", "dcp-src", "ckptkit-out", "dcp-out", "limit")}


def prepare(work: str, size_mib: int) -> dict[str, Any]:
    """Write the source checkpoint in both formats (untimed): the full state saved by one
    process, resharded to SOURCE by ckptkit, and the same tensors as a DCP checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptkit
    from ckptkit.manifest import CheckpointInfo, ModelInfo
    from ckptkit.ops.reshard import reshard
    from ckptkit.layouts import stage_units

    p = paths(work)
    for key in ("seed", "src", "dcp-src"):
        shutil.rmtree(p[key], ignore_errors=True)
    cfg = model_config(size_mib)
    shapes = {}
    for pp_rank in range(1):
        for unit in stage_units(cfg.layout(), 1, 0, 1, pp_rank):
            for spec in unit:
                for part in spec.parts:
                    shapes[part.name] = part.global_shape
    assert sorted(shapes) == sorted(cfg.layout().tensors())
    generator = torch.Generator().manual_seed(20241130)
    state: dict[str, Any] = {"model": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    for name, shape in sorted(shapes.items()):
        state["model"][name] = torch.randn(shape, generator=generator)
        state["optimizer"]["exp_avg"][name] = torch.randn(shape, generator=generator) * 1e-3
        state["optimizer"]["exp_avg_sq"][name] = torch.rand(shape, generator=generator) * 1e-6
    info = CheckpointInfo(model=ModelInfo(family="llama", config=cfg.to_json()))
    ckptkit.save(state, p["seed"], step=1000, info=info, update_latest=False)
    reshard(p["seed"], p["src"], topology(SOURCE), update_latest=False)
    shutil.rmtree(p["seed"])
    flat = {f"model/{k}": v for k, v in state["model"].items()}
    for moment in ("exp_avg", "exp_avg_sq"):
        flat.update({f"optimizer/{moment}/{k}": v for k, v in state["optimizer"][moment].items()})
    writer = dcp.FileSystemWriter(p["dcp-src"], thread_count=DCP_THREADS, sync_files=True)
    dcp.save(flat, storage_writer=writer, no_dist=True)
    largest = max(v.numel() * v.element_size() for v in flat.values())
    return {"state_bytes": sum(v.numel() * v.element_size() for v in flat.values()), "largest_tensor_bytes": largest,
            "tensors": len(flat), "layers": cfg.num_layers}


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one measured operation of the reshard phase (in a fresh worker process)."""
    from .cache import evict_files
    from .worker import go_cold, measure

    p = paths(request["work"])
    tool = request["tool"]
    meta = json.loads(open(os.path.join(p["src"], "..", "meta.json")).read())
    nbytes = meta["state_bytes"]
    if tool == "disk limit":
        from .limits import read_limit, write_limit

        shutil.rmtree(p["limit"], ignore_errors=True)
        os.sync()
        write_s = write_limit(p["limit"], nbytes)
        evict_files(p["limit"])
        cold = go_cold({"directory": p["limit"]})
        read_s = read_limit(p["limit"], nbytes)
        shutil.rmtree(p["limit"], ignore_errors=True)
        return {"seconds": write_s + read_s, "write_s": write_s, "read_s": read_s, "state_bytes": nbytes, **cold}
    out = p["ckptkit-out"] if tool == "ckptkit" else p["dcp-out"]
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    if tool == "ckptkit":
        cold = go_cold({"directory": p["src"]})
        return {**_ckptkit(p["src"], out), **cold, "state_bytes": nbytes, "largest_tensor_bytes": meta["largest_tensor_bytes"]}
    import torch
    import torch.distributed.checkpoint as dcp

    cold = go_cold({"directory": p["dcp-src"]})
    shapes = json.loads(open(os.path.join(p["src"], "..", "shapes.json")).read())

    def load_and_save() -> None:
        state = {name: torch.empty(shape) for name, shape in shapes.items()}
        dcp.load(state, checkpoint_id=p["dcp-src"], no_dist=True)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out, thread_count=DCP_THREADS, sync_files=True), no_dist=True)

    _, figures = measure(load_and_save)
    return {**figures, **cold, "state_bytes": nbytes, "rss_peak_abs": figures["rss_peak"]}


def _ckptkit(src: str, out: str) -> dict[str, Any]:
    tp, pp, dp, zero = TARGET
    seconds, report, peak = timed_command(
        ["reshard", src, out, "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--zero", str(zero)], "ckptkit.ops.reshard")
    return {"seconds": seconds, "in_process_s": report["seconds"], "bytes_read": report["bytes_read"],
            "bytes_written": report["bytes_written"], "rss_peak_abs": peak}


def warm_modules(module: str) -> None:
    """Import ``ckptkit.cli`` and `module` (one or more, comma-separated) in a child process: their
    files read into the page cache and compiled (as an installed package ships them), whatever
    ``PYTHONDONTWRITEBYTECODE`` says."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-c", f"import ckptkit.cli, {module}"], check=True, env=env)


def timed_command(args: list[str], module: str, *, warm: bool = True) -> tuple[float, dict[str, Any], int]:
    """Run ``ckptkit ARGS --json`` as a child process; return its seconds (start-up included),
    its JSON report and its peak RSS.

    Cold files, warm code (as for the tools preloaded in the other workers): the command's
    modules (``ckptkit.cli`` and `module`) are read back into the page cache first, untimed
    (by `warm_modules`; ``warm=False`` when the caller has already done so).
    """
    exe = os.path.join(os.path.dirname(sys.executable), "ckptkit")
    if warm:
        warm_modules(module)
    start = time.perf_counter()
    done = subprocess.run([exe, *args, "--json"], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"ckptkit {args[0]} failed ({done.returncode}): {done.stderr.strip()}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return seconds, json.loads(done.stdout), peak


def write_meta(work: str, meta: dict[str, Any]) -> None:
    """Record the source's size and the tensors' shapes beside it, for the measuring workers."""
    import ckptkit

    p = paths(work)
    manifest = ckptkit.read_manifest(p["src"])
    with open(os.path.join(p["src"], "..", "meta.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(p["src"], "..", "shapes.json"), "w") as f:
        json.dump({k: list(e.shape) for k, e in manifest.tensors.items() if e.kind != "rng"}, f)


def plan_at_scale() -> dict[str, Any]:
    """Time planning PLAN_SOURCE -> PLAN_TARGET for a 72-layer 8B-class model (about 2,000 tensors)."""
    from ckptkit.layouts import reference_llama
    from ckptkit.plan.load import ShardLookup
    from ckptkit.plan.reshard import collector_paused, plan_reads, plan_reshard
    from ckptkit.trainer.config import ModelConfig

    from .reshard_scale import source_manifest

    cfg = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=PLAN_LAYERS,
                      num_heads=32, num_kv_heads=8)
    layout = reference_llama(cfg.to_json())
    start = time.perf_counter()
    manifest = source_manifest(layout, topology(PLAN_SOURCE))
    inputs_s = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_reshard(manifest, layout, topology(PLAN_TARGET), files_per_rank=1)
    plan_s = time.perf_counter() - start
    start = time.perf_counter()
    lookup = ShardLookup(manifest)
    with collector_paused():  # as ckptkit.ops.reshard plans the reads of its files
        reads = sum(len(t.reads) for job in plan.jobs for t in plan_reads(manifest, job, lookup))
    reads_s = time.perf_counter() - start
    return {"seconds": plan_s + reads_s, "plan_s": plan_s, "reads_s": reads_s, "inputs_s": inputs_s,
            "logical_tensors": len(manifest.tensors) // 3, "tensors": len(manifest.tensors),
            "source_ranks": PLAN_SOURCE[0] * PLAN_SOURCE[1] * PLAN_SOURCE[2],
            "target_ranks": PLAN_TARGET[0] * PLAN_TARGET[1] * PLAN_TARGET[2],
            "target_files": len(plan.jobs), "reads": reads, "state_bytes": 0}


TOOLS = ("disk limit", "ckptkit", "dcp load+save")


def reshard_tools() -> list[str]:
    return list(TOOLS)


def prepare_request(settings: Any) -> dict[str, Any]:
    return {"kind": "reshard-prepare", "work": settings.work, "size_mib": settings.size_mib}
