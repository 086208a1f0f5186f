"""Planning per rank as the ranks grow: real saves and loads of a small Llama's state by 8 to 64
gloo ranks (tp 2 x pp 2 x dp 2..16, ZeRO-1), each rank timing and tracing the memory of its own
planning, beside what a save that lists every box plans on rank 0.

Each rank, in the job: builds its boxes of the layout (bf16 parameters, fp32 moments: tiny),
plans its part of a derived save (`layout_share` and its one file, `derived_file`), saves for
real with ``ckptkit.save``, opens the checkpoint and plans its load (``plan_load`` of its boxes),
loads for real and checks the values, and counts the bytes it read from payload files against
the bytes of the blocks its boxes touch (the least a reader checking whole blocks reads; the
files are smaller than a block here, so that is whole files) and of its boxes. Planning is timed
in the CPU time of the rank's thread (``time.thread_time``: 64 ranks share 2 cores, so wall
time would grow with the sharing) and its Python allocations traced (``tracemalloc`` peak). Beside it, in the launcher: ``plan_save`` over every rank's boxes,
what rank 0 plans when a save lists them (as before manifest 1.6).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

RANKS = (8, 16, 32, 64)
CONFIG = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


def _layout() -> Any:
    from ckptkit.layouts import reference_llama

    return reference_llama(CONFIG)


def _topology(world: int) -> Any:
    from ckptkit.manifest import Topology

    return Topology(world_size=world, tp=2, pp=2, dp=world // 4, zero_stage=1)


def _state(layout: Any, topology: Any, rank: int, blank: bool) -> tuple[dict[str, Any], int]:
    """The rank's boxes of every state group as ShardedTensors (zeros when `blank`), and their bytes."""
    import torch

    from ckptkit import ShardedTensor
    from ckptkit.layouts import rank_boxes

    shapes = layout.tensors()
    state: dict[str, Any] = {}
    nbytes = 0
    for group in layout.states:
        dtype = torch.bfloat16 if group.role == "param" else torch.float32
        for name, boxes in rank_boxes(layout, topology, rank)[group.label].items():
            seed = zlib.crc32(group.fqn(name).encode()) % 97
            pieces = []
            for box in boxes:
                if not box.volume:
                    continue
                local = torch.zeros(box.lengths, dtype=dtype) if blank else (torch.arange(box.volume, dtype=torch.float32) + seed).reshape(
                    box.lengths).to(dtype)
                pieces.append(ShardedTensor(local, shapes[name], box.offsets))
                nbytes += local.numel() * local.element_size()
            node = state
            for part in group.prefix.split("/"):
                node = node.setdefault(part, {})
            node[name] = pieces if len(pieces) > 1 else pieces[0]
    return state, nbytes


def _items(state: dict[str, Any]) -> list[Any]:
    from ckptkit.plan.save import ItemDesc
    from ckptkit.state.torch_io import dtype_name, is_leaf, leaf_shards
    from ckptkit.state.tree import flatten

    tensors, _ = flatten(state, is_leaf)
    return [ItemDesc(fqn, dtype_name(p.local.dtype, fqn=fqn), p.global_shape, p.box) for fqn, leaf in tensors.items() for p in leaf_shards(leaf)]


def _traced(fn: Any) -> tuple[Any, float, int]:
    """`fn()`, the CPU seconds of this thread it took (64 ranks share 2 cores here: wall time
    would measure the sharing) and its Python allocations' peak."""
    tracemalloc.start()
    start = time.thread_time()
    out = fn()
    seconds = time.thread_time() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return out, seconds, peak


def _job(rank: int, world: int, root: str, out: str) -> None:
    import torch

    import ckptkit
    from ckptkit.layouts.saved import Saved
    from ckptkit.plan.load import plan_load
    from ckptkit.plan.save import derived_file, layout_share
    from ckptkit.storage import LocalStorage

    from .checksums import touched_block_bytes

    layout, topology = _layout(), _topology(world)
    state, nbytes = _state(layout, topology, rank, blank=False)
    items = _items(state)

    def save_plan() -> Any:
        saved = Saved(layout, topology)
        share, others = layout_share(saved, rank, items)
        return derived_file(saved, rank, {i.fqn: i for i in items}, [])

    _, save_s, save_peak = _traced(save_plan)
    start = time.perf_counter()
    ckptkit.save(state, f"{root}/step_1", step=1, topology=topology, layout=layout)
    save_wall = time.perf_counter() - start

    class Counting(LocalStorage):
        payload = 0

        def readv(self, key: str, offset: int, buffers: Any) -> None:
            super().readv(key, offset, buffers)
            if key.endswith(".safetensors"):
                Counting.payload += sum(b.nbytes for b in buffers)

    checkpoint = ckptkit.open("step_1", storage=Counting(root))
    requests = [(i.fqn, i.box) for i in items]
    _, load_s, load_peak = _traced(lambda: plan_load(checkpoint.manifest, requests))
    target, _ = _state(layout, topology, rank, blank=True)
    Counting.payload = 0
    start = time.perf_counter()
    checkpoint.load(target)
    load_wall = time.perf_counter() - start
    got, want = _items_values(target), _items_values(state)
    exact = all(torch.equal(got[k], want[k]) for k in want)
    Path(out, f"{rank}.json").write_text(json.dumps({
        "save_plan_s": save_s, "save_plan_peak": save_peak, "load_plan_s": load_s, "load_plan_peak": load_peak,
        "save_s": save_wall, "load_s": load_wall, "payload_read": Counting.payload, "box_bytes": nbytes,
        "block_bytes": touched_block_bytes(checkpoint._reader, requests), "exact": exact}))


def _items_values(state: dict[str, Any]) -> dict[str, Any]:
    from ckptkit.state.torch_io import is_leaf, leaf_shards
    from ckptkit.state.tree import flatten

    tensors, _ = flatten(state, is_leaf)
    return {f"{fqn}@{p.box.offsets}": p.local for fqn, leaf in tensors.items() for p in leaf_shards(leaf)}


def _listed_rank0(world: int) -> tuple[float, int]:
    """What rank 0 plans when a save lists every box: ``plan_save`` over every rank's items."""
    from ckptkit.plan.save import plan_save

    layout, topology = _layout(), _topology(world)
    ranks = [_items(_state(layout, topology, r, blank=True)[0]) for r in range(world)]
    _, seconds, peak = _traced(lambda: plan_save(ranks))
    return seconds, peak


def run() -> dict[str, Any]:
    """Run the job at each size of RANKS; per size, medians and maxima over the ranks."""
    from ckptkit.trainer.launch import run_ranks

    sizes: dict[str, Any] = {}
    for world in RANKS:
        with tempfile.TemporaryDirectory(prefix="ckptkit-rank-plans-") as tmp:
            out = Path(tmp, "out")
            out.mkdir()
            run_ranks(_job, world, str(Path(tmp, "ckpt")), str(out))
            results = [json.loads((out / f"{r}.json").read_text()) for r in range(world)]
        listed_s, listed_peak = _listed_rank0(world)
        sizes[str(world)] = {
            **{f"{k}_median": statistics.median(r[k] for r in results) for k in ("save_plan_s", "save_plan_peak", "load_plan_s",
                                                                                 "load_plan_peak", "save_s", "load_s")},
            **{f"{k}_max": max(r[k] for r in results) for k in ("save_plan_s", "save_plan_peak", "load_plan_s", "load_plan_peak")},
            "read_vs_blocks_max": max(r["payload_read"] / r["block_bytes"] for r in results),
            "read_vs_blocks_min": min(r["payload_read"] / r["block_bytes"] for r in results),
            "read_vs_boxes_median": statistics.median(r["payload_read"] / r["box_bytes"] for r in results),
            "exact": all(r["exact"] for r in results),
            "listed_rank0_plan_s": listed_s, "listed_rank0_plan_peak": listed_peak,
        }
    first, last = sizes[str(RANKS[0])], sizes[str(RANKS[-1])]
    return {"sizes": sizes, "seconds": 0.0,
            "load_plan_growth": last["load_plan_s_max"] / first["load_plan_s_max"],
            "save_plan_growth": last["save_plan_s_max"] / first["save_plan_s_max"],
            "plan_memory_growth": max(last["load_plan_peak_max"], last["save_plan_peak_max"])
            / max(first["load_plan_peak_max"], first["save_plan_peak_max"])}


def render(block: dict[str, Any]) -> list[str]:
    if "error" in block:
        return [f"SCALE RANKS: FAILED: {block['error']}"]
    lines = [f"SCALE RANKS: real saves and loads, tp 2 x pp 2 x dp (ranks / 4), ZeRO-1, each rank's own planning "
             f"(median / max over the ranks)",
             f"  {'ranks':>5} {'save plan ms':>15} {'load plan ms':>15} {'plan peak KiB':>15} {'read/blocks':>12} "
             f"{'read/boxes':>11} {'save s':>7} {'load s':>7} {'listed: rank 0 plan ms, KiB':>29}"]
    for world, s in block["sizes"].items():
        lines.append(
            f"  {world:>5} {s['save_plan_s_median'] * 1e3:>7.1f} / {s['save_plan_s_max'] * 1e3:<5.1f} "
            f"{s['load_plan_s_median'] * 1e3:>7.1f} / {s['load_plan_s_max'] * 1e3:<5.1f} "
            f"{max(s['save_plan_peak_max'], s['load_plan_peak_max']) / 1024:>15.0f} "
            f"{s['read_vs_blocks_min']:>5.2f}-{s['read_vs_blocks_max']:<5.2f} {s['read_vs_boxes_median']:>11.2f} "
            f"{s['save_s_median']:>7.2f} {s['load_s_median']:>7.2f} "
            f"{s['listed_rank0_plan_s'] * 1e3:>18.1f}, {s['listed_rank0_plan_peak'] / 1024:.0f}"
            + ("" if s["exact"] else "  VALUES DIFFER"))
    return lines
