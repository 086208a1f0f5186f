"""Plan an incremental save (pure): which planned boxes an earlier checkpoint holds already, and
the files of the checkpoint once the unchanged boxes refer to it.

A box is unchanged when the xxh3-128 of its bytes, computed by the rank that holds them, equals
the digest the earlier checkpoint recorded for the same tensor, dtype, shape and box
(``FileEntry.contents``); it is then read from that checkpoint's file, which the new manifest
lists with the checkpoint that holds it (``FileEntry.base``). Nothing is taken on trust: a box
with no recorded digest, or another one, is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..boxes import Box
from ..manifest import FileEntry, Manifest
from ..manifest.shards import iter_shards
from .save import FilePlan, ItemDesc, SavePlan

DIGEST = "xxh3-128:"  # the prefix of a box's digest in ``FileEntry.contents``


@dataclass(frozen=True, slots=True)
class Held:
    """A box an earlier checkpoint holds: its digest, the file (named with the checkpoint that
    holds it) and the key there."""

    digest: str
    file: FileEntry
    key: str


def held_boxes(base: Manifest, base_name: str) -> dict[tuple[str, str, tuple[int, ...], Box], Held]:
    """Every box of `base` (the committed checkpoint `base_name`) with a recorded digest, by
    (tensor, dtype, shape, box)."""
    out: dict[tuple[str, str, tuple[int, ...], Box], Held] = {}
    named: dict[int, FileEntry] = {}
    for fqn, entry in base.tensors.items():
        for shard in iter_shards(entry):
            f = base.files[shard.file]
            digest = (f.contents or {}).get(shard.key)
            if digest is None:
                continue
            if shard.file not in named:
                named[shard.file] = f if f.base is not None else f.model_copy(update={"base": base_name})
            out[(fqn, entry.dtype, tuple(entry.shape), shard.box)] = Held(digest, named[shard.file], shard.key)
    return out


def held_for(plan: SavePlan, held: dict[tuple[str, str, tuple[int, ...], Box], Held]) -> list[list[list[Held | None]]]:
    """For each rank, each of its files, each item: what the earlier checkpoint holds of it."""
    return [[[held.get((item.fqn, item.dtype, item.shape, item.box)) for item, _ in f.items] for f in files] for files in plan.files]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a rank did with one planned file: the items it wrote (their indices in the plan) and
    their digests, and the items it found unchanged."""

    written: tuple[int, ...]
    digests: dict[str, str]  # key -> digest, of the written items
    unchanged: tuple[int, ...]


def written_part(f: FilePlan, outcome: Outcome) -> FilePlan:
    """The part of a planned file that was written."""
    return FilePlan(f.path, tuple(f.items[i] for i in outcome.written))


def borrowed_files(
    plans: Sequence[FilePlan], outcomes: Sequence[Outcome], held: Sequence[Sequence[Held | None]]
) -> list[tuple[FileEntry, FilePlan]]:
    """The earlier checkpoints' files the unchanged items of `plans` are read from, each with a
    plan of the items it holds under their keys there (its path: where the file is, relative to
    the new checkpoint, unique among the files), in order of first use."""
    out: dict[tuple[str | None, str], tuple[FileEntry, list[tuple[ItemDesc, str]]]] = {}
    for f, outcome, found in zip(plans, outcomes, held):
        for i in outcome.unchanged:
            h = found[i]
            assert h is not None  # a rank reports an item unchanged only against a held digest
            slot = out.setdefault((h.file.base, h.file.path), (h.file, []))
            slot[1].append((f.items[i][0], h.key))
    return [(entry, FilePlan(entry.where(), tuple(items))) for entry, items in out.values()]


__all__ = ["DIGEST", "Held", "Outcome", "borrowed_files", "held_boxes", "held_for", "written_part"]
