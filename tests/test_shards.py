from __future__ import annotations

from ckptkit.boxes import Box, chunk_cuts, tiling_problems
from ckptkit.manifest import BoxShard, BoxShards, FileEntry, FileRange, GridShards, Manifest, Producer, TensorEntry, Topology
from ckptkit.manifest.consistency import manifest_findings
from ckptkit.manifest.shards import (
    KeyIndex, Shard, compact_shards, grid_cell_count, grid_cells, grid_file, iter_shards, shard_count, shards_overlapping,
)


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


def _specs() -> dict[str, TensorEntry]:
    """Tensors of every spec form: chunk counts with empty trailing cells, explicit cuts, a file
    range and a file list, a 0-d grid, boxes (one key in several files), and a key two tensors share."""
    return {
        "a": TensorEntry(shape=(10, 6), dtype="float32", kind="param",
                         shards=GridShards(cuts=(4, 2), files=FileRange(start=1, step=2), key="a")),  # rows 3,3,3,1
        "b": TensorEntry(shape=(5, 3), dtype="bfloat16", kind="param",
                         shards=GridShards(cuts=((0, 1, 5), 1), files=(7, 3), key="b")),
        "c": TensorEntry(shape=(), dtype="int64", kind="other", shards=GridShards(cuts=(), files=FileRange(start=4, step=0), key="c")),
        "d": TensorEntry(shape=(4, 4), dtype="float32", kind="param", shards=BoxShards(boxes=(
            BoxShard(offsets=(0, 0), lengths=(4, 1), file=0, key="d"),
            BoxShard(offsets=(0, 1), lengths=(4, 3), file=2, key="d"),
            BoxShard(offsets=(4, 0), lengths=(0, 4), file=5, key="d-empty"),
        ))),
        "e": TensorEntry(shape=(5, 1), dtype="float32", kind="param",
                         shards=GridShards(cuts=(4, 1), files=FileRange(start=16, step=1), key="a")),  # rows 2,2,1,0
    }


def test_key_index_finds_exactly_the_shards_iter_shards_yields() -> None:
    tensors = _specs()
    expected = {(s.file, s.key): (fqn, s.box) for fqn, t in tensors.items() for s in iter_shards(t)}
    index = KeyIndex(tensors)
    keys = {k for _, k in expected} | {"d-empty", "nope"}
    found = {(f, k): index.shard(f, k) for f in range(24) for k in keys}
    assert {fk: v for fk, v in found.items() if v is not None} == expected
    assert expected[(1, "a")] == ("a", Box((0, 0), (3, 3))) and expected[(15, "a")] == ("a", Box((9, 3), (1, 3)))
    assert expected[(18, "a")] == ("e", Box((4, 0), (1, 1)))  # the key "a" of file 18 is e's third row
    assert (19, "a") not in expected  # e's empty last cell holds no key
    assert expected[(4, "c")] == ("c", Box((), ()))


def test_grid_cells_are_the_files_and_sizes_of_every_cell_in_order() -> None:
    tensors = _specs()
    for fqn in ("a", "b", "c", "e"):
        entry = tensors[fqn]
        assert isinstance(entry.shards, GridShards)
        files, volumes = grid_cells(entry.shape, entry.shards)
        cells = grid_cell_count(entry.shape, entry.shards)
        assert files.tolist() == [grid_file(entry.shards, i) for i in range(cells)], fqn
        held = [(s.file, s.box.volume) for s in iter_shards(entry)]
        assert [(f, v) for f, v in zip(files.tolist(), volumes.tolist()) if v or not entry.shape] == held, fqn
    assert {fqn: shard_count(t) for fqn, t in tensors.items()} == {fqn: len(list(iter_shards(t))) for fqn, t in tensors.items()}


def _manifest_of(tensors: dict[str, TensorEntry], sizes: list[int]) -> Manifest:
    return Manifest(checkpoint_id="0" * 32, step=1, created_at="2026-01-01T00:00:00+00:00", producer=Producer(ckptkit="test"),
                    topology=Topology(world_size=1, dp=1),
                    files=tuple(FileEntry(path=f"f{i}.safetensors", size=n, checksum="xxh3-128:0") for i, n in enumerate(sizes)),
                    tensors=tensors)


def test_grids_are_checked_cell_by_cell_without_expanding_them() -> None:
    tensors = {k: v for k, v in _specs().items() if k != "d"}
    sizes = [1000] * 24
    assert manifest_findings(_manifest_of(tensors, sizes)) == []
    small = list(sizes)
    small[15] = 11  # the last cell of "a" (1 x 3 float32, 12 bytes) cannot be in it
    assert [(f.code, f.where, f.message) for f in manifest_findings(_manifest_of(tensors, small))] == [
        ("mapping", "a", "a shard of 12 bytes cannot be in f15.safetensors (11 bytes)")]
    twice = dict(tensors, b=tensors["b"].model_copy(update={"shards": GridShards(cuts=((0, 1, 5), 1), files=(7, 7), key="b")}))
    assert [(f.code, f.message) for f in manifest_findings(_manifest_of(twice, sizes))] == [
        ("mapping", "two shards read key 'b' of f7.safetensors (both of b)")]
    shared = dict(tensors, e=tensors["e"].model_copy(update={"shards": GridShards(cuts=(4, 1), files=FileRange(start=1, step=1), key="a")}))
    found = manifest_findings(_manifest_of(shared, sizes))
    assert [(f.code, f.where) for f in found] == [("mapping", "e")] * 2  # e's non-empty rows in files 1 and 3 meet a's cells
    assert "two shards read key 'a' of f1.safetensors (the other of a)" in found[0].message
