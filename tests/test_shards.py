from __future__ import annotations

from ckptkit.boxes import Box, chunk_cuts, tiling_problems
from ckptkit.manifest import BoxShards, FileRange, GridShards, TensorEntry
from ckptkit.manifest.shards import Shard, compact_shards, iter_shards, shards_overlapping


def _grid(shape: tuple[int, ...], count: int, dim: int = 0) -> list[Shard]:
    cuts = chunk_cuts(shape[dim], count)
    shards = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        if b > a:
            off = [0] * len(shape)
            ln = list(shape)
            off[dim], ln[dim] = a, b - a
            shards.append(Shard(Box(tuple(off), tuple(ln)), file=i, key="w"))
    return shards


def test_fsdp_style_split_compacts_to_a_chunk_count_and_file_range() -> None:
    shards = _grid((4096 * 3, 8), 4096)
    spec = compact_shards((4096 * 3, 8), shards)
    assert isinstance(spec, GridShards)
    assert spec.cuts == (4096, 1)
    assert spec.files == FileRange(start=0, step=1)
    entry = TensorEntry(shape=(4096 * 3, 8), dtype="float32", kind="param", shards=spec)
    assert list(iter_shards(entry)) == shards


def test_uneven_split_keeps_explicit_cuts() -> None:
    shards = [Shard(Box((0, 0), (5, 4)), 0, "w"), Shard(Box((5, 0), (2, 4)), 1, "w")]
    spec = compact_shards((7, 4), shards)
    assert isinstance(spec, GridShards)
    assert spec.cuts == ((0, 5, 7), 1)


def test_boxes_sharing_a_file_stay_explicit() -> None:
    shards = [Shard(Box((0,), (3,)), 0, "w"), Shard(Box((3,), (3,)), 0, "w#1")]
    spec = compact_shards((6,), shards)
    assert isinstance(spec, BoxShards)
    entry = TensorEntry(shape=(6,), dtype="float32", kind="param", shards=spec)
    assert sorted(s.box.offsets for s in iter_shards(entry)) == [(0,), (3,)]


def test_overlap_lookup_in_a_grid_finds_only_touching_cells() -> None:
    shards = _grid((100, 10), 10)
    entry = TensorEntry(shape=(100, 10), dtype="float32", kind="param", shards=compact_shards((100, 10), shards))
    found = shards_overlapping(entry, Box((15, 2), (20, 3)))
    assert [s.box.offsets for s in found] == [(10, 0), (20, 0), (30, 0)]
    assert [s.file for s in found] == [1, 2, 3]


def test_grid_with_empty_trailing_chunks_tiles() -> None:
    shards = _grid((5, 2), 4)  # torch.chunk: 2, 2, 1, 0
    spec = compact_shards((5, 2), shards)
    entry = TensorEntry(shape=(5, 2), dtype="float32", kind="param", shards=spec)
    assert tiling_problems((5, 2), [s.box for s in iter_shards(entry)]) == []


def test_grid_with_scattered_files_keeps_the_file_list_in_cell_order() -> None:
    shards = [Shard(Box((0, 2), (2, 2)), 7, "w"), Shard(Box((0, 0), (2, 2)), 3, "w"), Shard(Box((2, 0), (1, 4)), 5, "w")]
    assert isinstance(compact_shards((3, 4), shards), BoxShards)  # not a grid: the last row is not cut
    shards[2:] = [Shard(Box((2, 0), (1, 2)), 5, "w"), Shard(Box((2, 2), (1, 2)), 4, "w")]
    spec = compact_shards((3, 4), shards)
    assert isinstance(spec, GridShards) and spec.files == (3, 7, 5, 4)
    entry = TensorEntry(shape=(3, 4), dtype="float32", kind="param", shards=spec)
    assert sorted((s.box.offsets, s.file) for s in iter_shards(entry)) == sorted((s.box.offsets, s.file) for s in shards)
