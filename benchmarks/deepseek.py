"""A DeepSeek-V3-like layout for the planning benchmarks: its shapes and names, no bytes.

DeepSeek-V3's sizes (hidden 7,168, 128 heads with multi-head latent attention: q rank 1,536,
kv rank 512, head dims 128 + 64 rope, value 128; 256 routed experts of 2,048 and a shared
one; vocabulary 129,280; the first 3 layers dense, of 18,432) with 64 layers rather than 61,
so that 16 pipeline stages hold 4 each (ckptkit's stages hold equal runs of layers). Four
state groups: bf16 parameters, their fp32 masters and both Adam moments; 47,741 logical
tensors, 190,964 in all. Megatron's cut: q and kv down-projections, norms and the router
replicated over TP; up-projections and the MLPs column-parallel, the output projections
row-parallel; the vocabulary padded.
"""

from __future__ import annotations

import gc
from typing import Any

from ckptkit.layouts import Layout, StateGroup, Unit
from ckptkit.layouts.builtin import param
from ckptkit.manifest import Topology

HIDDEN, HEADS, Q_RANK, KV_RANK, NOPE, ROPE, VALUE = 7168, 128, 1536, 512, 128, 64, 128
EXPERTS, EXPERT_FFN, DENSE_FFN, VOCAB, LAYERS, DENSE_LAYERS = 256, 2048, 18432, 129280, 64, 3
STATES = (
    StateGroup(prefix="model", role="param"),
    StateGroup(prefix="optimizer/master", role="optimizer"),
    StateGroup(prefix="optimizer/exp_avg", role="optimizer"),
    StateGroup(prefix="optimizer/exp_avg_sq", role="optimizer"),
)
DTYPES = {"model": "bfloat16", "optimizer/master": "float32", "optimizer/exp_avg": "float32", "optimizer/exp_avg_sq": "float32"}
# The example: tp 8 x ep 64 x pp 16 x expert-dp 16 (dp 1,024 = ep 64 x 16), ZeRO 1.
TOPOLOGY = Topology(world_size=131072, tp=8, pp=16, dp=1024, ep=64, zero_stage=1)
# Half as many data-parallel ranks: the reshard target.
HALF = Topology(world_size=65536, tp=8, pp=16, dp=512, ep=64, zero_stage=1)


def _mlp(prefix: str, ffn: int) -> tuple[Any, ...]:
    return (
        param(f"{prefix}gate_up.weight", [(prefix + "gate_proj.weight", (ffn, HIDDEN)), (prefix + "up_proj.weight", (ffn, HIDDEN))], 0),
        param(f"{prefix}down.weight", [(prefix + "down_proj.weight", (HIDDEN, ffn))], 1),
    )


def layout() -> Layout:
    """The DeepSeek-V3-like layout (see the module's docstring)."""
    p = "layers.{layer}."
    attention = (
        param("input_layernorm.weight", [(p + "input_layernorm.weight", (HIDDEN,))]),
        param("q_a_proj.weight", [(p + "self_attn.q_a_proj.weight", (Q_RANK, HIDDEN))]),
        param("q_a_layernorm.weight", [(p + "self_attn.q_a_layernorm.weight", (Q_RANK,))]),
        param("q_b_proj.weight", [(p + "self_attn.q_b_proj.weight", (HEADS * (NOPE + ROPE), Q_RANK))], 0),
        param("kv_a_proj.weight", [(p + "self_attn.kv_a_proj_with_mqa.weight", (KV_RANK + ROPE, HIDDEN))]),
        param("kv_a_layernorm.weight", [(p + "self_attn.kv_a_layernorm.weight", (KV_RANK,))]),
        param("kv_b_proj.weight", [(p + "self_attn.kv_b_proj.weight", (HEADS * (NOPE + VALUE), KV_RANK))], 0),
        param("o_proj.weight", [(p + "self_attn.o_proj.weight", (HIDDEN, HEADS * VALUE))], 1),
        param("post_attention_layernorm.weight", [(p + "post_attention_layernorm.weight", (HIDDEN,))]),
    )
    dense = tuple(range(DENSE_LAYERS))
    moe = tuple(range(DENSE_LAYERS, LAYERS))
    e = p + "mlp.experts.{expert}."
    units = (
        Unit(name="embed", place="first", params=(param("weight", [("embed_tokens.weight", (VOCAB, HIDDEN))], 0, pad_multiple=1),)),
        Unit(name="layers.{layer}", place="layers", layers=dense, params=(*attention, *_mlp(p + "mlp.", DENSE_FFN))),
        Unit(name="layers.{layer}", place="layers", layers=moe, params=(
            *attention,
            param("mlp.gate.weight", [(p + "mlp.gate.weight", (EXPERTS, HIDDEN))]),
            param("mlp.gate.e_score_correction_bias", [(p + "mlp.gate.e_score_correction_bias", (EXPERTS,))]),
            *_mlp(p + "mlp.shared_experts.", EXPERT_FFN),
        )),
        Unit(name="layers.{layer}.experts", place="layers", layers=moe, experts=EXPERTS, params=(
            param("{expert}.gate_up.weight", [(e + "gate_proj.weight", (EXPERT_FFN, HIDDEN)), (e + "up_proj.weight", (EXPERT_FFN, HIDDEN))], 0),
            param("{expert}.down.weight", [(e + "down_proj.weight", (HIDDEN, EXPERT_FFN))], 1),
        )),
        Unit(name="norm", place="last", params=(param("weight", [("norm.weight", (HIDDEN,))]),)),
        Unit(name="lm_head", place="last", params=(param("weight", [("lm_head.weight", (VOCAB, HIDDEN))], 0, pad_multiple=1),)),
    )
    return Layout(name="deepseek-v3-like", num_layers=LAYERS, states=STATES, units=units)


def _groups() -> dict[str, Any]:
    from ckptkit.manifest.model import DerivedGroup

    return {label: DerivedGroup(dtype=dtype, kind="param" if label == "model" else "optimizer") for label, dtype in DTYPES.items()}


def _files(ranks: int) -> tuple[Any, ...]:
    """One payload file per rank as a save's ranks report them (80 MiB each, 1 MiB blocks, digests in sidecars)."""
    from ckptkit.manifest import BlockChecksums, FileEntry
    from ckptkit.manifest.derived import table_path

    blocks = BlockChecksums(size=1 << 20)
    return tuple(FileEntry(path=table_path(r), size=80 << 20, checksum=f"xxh3-128-blocks:{r * 2654435761 % (1 << 128):032x}",
                           blocks=blocks) for r in range(ranks))


def _sample(world: int, count: int) -> list[int]:
    """`count` ranks spread over the world, the first and the last included."""
    return sorted({round(i * (world - 1) / (count - 1)) for i in range(count)})


def _requests(saved_layout: Layout, topology: Topology, rank: int) -> list[tuple[str, Any]]:
    """What `rank` of `topology` loads: every box it holds, group by group."""
    from ckptkit.layouts import rank_boxes

    held = rank_boxes(saved_layout, topology, rank)
    return [(g.fqn(name), box) for g in saved_layout.states for name, boxes in held[g.label].items() for box in boxes]


def run(samples: int = 9) -> dict[str, Any]:
    """Build, check, write and read the manifest of a 131,072-rank save of the layout, then plan
    sampled ranks' loads and their part of a reshard to 65,536 ranks, with DCP's read planner on
    the same chunks beside them. On one core."""
    import os
    import statistics
    import time

    from ckptkit.layouts.saved import Saved
    from ckptkit.manifest import Manifest, Producer, parse_manifest
    from ckptkit.manifest.model import Derived
    from ckptkit.ops.inspect import summarize
    from ckptkit.plan.load import plan_load

    from .scale import validate_and_serialize

    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    model = layout()
    start = time.perf_counter()
    files = _files(TOPOLOGY.world_size)
    inputs_s = time.perf_counter() - start

    start = time.perf_counter()
    manifest = Manifest(checkpoint_id="0" * 32, step=1000, created_at="2026-12-05T00:00:00+00:00", producer=Producer(ckptkit="bench"),
                        topology=TOPOLOGY, files=files, tensors={}, layout=model.to_json(),
                        derived=Derived(rule="ranges", groups=_groups()))
    build_s = time.perf_counter() - start
    validate_s, serialize_s, data = validate_and_serialize(manifest)
    parse_times = []
    for _ in range(3):
        start = time.perf_counter()
        parsed = parse_manifest(data)
        parse_times.append(time.perf_counter() - start)
    if parsed != manifest:
        raise RuntimeError("the parsed manifest differs from the one written")

    load_ms, reshard_ms, dcp_ms, reads, dcp_reads, chunks_per_rank = [], [], [], [], [], []
    dcp_bytes = dcp_chunks = dcp_unpickle_s = 0.0
    for rank in _sample(TOPOLOGY.world_size, samples):
        fresh = parse_manifest(data)  # every rank starts from the manifest, nothing cached
        gc.collect()  # each plan is timed alone: not a collection of the garbage of the steps before it
        start = time.perf_counter()
        plan = plan_load(fresh, _requests(model, TOPOLOGY, rank))
        load_ms.append((time.perf_counter() - start) * 1e3)
        reads.append(sum(len(t.reads) for t in plan.targets))
        target = rank * HALF.world_size // TOPOLOGY.world_size
        fresh = parse_manifest(data)
        gc.collect()
        start = time.perf_counter()
        writes = Saved(model, HALF).writes(target)
        plan_load(fresh, [(w.fqn, w.box) for w in writes])
        reshard_ms.append((time.perf_counter() - start) * 1e3)
        chunks_per_rank.append(len(Saved(model, TOPOLOGY).writes(rank)))
        elapsed, n, size, unpickle_s, chunks = _dcp_plan(model, rank)
        dcp_ms.append(elapsed * 1e3)
        dcp_reads.append(n)
        dcp_bytes += size
        dcp_chunks += chunks
        dcp_unpickle_s += unpickle_s
    total_chunks = statistics.mean(chunks_per_rank) * TOPOLOGY.world_size
    fresh = parse_manifest(data)
    gc.collect()
    start = time.perf_counter()
    summary = summarize("bench", fresh)  # what `ckptkit inspect` shows: every tensor and its cut
    inspect_s = time.perf_counter() - start
    return {
        "tensors": len(parsed.tensors), "logical": len(model.tensors()), "ranks": TOPOLOGY.world_size, "target_ranks": HALF.world_size,
        "layers": model.num_layers, "topology": TOPOLOGY.describe(),
        "inputs_s": inputs_s, "build_s": build_s, "validate_s": validate_s, "serialize_s": serialize_s,
        "parse_s": statistics.median(parse_times), "json_bytes": len(data), "sampled_ranks": samples,
        "load_plan_ms": statistics.median(load_ms), "load_plan_max_ms": max(load_ms), "load_reads": statistics.median(reads),
        "reshard_plan_ms": statistics.median(reshard_ms), "reshard_plan_max_ms": max(reshard_ms),
        "dcp_plan_ms": statistics.median(dcp_ms), "dcp_plan_max_ms": max(dcp_ms), "dcp_reads": statistics.median(dcp_reads),
        "chunks": total_chunks, "dcp_metadata_bytes": dcp_bytes / dcp_chunks * total_chunks,
        "dcp_unpickle_s": dcp_unpickle_s / dcp_chunks * total_chunks, "inspect_s": inspect_s, "inspect_boxes": summary.shards,
        "seconds": 0.0,
    }


def _dcp_plan(model: Layout, rank: int) -> tuple[float, int, int, float, int]:
    """DCP's read planning of the same rank's load, given a checkpoint metadata listing every
    chunk of the tensors it loads (the chunks ckptkit's rule derives): (seconds, read items,
    pickled metadata bytes, seconds to unpickle it, chunks in it)."""
    import pickle
    import time

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from ckptkit.boxes import full_box
    from ckptkit.layouts.saved import Saved

    saved = Saved(model, TOPOLOGY)
    wanted: dict[str, list[Any]] = {}
    for fqn, box in _requests(model, TOPOLOGY, rank):
        wanted.setdefault(fqn, []).append(ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.lengths)))
    entries: dict[str, Any] = {}
    chunks = 0
    for fqn in wanted:
        found = saved.find(fqn)
        assert found is not None
        shape = found[2]
        stored = saved.overlapping(fqn, full_box(shape))
        chunks += len(stored)
        dtype = torch.bfloat16 if fqn.startswith("model/") else torch.float32
        entries[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(s.box.offsets), sizes=torch.Size(s.box.lengths)) for s in stored])
    metadata = Metadata(state_dict_metadata=entries)
    blob = pickle.dumps(metadata)
    start = time.perf_counter()
    pickle.loads(blob)
    unpickle_s = time.perf_counter() - start
    gc.collect()
    start = time.perf_counter()
    items = [item for fqn, local in wanted.items() for item in create_read_items_for_chunk_list(fqn, entries[fqn], local)]
    return time.perf_counter() - start, len(items), len(blob), unpickle_s, chunks
