"""Plan loads (pure): which source shard bytes fill which part of which target box.

Load-time resharding and offline reshard share this planner: a target is any box of a
global tensor; the plan intersects it with the source shards of the manifest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .boxes import Box, in_bounds
from .errors import LayoutError
from .manifest import Manifest
from .shards import shards_overlapping


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


def plan_load(manifest: Manifest, requests: Sequence[tuple[str, Box]]) -> LoadPlan:
    """Plan the reads that fill each requested (fqn, box).

    Raises:
        LayoutError: a requested tensor is not in the checkpoint, or a box is outside its
            shape, or the checkpoint's shards do not cover a box (all problems listed).
    """
    problems: list[str] = []
    targets = []
    for fqn, box in requests:
        entry = manifest.tensors.get(fqn)
        if entry is None:
            problems.append(f"{fqn}: not in the checkpoint")
            continue
        if not in_bounds(box, entry.shape):
            problems.append(
                f"{fqn}: requested box at {list(box.offsets)} of size {list(box.lengths)} "
                f"is outside the checkpoint's shape {list(entry.shape)}"
            )
            continue
        reads = []
        covered = 0
        if box.volume or not box.ndim:
            for shard in shards_overlapping(entry, box):
                overlap = shard.box.intersect(box)
                if overlap is not None:
                    reads.append(Read(shard.file, shard.key, shard.box, overlap))
                    covered += overlap.volume
        if covered != box.volume:
            problems.append(f"{fqn}: the checkpoint's shards cover {covered} of the {box.volume} elements requested")
        targets.append(TargetPlan(fqn, box, tuple(reads)))
    if problems:
        raise LayoutError(f"cannot load: {len(problems)} problem(s): " + "; ".join(problems[:20]))
    return LoadPlan(tuple(targets))
