"""Offline reshard over random placements: the plan covers every target byte once, the copy is exact."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.ops import reshard as resharder
from ckptkit.boxes import Box, flat_range_to_boxes
from ckptkit.errors import CheckpointExistsError, LayoutError, StorageError
from ckptkit.layouts import Layout, Param, StateGroup, TensorPart, TPCut, Unit
from ckptkit.manifest import Topology
from ckptkit.io.payload import open_checkpoint
from ckptkit.plan.reshard import plan_placement, plan_reads
from ckptkit.manifest.shards import iter_shards
from ckptkit.storage import MemoryStorage

from .fakes import FaultyStorage

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64]


def _placement(ranks: tuple[dict[str, list[Box]], ...]) -> dict[str, dict[Box, list[int]]]:
    """Rank r holds ``ranks[r][fqn]``: every distinct non-empty box with its holders."""
    out: dict[str, dict[Box, list[int]]] = {}
    for rank, boxes in enumerate(ranks):
        for fqn, bs in boxes.items():
            for box in bs:
                if box.volume:
                    out.setdefault(fqn, {}).setdefault(box, []).append(rank)
    return out


def _cuts(draw: st.DrawFn, size: int) -> list[int]:
    return sorted({0, size} | set(draw(st.lists(st.integers(1, size), max_size=2))))


def _partition(draw: st.DrawFn, shape: tuple[int, ...], world: int) -> list[list[Box]]:
    """Boxes of `shape` per rank: a grid dealt round robin, flat (ZeRO) ranges, or replicas."""
    n = math.prod(shape)
    mode = draw(st.sampled_from(["grid", "flat", "replicated"]))
    out: list[list[Box]] = [[] for _ in range(world)]
    if mode == "replicated":
        return [[Box((0,) * len(shape), shape)] for _ in range(world)]
    if mode == "flat":
        cuts = sorted({0, n} | set(draw(st.lists(st.integers(0, n), max_size=world))))
        for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            out[i % world] += flat_range_to_boxes(shape, lo, hi)
        return out
    grid = [_cuts(draw, s) for s in shape]
    for i, idx in enumerate(np.ndindex(*[len(c) - 1 for c in grid])):
        out[i % world].append(Box(tuple(c[k] for c, k in zip(grid, idx)), tuple(c[k + 1] - c[k] for c, k in zip(grid, idx))))
    return out


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], list[list[tuple[str, Box]]], tuple[dict[str, list[Box]], ...], int, int]:
    tensors = {}
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        g = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 1.25 - 7
        tensors[f"model/t{i}"] = g.to(dtype)
    src_world, dst_world = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    src_parts = {fqn: _partition(draw, tuple(t.shape), src_world) for fqn, t in tensors.items()}
    dst_parts = {fqn: _partition(draw, tuple(t.shape), dst_world) for fqn, t in tensors.items()}
    source = [[(fqn, box) for fqn, part in src_parts.items() for box in part[r]] for r in range(src_world)]
    target = tuple({fqn: part[r] for fqn, part in dst_parts.items()} for r in range(dst_world))
    piece = draw(st.sampled_from([8, 24, 64, resharder.PIECE]))
    small_run = draw(st.sampled_from([1, 16, resharder.SMALL_RUN]))
    return tensors, source, target, piece, small_run


def _save_source(store: MemoryStorage, tensors: dict[str, torch.Tensor], source: list[list[tuple[str, Box]]]) -> None:
    pieces: dict[str, list[ShardedTensor]] = {}
    for boxes in source:
        for fqn, box in boxes:
            g = tensors[fqn]
            if any(p.box == box for p in pieces.get(fqn, [])):
                continue  # a replica: held once in this single-process save
            pieces.setdefault(fqn, []).append(ShardedTensor(g[box.slices()].clone(), tuple(g.shape), box.offsets))
    ckptkit.save({"model": {k.split("/", 1)[1]: v for k, v in pieces.items()}}, "src", step=3, storage=store)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


@settings(max_examples=80, deadline=None)
@given(cases())
def test_reshard_covers_every_target_byte_once_and_copies_exactly(case: tuple) -> None:
    tensors, source, ranks, piece, small_run = case
    store = MemoryStorage()
    _save_source(store, tensors, source)
    topology = Topology(world_size=len(ranks), dp=len(ranks))
    src_loc, manifest = open_checkpoint("src", store)
    plan = plan_placement(manifest, _placement(ranks), topology)
    for fqn, t in tensors.items():
        items = [(item, reads) for job in plan.jobs
                 for (item, _), reads in zip(job.plan.items, plan_reads(manifest, job)) if item.fqn == fqn]
        assert sum(item.box.volume for item, _ in items) == t.numel()  # distinct boxes tile the tensor
        for item, reads in items:
            covered = np.zeros(item.box.lengths, dtype=np.int64)
            for read in reads.reads:
                covered[read.overlap.shifted(item.box.offsets).slices()] += 1
            assert (covered == 1).all()  # every byte of the item read exactly once
    with mock.patch.object(resharder, "PIECE", piece), mock.patch.object(resharder, "SMALL_RUN", small_run):
        report = resharder.write_reshard(src_loc, manifest, plan, "dst", dst_storage=store)
    assert ckptkit.verify("dst", storage=store).ok
    out = ckptkit.load("dst", storage=store)
    for fqn, t in tensors.items():
        got = out["model"][fqn.split("/", 1)[1]]
        assert got.dtype == t.dtype and torch.equal(_bits(got), _bits(t))
    written = ckptkit.read_manifest("dst", storage=store)
    for fqn in tensors:
        want = {b for r in ranks for b in r[fqn] if b.volume}
        assert {s.box for s in iter_shards(written.tensors[fqn])} == want
    assert written.topology == topology and report.bytes_written == sum(t.numel() * t.element_size() for t in tensors.values())


def _layout_one_rank(store: MemoryStorage) -> Layout:
    """The layout of the small source's model: one [6, 4] weight, TP-cut on dim 0."""
    param = Param(name="w", parts=(TensorPart(tensor="w", shape=(6, 4)),), tp=TPCut(dim=0))
    return Layout(name="toy", units=(Unit(name="w", place="first", params=(param,)),),
                  states=(StateGroup(prefix="model", role="param"),))


def _small_source() -> MemoryStorage:
    store = MemoryStorage()
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    halves = [ShardedTensor(w[:3].clone(), (6, 4), (0, 0)), ShardedTensor(w[3:].clone(), (6, 4), (3, 0))]
    ckptkit.save({"model": {"w": halves}, "step_info": {"lr": 0.1}}, "src", step=7, storage=store)
    return store


def test_reshard_copies_values_and_keeps_the_step() -> None:
    store = _small_source()
    resharder.reshard("src", "dst", Topology(world_size=1), layout=_layout_one_rank(store), storage=store, dst_storage=store)
    out = ckptkit.load("dst", storage=store)
    assert out["step_info"] == {"lr": 0.1}
    assert torch.equal(out["model"]["w"], torch.arange(24, dtype=torch.float32).reshape(6, 4))
    assert ckptkit.read_manifest("dst", storage=store).step == 7


def test_a_failed_write_commits_nothing_and_leaves_no_temporary() -> None:
    src = _small_source()
    dst = FaultyStorage(fail_write=1)
    with pytest.raises(StorageError, match="No space left"):
        resharder.reshard("src", "dst", Topology(world_size=1), layout=_layout_one_rank(src), storage=src, dst_storage=dst)
    assert dst.list("") == []


def test_an_interrupt_leaves_no_temporary() -> None:
    src = _small_source()

    class Interrupted(MemoryStorage):
        def write(self, key: str, chunks):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

    dst = Interrupted()
    dst._data["keep/manifest.json"] = b"{}"  # something else under the root stays
    with pytest.raises(KeyboardInterrupt):
        resharder.reshard("src", "dst", Topology(world_size=1), layout=_layout_one_rank(src), storage=src, dst_storage=dst)
    assert dst.list("") == ["keep/manifest.json"]


def test_an_existing_destination_is_refused_before_writing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    src = _small_source()
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "note").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="uncommitted directory already exists"):
        resharder.reshard("src", tmp_path / "dst", Topology(world_size=1), layout=_layout_one_rank(src), storage=src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"] and (tmp_path / "dst" / "note").read_text() == "mine"
    assert ckptkit.list_checkpoints(tmp_path).latest is None


def test_a_layout_that_cannot_hold_the_topology_fails_before_writing() -> None:
    src = _small_source()
    dst = MemoryStorage()
    with pytest.raises(LayoutError, match=r"cannot reshard to tp=4 pp=1 dp=1 zero=0: tp 4 does not cut 1 tensor\(s\) evenly: w \(6 along dim 0\)"):
        resharder.reshard("src", "dst", Topology(world_size=4, tp=4), layout=_layout_one_rank(src), storage=src, dst_storage=dst)
    assert dst.list("") == []


def _other_model(*names: str) -> Layout:
    params = tuple(Param(name=n, parts=(TensorPart(tensor=n, shape=(6, 4)),), tp=TPCut(dim=0)) for n in names)
    return Layout(name="other", units=(Unit(name="m", place="first", params=params),), states=(StateGroup(prefix="model", role="param"),))


def test_a_layout_that_places_none_of_the_tensors_is_refused_before_writing() -> None:
    src = _small_source()
    dst = MemoryStorage()
    with pytest.raises(LayoutError, match=r"the layout 'other' places none of the checkpoint's tensors \(it names model/\.\.\."):
        resharder.reshard("src", "dst", Topology(world_size=4, tp=2, pp=2), layout=_other_model("v"), storage=src, dst_storage=dst)
    assert dst.list("") == []


def test_a_layout_that_leaves_model_tensors_unplaced_is_refused_before_writing() -> None:
    store = MemoryStorage()
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    ckptkit.save({"model": {"w": w, "u": w + 1}}, "src", step=1, storage=store)
    dst = MemoryStorage()
    with pytest.raises(LayoutError, match=r"the layout 'other' has no place for 1 of the checkpoint's tensors: model/u"):
        resharder.reshard("src", "dst", Topology(world_size=2, tp=2), layout=_other_model("w"), storage=store, dst_storage=dst)
    assert dst.list("") == []


def test_a_checkpoint_without_model_info_names_what_is_missing() -> None:
    src = _small_source()
    with pytest.raises(LayoutError, match=r"records no layout and names no model \(info.model\).*--layout FILE"):
        resharder.reshard("src", "dst", Topology(world_size=1), storage=src, dst_storage=MemoryStorage())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=3), st.integers(1, 80), st.data())
def test_shard_lookup_finds_exactly_the_shards_a_scan_finds(shape: list[int], ranks: int, data: st.DataObject) -> None:
    from ckptkit.manifest import BoxShard, BoxShards, TensorEntry
    from ckptkit.plan.load import ShardLookup
    from ckptkit.manifest.shards import shards_overlapping

    # Column blocks side by side (as TP splits make them), each cut into flat (ZeRO) ranges.
    columns = sorted({0, shape[-1]} | set(data.draw(st.lists(st.integers(1, shape[-1]), max_size=3))))
    boxes = []
    for c0, c1 in zip(columns, columns[1:]):
        block = (*shape[:-1], c1 - c0)
        n = math.prod(block)
        cuts = sorted({0, n} | set(data.draw(st.lists(st.integers(0, n), max_size=ranks))))
        for lo, hi in zip(cuts, cuts[1:]):
            boxes += [Box(b.offsets[:-1] + (b.offsets[-1] + c0,), b.lengths) for b in flat_range_to_boxes(block, lo, hi)]
    entry = TensorEntry(shape=tuple(shape), dtype="float32", kind="optimizer", shards=BoxShards(boxes=tuple(
        BoxShard(offsets=b.offsets, lengths=b.lengths, file=i, key="k") for i, b in enumerate(boxes))))
    manifest = ckptkit.manifest.Manifest(checkpoint_id="x", step=0, created_at="t", producer={"ckptkit": "t"},
                                         topology=Topology(world_size=1), files=(), tensors={"t": entry})
    lookup = ShardLookup(manifest)
    for _ in range(5):
        lo = [data.draw(st.integers(0, s - 1)) for s in shape]
        query = Box(tuple(lo), tuple(data.draw(st.integers(1, s - o)) for s, o in zip(shape, lo)))
        found = lookup.overlaps("t", query)
        assert sorted(s.file for s, _ in found) == sorted(s.file for s in shards_overlapping(entry, query))
        assert all(common == s.box.intersect(query) for s, common in found)


def test_a_destination_inside_the_source_is_refused_and_the_source_stays_sound(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = torch.arange(6, dtype=torch.float32)
    ckptkit.save({"model": {"w": w}}, str(tmp_path / "src"), step=1)
    layout = Layout(name="toy", units=(Unit(name="w", place="first", params=(Param(name="w", parts=(TensorPart(tensor="w", shape=(6,)),)),)),),
                    states=(StateGroup(prefix="model", role="param"),))
    with pytest.raises(CheckpointExistsError, match="may not be, contain or lie inside the source"):
        ckptkit.reshard(str(tmp_path / "src"), str(tmp_path / "src" / "inner"), Topology(world_size=1), layout=layout)
    assert ckptkit.verify(str(tmp_path / "src")).ok and not (tmp_path / "src" / "inner").exists()
