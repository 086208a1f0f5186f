"""Plan an incremental save (pure): which planned boxes an earlier checkpoint holds already, and
the files, shards and patches of the checkpoint once the unchanged boxes refer to it.

A box is unchanged when the xxh3-128 of its bytes, computed by the rank that holds them, equals
the digest the earlier checkpoint recorded for the same tensor, dtype, shape and box (its key's
``FileEntry.contents``, or its last patch's digest); it is then read from that checkpoint's file,
which the new manifest lists with the checkpoint that holds it (``FileEntry.base``), with the
patches it had. A changed box of a 16-bit dtype whose changed elements are few is written as a
patch over it (`Patch`: their positions and new values), when the patch is at most half the
box's bytes and the box's patches together at most its bytes (so a restore reads at most twice
the box); any other box is written whole. Nothing is taken on trust: a box with no recorded
digest, or another one, is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..boxes import Box
from ..manifest import FileEntry, Manifest, Patch
from ..manifest.dtypes import itemsize
from ..manifest.shards import iter_shards, patch_index_dtype
from .save import FilePlan, ItemDesc, SavePlan

DIGEST = "xxh3-128:"  # the prefix of a box's digest in ``FileEntry.contents`` and ``Patch.digest``
PATCHED_ITEMSIZE = 2  # bf16, fp16 (and other 16-bit dtypes) are patched; wider ones change whole at once


@dataclass(frozen=True, slots=True)
class Held:
    """A box an earlier checkpoint holds: its digest, the file (named with the checkpoint that
    holds it) and the key there, and the patches over it (each with its file)."""

    digest: str
    file: FileEntry
    key: str
    patches: tuple[tuple[FileEntry, Patch], ...] = ()

    def patch_bytes(self) -> int:
        """The bytes of the patches over the box (the values are 16-bit: only such boxes are patched)."""
        return sum(p.count * (itemsize(patch_index_dtype(p)) + PATCHED_ITEMSIZE) for _, p in self.patches)


@dataclass(frozen=True, slots=True)
class Ask:
    """What a rank is told of one of its planned items: the digest an earlier checkpoint holds
    for it, and the most bytes a patch over it may take (0: write it whole if it changed)."""

    digest: str | None
    patch_budget: int = 0


def held_boxes(base: Manifest, base_name: str) -> dict[tuple[str, str, tuple[int, ...], Box], Held]:
    """Every box of `base` (the committed checkpoint `base_name`) with a recorded digest, by
    (tensor, dtype, shape, box)."""
    out: dict[tuple[str, str, tuple[int, ...], Box], Held] = {}
    named: dict[int, FileEntry] = {}

    def owned(index: int) -> FileEntry:
        if index not in named:
            f = base.files[index]
            named[index] = f if f.base is not None else f.model_copy(update={"base": base_name})
        return named[index]

    for fqn, entry in base.tensors.items():
        patches: dict[Box, list[Patch]] = {}
        for p in entry.patches:
            patches.setdefault(Box(tuple(p.offsets), tuple(p.lengths)), []).append(p)
        for shard in iter_shards(entry):
            over = patches.pop(shard.box, [])
            digest = over[-1].digest if over else (base.files[shard.file].contents or {}).get(shard.key)
            if digest is None:
                continue
            out[(fqn, entry.dtype, tuple(entry.shape), shard.box)] = Held(
                digest, owned(shard.file), shard.key, tuple((owned(p.file), p) for p in over))
        for box in patches:  # a patch over no shard's box: the box is not held (written whole)
            for key in [k for k in out if k[0] == fqn and k[3].intersect(box) is not None]:
                del out[key]
    return out


def asks_for(plan: SavePlan, held: dict[tuple[str, str, tuple[int, ...], Box], Held]) -> list[list[list[Held | None]]]:
    """For each rank, each of its files, each item: what the earlier checkpoint holds of it."""
    return [[[held.get((item.fqn, item.dtype, item.shape, item.box)) for item, _ in f.items] for f in files] for files in plan.files]


def ask_of(item: ItemDesc, held: Held | None) -> Ask:
    """What the rank holding `item` is told of it."""
    if held is None:
        return Ask(None)
    if itemsize(item.dtype) != PATCHED_ITEMSIZE:
        return Ask(held.digest)
    dense = item.nbytes
    return Ask(held.digest, max(0, min(dense // 2, dense - held.patch_bytes())))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a rank did with one planned file: the items it wrote whole (their indices in the plan)
    and their digests by key, the items it found unchanged, and those it wrote as a patch
    (index, element count, digest of the patched box, keys of its indices and values)."""

    written: tuple[int, ...]
    digests: dict[str, str]
    unchanged: tuple[int, ...]
    patched: tuple[tuple[int, int, str, str, str], ...] = ()

    @property
    def writes(self) -> bool:
        return bool(self.written or self.patched)


def written_part(f: FilePlan, outcome: Outcome) -> FilePlan:
    """The part of a planned file that was written whole."""
    return FilePlan(f.path, tuple(f.items[i] for i in outcome.written))


@dataclass(frozen=True, slots=True)
class Assembled:
    """An incremental save's files (its own, then the earlier checkpoints' it reads, in order of
    first use), the plan of the shards in them (a file's path there: unique among the files), and
    the patches of each tensor, in order."""

    files: list[FileEntry]
    plan: SavePlan
    patches: dict[str, list[Patch]]


def assemble(
    plan: SavePlan, own: Sequence[Sequence[FileEntry | None]], outcomes: Sequence[Sequence[Outcome]],
    held: Sequence[Sequence[Sequence[Held | None]]],
) -> Assembled:
    """Put together what the ranks did (`own`: the entry of each planned file a rank wrote, None
    when it wrote none; `outcomes`: what it did with each) with what the earlier checkpoint holds."""
    files: list[FileEntry] = []
    index: dict[tuple[str | None, str], int] = {}
    plans: list[tuple[str, list[tuple[ItemDesc, str]]]] = []
    patches: dict[str, list[Patch]] = {}

    def add(entry: FileEntry, path: str) -> int:
        slot = (entry.base, entry.path)
        if slot not in index:
            index[slot] = len(files)
            files.append(entry)
            plans.append((path, []))
        return index[slot]

    for rank, rank_files in enumerate(plan.files):
        for n, f in enumerate(rank_files):
            entry = own[rank][n]
            if entry is not None:
                add(entry, f.path)
    for rank, rank_files in enumerate(plan.files):
        for n, f in enumerate(rank_files):
            outcome, found, entry = outcomes[rank][n], held[rank][n], own[rank][n]
            mine = index[(None, entry.path)] if entry is not None else -1
            for i in outcome.written:
                plans[mine][1].append(f.items[i])
            new = {p[0]: p for p in outcome.patched}
            for i in sorted((*outcome.unchanged, *new)):
                h = found[i]
                assert h is not None  # a rank reuses or patches an item only against a held digest
                item = f.items[i][0]
                plans[add(h.file, h.file.where())][1].append((item, h.key))
                carried = [p.model_copy(update={"file": add(pf, pf.where())}) for pf, p in h.patches]
                if i in new:
                    _, count, digest, keys, values = new[i]
                    carried.append(Patch(offsets=item.box.offsets, lengths=item.box.lengths, file=mine, indices=keys,
                                         values=values, count=count, digest=digest))
                patches.setdefault(item.fqn, []).extend(carried)
    return Assembled(files, SavePlan((tuple(FilePlan(path, tuple(items)) for path, items in plans),), plan.tensors), patches)


__all__ = ["DIGEST", "PATCHED_ITEMSIZE", "Ask", "Assembled", "Held", "Outcome", "ask_of", "asks_for", "assemble",
           "held_boxes", "written_part"]
