"""Plan loads (pure): which source shard bytes fill which part of which target box.

Load-time resharding and offline reshard share this planner: a target is any box of a
global tensor; the plan intersects it with the source shards of the manifest.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..boxes import Box, in_bounds
from ..errors import LayoutError, summarize
from ..manifest import BoxShards, Manifest, TensorEntry
from ..manifest.model import Shard
from ..manifest.shards import iter_shards, shards_overlapping


@dataclass(frozen=True, slots=True)
class Read:
    """Copy `overlap` (global coordinates) from the shard `src_box` stored at (file, key)."""

    file: int
    key: str
    src_box: Box
    overlap: Box


@dataclass(frozen=True, slots=True)
class TargetPlan:
    """Everything that fills one target box of one tensor."""

    fqn: str
    box: Box
    reads: tuple[Read, ...]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    targets: tuple[TargetPlan, ...]

    def files(self) -> list[int]:
        """Return the indices of the payload files the plan reads, sorted."""
        return sorted({r.file for t in self.targets for r in t.reads})

    @property
    def nbytes_read(self) -> int:
        return sum(r.overlap.volume for t in self.targets for r in t.reads)


class ShardLookup:
    """Find the shards of a manifest's tensors that meet a box, fast for long box lists.

    Grids are searched by bisection (``shards_overlapping``). A list of many boxes (ZeRO
    partitions of thousands of ranks) is indexed along dim 0 once per tensor, so that a
    query looks only at the few boxes near it. Reuse one lookup across the `plan_load`
    calls of one plan.
    """

    MIN_INDEXED = 2

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._index: dict[str, _DimZeroIndex | None] = {}

    def overlaps(self, fqn: str, box: Box) -> list[tuple[Shard, Box]]:
        """Return (shard, common box) for every shard of tensor `fqn` that shares an element with `box`."""
        if fqn not in self._index:
            entry = self.manifest.tensors[fqn]
            boxed = isinstance(entry.shards, BoxShards) and len(entry.shards.boxes) >= self.MIN_INDEXED
            self._index[fqn] = _DimZeroIndex(list(iter_shards(entry))) if boxed and entry.shape else None
        index = self._index[fqn]
        if index is None:
            return _overlaps(self.manifest.tensors[fqn], box)
        return index.overlaps(box)


def _overlaps(entry: TensorEntry, box: Box) -> list[tuple[Shard, Box]]:
    out = []
    for shard in shards_overlapping(entry, box):
        common = shard.box.intersect(box)
        if common is not None:
            out.append((shard, common))
    return out


class _DimZeroIndex:
    """Boxes sorted by their start along dim 0, with the boxes covering each start position.

    The boxes meeting rows [a, b) are those covering row a (found at the last start <= a)
    and those starting inside (a, b): for a tiling, a handful each, whatever their heights.
    Boxes covering a row side by side (TP column splits) are sorted along dim 1 so that a
    query bisects to the columns it needs.
    """

    def __init__(self, shards: list[Shard]) -> None:
        self.shards = sorted(shards, key=lambda s: s.box.offsets[0])
        self.starts = [s.box.offsets[0] for s in self.shards]
        self.points: list[int] = []
        self.covering: list[_Row] = []
        active: list[Shard] = []
        for i, shard in enumerate(self.shards):
            start = self.starts[i]
            if self.points and self.points[-1] == start:
                active.append(shard)
                continue
            if self.points:
                self.covering.append(_Row(active))
            active = [s for s in active if s.box.offsets[0] + s.box.lengths[0] > start] + [shard]
            self.points.append(start)
        if self.points:
            self.covering.append(_Row(active))

    def overlaps(self, box: Box) -> list[tuple[Shard, Box]]:
        a, b = box.offsets[0], box.offsets[0] + box.lengths[0]
        at = bisect.bisect_right(self.points, a) - 1
        around = self.covering[at].near(box) if at >= 0 else []
        inside = self.shards[bisect.bisect_right(self.starts, a) : bisect.bisect_left(self.starts, b)]
        out = []
        for shards in (around, inside):
            for shard in shards:
                common = shard.box.intersect(box)
                if common is not None:
                    out.append((shard, common))
        return out


class _Row:
    """The boxes covering one row position, sorted along dim 1 when there are several."""

    def __init__(self, shards: list[Shard]) -> None:
        wide = len(shards) > 2 and len(shards[0].box.offsets) > 1
        self.shards = sorted(shards, key=lambda s: s.box.offsets[1]) if wide else shards
        self.starts = [s.box.offsets[1] for s in self.shards] if wide else []
        self.reach = max((s.box.lengths[1] for s in self.shards), default=0) if wide else 0

    def near(self, box: Box) -> list[Shard]:
        if not self.starts:
            return self.shards
        c, d = box.offsets[1], box.offsets[1] + box.lengths[1]
        return self.shards[bisect.bisect_left(self.starts, c - self.reach + 1) : bisect.bisect_left(self.starts, d)]


def plan_load(manifest: Manifest, requests: Sequence[tuple[str, Box]], *, lookup: ShardLookup | None = None) -> LoadPlan:
    """Plan the reads that fill each requested (fqn, box).

    Raises:
        LayoutError: a requested tensor is not in the checkpoint, or a box is outside its
            shape, or the checkpoint's shards do not cover a box (all problems listed).
    """
    problems: list[str] = []
    targets = []
    tensors = manifest.tensors
    for fqn, box in requests:
        entry = tensors.get(fqn)
        if entry is None:
            problems.append(f"{fqn}: not in the checkpoint")
            continue
        if not in_bounds(box, entry.shape):
            problems.append(
                f"{fqn}: requested box at {list(box.offsets)} of size {list(box.lengths)} "
                f"is outside the checkpoint's shape {list(entry.shape)}"
            )
            continue
        volume = math.prod(box.lengths)
        reads: tuple[Read, ...] = ()
        covered = 0
        if volume or not box.lengths:
            found = lookup.overlaps(fqn, box) if lookup is not None else _overlaps(entry, box)
            reads = tuple([Read(shard.file, shard.key, shard.box, overlap) for shard, overlap in found])
            covered = sum([math.prod(overlap.lengths) for _, overlap in found])
        if covered != volume:
            problems.append(f"{fqn}: the checkpoint's shards cover {covered} of the {volume} elements requested")
        targets.append(TargetPlan(fqn, box, reads))
    if problems:
        raise LayoutError(f"cannot load: {len(problems)} problem(s): " + summarize(problems))
    return LoadPlan(tuple(targets))
