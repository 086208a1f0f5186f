"""Plan an offline reshard (pure): the target checkpoint's files, and the source bytes of each.

The target is planned exactly as a save by the target topology's ranks would be: every rank
holds the boxes its layout gives it, replicas are written once (``plan_save``), and each box
of each target file is then filled from the source shards it overlaps (``plan_load``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import LayoutError
from .layouts import Layout
from .manifest import Manifest, Topology
from .planner import TargetPlan, plan_load
from .save_plan import FilePlan, ItemDesc, SavePlan, plan_save
from .shards import iter_shards


@dataclass(frozen=True, slots=True)
class FileJob:
    """One target payload file: the rank that would have written it, its plan, and the reads
    that fill each of its items (``reads[i]`` fills ``plan.items[i]``)."""

    rank: int
    plan: FilePlan
    reads: tuple[TargetPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(item.nbytes for item, _ in self.plan.items)


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    topology: Topology
    save: SavePlan
    jobs: tuple[FileJob, ...]
    kept: tuple[str, ...]  # tensors the layout does not place: copied with their saved boxes

    @property
    def nbytes(self) -> int:
        return sum(j.nbytes for j in self.jobs)


def describe(topology: Topology) -> str:
    t = topology
    return f"tp={t.tp} pp={t.pp} dp={t.dp} zero={t.zero_stage}"


def plan_reshard(
    manifest: Manifest,
    layout: Layout,
    topology: Topology,
    *,
    files_per_rank: int = 1,
    max_file_bytes: int | None = None,
) -> ReshardPlan:
    """Plan the checkpoint that `topology`'s ranks would have saved from the same state.

    Raises:
        LayoutError: the model cannot be laid out over `topology`, the checkpoint lacks part
            of a tensor group the layout places, or the layout does not match the saved
            shapes; every problem is listed.
    """
    problems = layout.problems(topology)
    if problems:
        raise LayoutError(f"cannot reshard to {describe(topology)}: " + "; ".join(problems))
    placed: set[str] = set()
    for group, names in layout.tensor_groups().items():
        missing = [n for n in names if n not in manifest.tensors]
        if len(missing) == len(names):
            continue  # e.g. a checkpoint without optimizer state
        if missing:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            raise LayoutError(f"the checkpoint holds only part of {group!r}: missing {shown}")
        placed.update(names)
    world = topology.world_size
    ranks: list[list[ItemDesc]] = [[] for _ in range(world)]
    for rank in range(world):
        for fqn, boxes in layout.rank_boxes(topology, rank).items():
            if fqn in placed:
                entry = manifest.tensors[fqn]
                ranks[rank].extend(ItemDesc(fqn, entry.dtype, entry.shape, box) for box in boxes)
    kept = tuple(sorted(set(manifest.tensors) - placed))
    for fqn in kept:
        entry = manifest.tensors[fqn]
        for i, shard in enumerate(iter_shards(entry)):
            ranks[i % world].append(ItemDesc(fqn, entry.dtype, entry.shape, shard.box))
    try:
        save = plan_save(ranks, max_file_bytes=max_file_bytes, files_per_rank=files_per_rank)
    except LayoutError as exc:
        raise LayoutError(f"the model config in info.model does not match the saved tensors: {exc}") from None
    missing_kept = sorted(set(manifest.tensors) - set(save.tensors))
    if missing_kept:
        raise LayoutError(f"tensors with no place in the target: {', '.join(missing_kept[:10])}")
    jobs = []
    for rank, files in enumerate(save.files):
        for f in files:
            reads = plan_load(manifest, [(item.fqn, item.box) for item, _ in f.items]).targets
            jobs.append(FileJob(rank, f, reads))
    return ReshardPlan(topology, save, tuple(jobs), kept)
