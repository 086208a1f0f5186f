"""Shard specs of the manifest as boxes: expand, compact into grids, find the shards a box needs (pure)."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Collection, Iterator, Mapping, Sequence

import numpy as np

from ..boxes import Box, chunk_cuts, chunk_step, full_box
from .derived import DerivedShards, derivation_of, listed_tensors
from .model import BoxShard, BoxShards, FileRange, GridShards, Manifest, Patch, Shard, TensorEntry


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
    if isinstance(spec, DerivedShards):
        yield from spec.source.overlapping(spec.fqn, full_box(entry.shape))
        return
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


# The keys of one payload file's header: key -> (dtype, the shard's shape, tensor name); by file index.
Keys = dict[str, tuple[str, tuple[int, ...], str]]
FileKeys = dict[int, Keys]


def file_keys(tensors: Mapping[str, TensorEntry], skip: Collection[str] = ()) -> FileKeys:
    """The keys each payload file must hold for the non-empty shards of `tensors` (those not in
    `skip`), in one pass over every shard. An empty shard has no bytes and no key (``save``
    writes none)."""
    out: FileKeys = {}
    source = derivation_of(tensors)
    if source is not None:
        for file in range(source.files()):
            for fqn, box, key, dtype in source.file_keys(file):
                if fqn not in skip:
                    out.setdefault(file, {})[key] = (dtype, box.lengths, fqn)
    for fqn, tensor in listed_tensors(tensors).items():
        if fqn in skip:
            continue
        for shard in iter_shards(tensor):
            out.setdefault(shard.file, {})[shard.key] = (tensor.dtype, shard.box.lengths, fqn)
        for p in tensor.patches:
            out.setdefault(p.file, {})[p.indices] = (patch_index_dtype(p), (p.count,), fqn)
            out.setdefault(p.file, {})[p.values] = (tensor.dtype, (p.count,), fqn)
    return out


def patch_index_dtype(patch: Patch) -> str:
    """The dtype of a patch's flat indices: ``uint32``, or ``int64`` for a box of 2^32 elements or more."""
    return "uint32" if math.prod(patch.lengths) <= 1 << 32 else "int64"


def spec_keys(entry: TensorEntry) -> set[str]:
    """The payload keys a tensor's shard spec names, without expanding a grid."""
    spec = entry.shards
    if isinstance(spec, DerivedShards):
        return {s.key for s in iter_shards(entry)}
    return {spec.key} if isinstance(spec, GridShards) else {b.key for b in spec.boxes}


def spec_files(entry: TensorEntry) -> set[int]:
    """The files a tensor's shard spec names, empty shards included (a sound spec: a grid's cells
    are bounded by the tensor's size)."""
    spec = entry.shards
    if isinstance(spec, DerivedShards):
        return {s.file for s in iter_shards(entry)}
    if isinstance(spec, BoxShards):
        return {b.file for b in spec.boxes}
    return {grid_file(spec, cell) for cell in range(grid_cell_count(entry.shape, spec))}


def grid_cells(shape: Sequence[int], spec: GridShards) -> tuple[np.ndarray, np.ndarray]:
    """The file index and the element count of every cell of a grid, row-major, as arrays (no
    Python object per cell: a grid over thousands of ranks costs microseconds)."""
    lengths = [np.diff(np.asarray(c, dtype=np.int64)) for c in _cuts_array(shape, spec)]
    volumes = functools.reduce(np.multiply.outer, lengths, np.ones((), dtype=np.int64)).reshape(-1)
    if isinstance(spec.files, FileRange):
        files = spec.files.start + spec.files.step * np.arange(len(volumes), dtype=np.int64)
    else:
        files = np.asarray(spec.files, dtype=np.int64).reshape(-1)
    return files, volumes


def shard_count(entry: TensorEntry) -> int:
    """The number of non-empty shards of a tensor (what `iter_shards` yields), grids counted as arrays."""
    spec = entry.shards
    if isinstance(spec, DerivedShards):
        return sum(1 for _ in iter_shards(entry))
    if isinstance(spec, BoxShards):
        return sum(1 for b in spec.boxes if not b.lengths or 0 not in b.lengths)
    _, volumes = grid_cells(entry.shape, spec)
    return len(volumes) if not entry.shape else int(np.count_nonzero(volumes))


def _cuts_array(shape: Sequence[int], spec: GridShards) -> list[np.ndarray]:
    """The cut positions of every dim of a grid, as arrays."""
    out = []
    for size, c in zip(shape, spec.cuts):
        if isinstance(c, int):
            out.append(np.minimum(np.arange(c + 1, dtype=np.int64) * chunk_step(size, c), size))
        else:
            out.append(np.asarray(c, dtype=np.int64))
    return out


class KeyIndex:
    """The shard a payload file holds under a key, found without expanding grids: what a reader
    checks each key of a header against. Built in one pass over the listed tensors' specs but
    `skip` (a grid is one entry, a list of boxes is indexed on first use); a derived tensor's keys
    are its rule's, file by file."""

    def __init__(self, tensors: Mapping[str, TensorEntry], skip: Collection[str] = ()) -> None:
        self.tensors = tensors
        self._source = derivation_of(tensors)
        self._derived: dict[int, dict[str, tuple[str, Box]]] = {}
        self._owners: dict[str, list[str]] = {}
        listed = {fqn: entry for fqn, entry in listed_tensors(tensors).items() if fqn not in skip}
        for fqn, entry in listed.items():
            for key in spec_keys(entry):
                self._owners.setdefault(key, []).append(fqn)
        self._boxes: dict[str, dict[tuple[int, str], Box]] = {}
        self._cells: dict[str, dict[int, int]] = {}
        self._patches = {(p.file, key): (dtype, (p.count,)) for entry in listed.values() for p in entry.patches
                         for key, dtype in ((p.indices, patch_index_dtype(p)), (p.values, entry.dtype))}

    def patch_key(self, file: int, key: str) -> tuple[str, tuple[int, ...]] | None:
        """(dtype, shape) of the patch array stored in `file` under `key`, or None."""
        return self._patches.get((file, key))

    def shard(self, file: int, key: str) -> tuple[str, Box] | None:
        """(tensor, box) of the non-empty shard stored in `file` under `key`, or None."""
        for fqn in self._owners.get(key, ()):
            box = self._box(fqn, file, key)
            if box is not None and (box.volume or not box.ndim):
                return fqn, box
        if self._source is not None:
            table = self._derived.get(file)
            if table is None:
                table = self._derived[file] = {key: (fqn, box) for fqn, box, key, _ in self._source.file_keys(file)}
            return table.get(key)
        return None

    def _box(self, fqn: str, file: int, key: str) -> Box | None:
        entry = self.tensors[fqn]
        spec = entry.shards
        if isinstance(spec, BoxShards):
            table = self._boxes.get(fqn)
            if table is None:
                table = self._boxes[fqn] = {(b.file, b.key): Box(tuple(b.offsets), tuple(b.lengths)) for b in spec.boxes}
            return table.get((file, key))
        counts = [c if isinstance(c, int) else len(c) - 1 for c in spec.cuts]
        cells = math.prod(counts)
        if isinstance(spec.files, FileRange):
            start, step = spec.files.start, spec.files.step
            cell = 0 if step == 0 and file == start else (file - start) // step if step and (file - start) % step == 0 else -1
        else:
            where = self._cells.get(fqn)
            if where is None:
                where = self._cells[fqn] = {f: i for i, f in reversed(list(enumerate(spec.files)))}
            cell = where.get(file, -1)
        if not 0 <= cell < cells:
            return None
        idx = np.unravel_index(cell, counts) if counts else ()
        offsets, lengths = [], []
        for size, c, i in zip(entry.shape, spec.cuts, idx):
            if isinstance(c, int):
                step = chunk_step(size, c)
                lo, hi = min(int(i) * step, size), min((int(i) + 1) * step, size)
            else:
                lo, hi = c[int(i)], c[int(i) + 1]
            offsets.append(lo)
            lengths.append(hi - lo)
        return Box(tuple(offsets), tuple(lengths))


def _cell_box(cuts: list[list[int]], idx: Sequence[int]) -> Box:
    return Box(
        tuple(c[i] for c, i in zip(cuts, idx)),
        tuple(c[i + 1] - c[i] for c, i in zip(cuts, idx)),
    )


def shards_overlapping(entry: TensorEntry, box: Box) -> list[Shard]:
    """Return the shards of `entry` that share at least one element with `box`.

    Grids are searched by bisection per dim; explicit boxes by a scan; derived ones by their rule.
    """
    spec = entry.shards
    if isinstance(spec, DerivedShards):
        return spec.source.overlapping(spec.fqn, box)
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


def listed_form(manifest: Manifest) -> Manifest:
    """The same checkpoint with every tensor listed (a derived tensor's shards compacted into a
    grid or a list of boxes) and nothing derived: its document lists what a 1.6 one derives.
    The files, keys and bytes are the same."""
    if manifest.derived is None:
        return manifest
    tensors = {fqn: t if not isinstance(t.shards, DerivedShards) else
               TensorEntry(shape=t.shape, dtype=t.dtype, kind=t.kind, shards=compact_shards(t.shape, list(iter_shards(t))))
               for fqn, t in manifest.tensors.items()}
    return manifest.model_copy(update={"tensors": tensors, "derived": None})
