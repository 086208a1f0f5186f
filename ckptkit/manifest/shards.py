"""Shard specs of the manifest as boxes: expand, compact into grids, find the shards a box needs (pure)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..boxes import Box, chunk_cuts
from .model import BoxShard, BoxShards, FileRange, GridShards, TensorEntry


@dataclass(frozen=True, slots=True)
class Shard:
    """A box of a global tensor and where its bytes are: file index and key in that file."""

    box: Box
    file: int
    key: str


def grid_cuts(shape: Sequence[int], spec: GridShards) -> list[list[int]]:
    """Return the explicit cut positions of every dim of a grid."""
    cuts: list[list[int]] = []
    for size, c in zip(shape, spec.cuts):
        cuts.append(chunk_cuts(size, c) if isinstance(c, int) else list(c))
    return cuts


def grid_cell_count(shape: Sequence[int], spec: GridShards) -> int:
    return math.prod(c if isinstance(c, int) else len(c) - 1 for c in spec.cuts)


def grid_file(spec: GridShards, cell: int) -> int:
    if isinstance(spec.files, FileRange):
        return spec.files.start + cell * spec.files.step
    return spec.files[cell]


def iter_shards(entry: TensorEntry) -> Iterator[Shard]:
    """Yield every non-empty shard of a tensor, whatever the spec's layout."""
    spec = entry.shards
    if isinstance(spec, BoxShards):
        for b in spec.boxes:
            box = Box(tuple(b.offsets), tuple(b.lengths))
            if box.volume or not box.ndim:
                yield Shard(box, b.file, b.key)
        return
    cuts = grid_cuts(entry.shape, spec)
    ranges = [range(len(c) - 1) for c in cuts]
    for cell, idx in enumerate(itertools.product(*ranges)):
        box = _cell_box(cuts, idx)
        if box.volume or not box.ndim:
            yield Shard(box, grid_file(spec, cell), spec.key)


def _cell_box(cuts: list[list[int]], idx: Sequence[int]) -> Box:
    return Box(
        tuple(c[i] for c, i in zip(cuts, idx)),
        tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx)),
    )


def shards_overlapping(entry: TensorEntry, box: Box) -> list[Shard]:
    """Return the shards of `entry` that share at least one element with `box`.

    Grids are searched by bisection per dim; explicit boxes by a scan.
    """
    spec = entry.shards
    if isinstance(spec, BoxShards):
        return [s for s in iter_shards(entry) if s.box.intersect(box) is not None or not box.ndim]
    cuts = grid_cuts(entry.shape, spec)
    ranges = []
    for c, lo, n in zip(cuts, box.offsets, box.lengths):
        first = bisect.bisect_right(c, lo) - 1
        last = bisect.bisect_left(c, lo + n)
        ranges.append(range(max(first, 0), min(last, len(c) - 1)))
    strides = [math.prod(len(c) - 1 for c in cuts[d + 1 :]) for d in range(len(cuts))]
    found = []
    for idx in itertools.product(*ranges):
        cell_box = _cell_box(cuts, idx)
        if cell_box.volume or not cell_box.ndim:
            cell = sum(i * s for i, s in zip(idx, strides))
            found.append(Shard(cell_box, grid_file(spec, cell), spec.key))
    return found


def compact_shards(shape: Sequence[int], shards: Sequence[Shard]) -> BoxShards | GridShards:
    """Return the smallest spec that describes `shards`: a grid when they form one, else boxes.

    A grid needs every shard under one key, every cell present once and distinct files;
    cut positions become a chunk count where torch.chunk would cut the same way, and the
    file list an arithmetic range where it is one.
    """
    grid = _as_grid(tuple(shape), shards)
    if grid is not None:
        return grid
    boxes = tuple(
        BoxShard(offsets=s.box.offsets, lengths=s.box.lengths, file=s.file, key=s.key)
        for s in sorted(shards, key=lambda s: s.box.offsets)
    )
    return BoxShards(boxes=boxes)


def grid_cuts_of(shape: Sequence[int], boxes: Sequence[Box]) -> list[np.ndarray] | None:
    """Return the per-dim cut positions when `boxes` are exactly the cells of a grid, else None.

    Cells must all be present once and non-empty. Vectorized: cheap for thousands of boxes.
    """
    found = _grid_order(tuple(shape), boxes)
    return None if found is None else found[0]


def _grid_order(shape: tuple[int, ...], boxes: Sequence[Box]) -> tuple[list[np.ndarray], np.ndarray] | None:
    """Return (cuts, the order that sorts `boxes` into row-major cells) for a grid, else None."""
    nd = len(shape)
    if len(boxes) < 2 or not nd:
        return None
    flat = itertools.chain.from_iterable(b.offsets + b.lengths for b in boxes)
    table = np.fromiter(flat, dtype=np.int64, count=len(boxes) * 2 * nd).reshape(len(boxes), 2 * nd)
    offsets, lengths = table[:, :nd], table[:, nd:]
    cuts = [np.append(_distinct(offsets[:, d]), shape[d]) for d in range(nd)]
    if math.prod(len(c) - 1 for c in cuts) != len(boxes):
        return None
    order = np.lexsort(offsets.T[::-1])
    starts = np.stack(np.meshgrid(*[c[:-1] for c in cuts], indexing="ij"), axis=-1).reshape(-1, nd)
    sizes = np.stack(np.meshgrid(*[np.diff(c) for c in cuts], indexing="ij"), axis=-1).reshape(-1, nd)
    if not (np.array_equal(offsets[order], starts) and np.array_equal(lengths[order], sizes)):
        return None
    return cuts, order


def _distinct(values: np.ndarray) -> np.ndarray:
    ordered = np.sort(values)
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


def _is_chunking(size: int, cuts: np.ndarray) -> bool:
    """True when `cuts` are where torch.chunk cuts `size` into len(cuts) - 1 chunks."""
    count = len(cuts) - 1
    step = -(-size // count)
    return bool(np.array_equal(np.minimum(np.arange(count + 1) * step, size), cuts))


def _as_grid(shape: tuple[int, ...], shards: Sequence[Shard]) -> GridShards | None:
    key = shards[0].key if shards else ""
    if len({s.key for s in shards}) != 1:
        return None
    found = _grid_order(shape, [s.box for s in shards])
    if found is None:
        return None
    cuts, order = found
    files = np.fromiter((s.file for s in shards), dtype=np.int64, count=len(shards))[order]
    steps = np.diff(files)
    arithmetic = steps[0] > 0 and bool((steps == steps[0]).all())
    if not arithmetic and len(_distinct(files)) != len(files):
        return None
    dims: list[int | tuple[int, ...]] = [
        len(c) - 1 if _is_chunking(size, c) else tuple(int(x) for x in c) for size, c in zip(shape, cuts)
    ]
    if arithmetic:
        file_spec: tuple[int, ...] | FileRange = FileRange(start=int(files[0]), step=int(steps[0]))
    else:
        file_spec = tuple(int(f) for f in files)
    return GridShards(cuts=tuple(dims), files=file_spec, key=key)
