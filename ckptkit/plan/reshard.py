"""Plan an offline reshard (pure): the target checkpoint's files, and the source bytes of each.

The target is planned exactly as a save by the target topology's ranks would be: every rank
holds the boxes its layout gives it, replicas are written once (``plan_files``). Then, per
target file, ``plan_reads`` finds the source shard bytes that fill each of its boxes.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from ..boxes import Box, in_bounds, tiling_problems
from ..errors import LayoutError, summarize
from ..layouts import Holders, Layout, holders, placed_tensors, topology_problems
from ..layouts.saved import Saved
from ..manifest import Manifest, Topology
from .load import ShardLookup, TargetPlan, plan_load
from .save import FilePlan, ItemDesc, SavePlan, derived_file, plan_files
from ..manifest.shards import iter_shards


@dataclass(frozen=True, slots=True)
class FileJob:
    """One target payload file and the rank that would have written it."""

    rank: int
    plan: FilePlan

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item, _ in self.plan.items)


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    topology: Topology
    save: SavePlan
    jobs: tuple[FileJob, ...]
    kept: tuple[str, ...]  # tensors the layout does not place: copied with their saved boxes
    layout: Layout | None = None  # recorded in the target's manifest
    # The state groups the target derives (manifest 1.6): dtype and kind by label. ``save`` then
    # holds the kept tensors alone, and ``jobs`` one file per target rank, in rank order.
    derived: dict[str, tuple[str, str]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(j.nbytes for j in self.jobs)


def plan_reshard(
    manifest: Manifest,
    layout: Layout,
    topology: Topology,
    *,
    files_per_rank: int | None = None,
    max_file_bytes: int | None = None,
) -> ReshardPlan:
    """Plan the checkpoint that `topology`'s ranks would have saved from the same state: its
    layout tensors derived, one file per rank, as a save with the layout writes them (unless
    `files_per_rank` or `max_file_bytes` is given, or a state group mixes dtypes or kinds: then
    listed, `files_per_rank` files per rank, 1 by default).

    Raises:
        LayoutError: the model cannot be laid out over `topology`, the checkpoint lacks part
            of a tensor group the layout places, or the layout does not match the saved
            shapes; every problem is listed.
    """
    problems = topology_problems(layout, topology)
    if problems:
        raise LayoutError(f"cannot reshard to {topology.describe()}: " + summarize(problems))
    placed, problems = placed_tensors(layout, {fqn: t.shape for fqn, t in manifest.tensors.items()})
    problems += unplaced_problems(layout, manifest, placed)
    if problems:
        raise LayoutError(f"the layout does not match the saved tensors: {len(problems)} problem(s): " + summarize(problems))
    groups = _derived_groups(manifest, layout, placed) if files_per_rank is None and max_file_bytes is None else None
    with collector_paused():
        if groups is not None:
            return _derived_plan(manifest, layout, topology, placed, groups)
        by_tensor = {fqn: boxes for fqn, boxes in holders(layout, topology).items() if fqn in placed}
        return plan_placement(manifest, by_tensor, topology, files_per_rank=files_per_rank or 1,
                              max_file_bytes=max_file_bytes, layout=layout)


def _derived_groups(manifest: Manifest, layout: Layout, placed: set[str]) -> dict[str, tuple[str, str]] | None:
    """(dtype, kind) of each state group the checkpoint holds, when each group has one of each."""
    found: dict[str, set[tuple[str, str]]] = {}
    for fqn in placed:
        entry = manifest.tensors[fqn]
        group = next(g for g in layout.states if g.tensor_of(fqn) is not None)
        found.setdefault(group.label, set()).add((entry.dtype, entry.kind))
    if any(len(v) != 1 for v in found.values()):
        return None
    return {g.label: found[g.label].pop() for g in layout.states if g.label in found}  # in the layout's order


class _Whole(Mapping[str, ItemDesc]):
    """The whole-tensor description of a checkpoint's tensors, made as they are asked for."""

    def __init__(self, manifest: Manifest) -> None:
        self.tensors = manifest.tensors

    def __getitem__(self, fqn: str) -> ItemDesc:
        entry = self.tensors[fqn]
        return ItemDesc(fqn, entry.dtype, entry.shape, Box((0,) * len(entry.shape), entry.shape))

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _derived_plan(manifest: Manifest, layout: Layout, topology: Topology, placed: set[str],
                  groups: dict[str, tuple[str, str]]) -> ReshardPlan:
    """The target of a reshard whose layout tensors are derived: each target rank's one file holds
    what the rule has it write and its share of the kept tensors (at their saved boxes)."""
    world = topology.world_size
    kept = tuple(sorted(set(manifest.tensors) - placed))
    by_tensor = {fqn: {shard.box: [i % world] for i, shard in enumerate(iter_shards(manifest.tensors[fqn]))} for fqn in kept}
    whole = _Whole(manifest)
    save = plan_files(by_tensor, {fqn: whole[fqn] for fqn in kept}, world)
    saved = Saved(layout, topology, list(groups))
    jobs = tuple(FileJob(rank, derived_file(saved, rank, whole, save.files[rank])) for rank in range(world))
    return ReshardPlan(topology, save, jobs, kept, layout, groups)


def unplaced_problems(layout: Layout, manifest: Manifest, placed: set[str]) -> list[str]:
    """Say so when the layout places none of the checkpoint's tensors, or leaves parameters or
    optimizer state under its state groups (``model/``, the optimizer's moments) without a
    place: a target labelled with a topology must hold those where that topology has them
    (buffers, as RNG rows, keep their saved boxes)."""
    if not placed:
        return [f"the layout {layout.name!r} places none of the checkpoint's tensors "
                f"(it names {', '.join(layout.tensor_groups())}/...; is it this model's layout?)"]
    unplaced = sorted(fqn for fqn, t in manifest.tensors.items()
                      if fqn not in placed and t.kind in ("param", "optimizer")
                      and any(g.tensor_of(fqn) is not None for g in layout.states))
    if not unplaced:
        return []
    shown = ", ".join(unplaced[:10]) + (f" and {len(unplaced) - 10} more" if len(unplaced) > 10 else "")
    return [f"the layout {layout.name!r} has no place for {len(unplaced)} of the checkpoint's tensors: {shown}"]


def plan_placement(
    manifest: Manifest,
    placement: Holders,
    topology: Topology,
    *,
    files_per_rank: int = 1,
    max_file_bytes: int | None = None,
    layout: Layout | None = None,
) -> ReshardPlan:
    """Plan the target files when the tensors of `placement` get its boxes (each held by the
    ranks given); every other tensor keeps its saved boxes.

    Raises:
        LayoutError: a placed tensor is not in the checkpoint, or its boxes do not tile it
            (every problem is listed).
    """
    world = topology.world_size
    problems = [f"{fqn}: not in the checkpoint" for fqn in sorted(placement) if fqn not in manifest.tensors]
    by_tensor = {fqn: boxes for fqn, boxes in placement.items() if fqn in manifest.tensors}
    placed = set(by_tensor)
    kept = tuple(sorted(set(manifest.tensors) - placed))
    for fqn in kept:
        entry = manifest.tensors[fqn]
        by_tensor[fqn] = {shard.box: [i % world] for i, shard in enumerate(iter_shards(entry))}
    meta = {}
    for fqn in sorted(set(by_tensor) | placed):
        entry = manifest.tensors[fqn]
        meta[fqn] = ItemDesc(fqn, entry.dtype, entry.shape, Box((0,) * len(entry.shape), entry.shape))
        problems += [f"{fqn}: {p}" for p in _tiling_problems(entry.shape, list(by_tensor.get(fqn, {})))]
    if problems:
        raise LayoutError(
            f"the layout does not match the saved tensors: {len(problems)} problem(s): "
            + summarize(problems)
        )
    save = plan_files(by_tensor, meta, world, max_file_bytes=max_file_bytes, files_per_rank=files_per_rank)
    jobs = [FileJob(rank, f) for rank, files in enumerate(save.files) for f in files]
    return ReshardPlan(topology, save, tuple(jobs), kept, layout)


def plan_reads(manifest: Manifest, job: FileJob, lookup: ShardLookup | None = None) -> tuple[TargetPlan, ...]:
    """Return the source reads that fill each item of a target file (``[i]`` fills ``job.plan.items[i]``).

    Planned per file, by the process that writes it, so that the processes of a split
    reshard plan only their own reads; share one `lookup` between the files of a process,
    and plan many files inside one ``collector_paused()``.
    """
    requests = [(item.fqn, item.box) for item, _ in job.plan.items]
    return plan_load(manifest, requests, lookup=lookup or ShardLookup(manifest)).targets


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector: plans allocate hundreds of thousands of small
    acyclic objects, and each full collection would walk them all again (and the manifest).
    Pause once around a whole planning pass: re-enabling it triggers a collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# Boxes from a layout are checked for overlaps only up to this many per tensor; past it, for
# bounds and total volume (overlap sweeps over the ZeRO boxes of thousands of ranks would
# dominate the plan; the layouts' own tests check that their boxes tile).
FULL_TILING_CHECK = 64


def _tiling_problems(shape: tuple[int, ...], boxes: list[Box]) -> list[str]:
    if len(boxes) <= FULL_TILING_CHECK:
        return tiling_problems(shape, boxes)
    outside = [b for b in boxes if not in_bounds(b, shape)]
    if outside:
        return [f"box at {list(outside[0].offsets)} of size {list(outside[0].lengths)} is outside shape {list(shape)}"]
    covered = sum(b.volume for b in boxes)
    return [] if covered == math.prod(shape) else [f"boxes hold {covered} of {math.prod(shape)} elements"]
