"""Plan a collective save (pure): check what the ranks hold, pick who writes what, name the files.

Call order: every rank describes its local boxes (`ItemDesc`); rank 0 calls `plan_save` on all
descriptions; each rank writes the files of its `RankPlan`; rank 0 builds the manifest.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ..boxes import Box, tiling_problems
from ..manifest.dtypes import itemsize
from ..errors import LayoutError, summarize
from ..layouts import rank_boxes
from ..layouts.saved import Saved
from ..manifest import TensorEntry
from ..manifest.derived import table_path
from ..manifest.model import Shard
from ..manifest.shards import compact_shards, grid_cuts_of


@dataclass(frozen=True, slots=True)
class ItemDesc:
    """One box a rank holds: tensor name, dtype, global shape, and the box."""

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    box: Box
    nbytes: int = field(init=False, compare=False, repr=False)  # bytes of the box, computed once

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.box.lengths) * itemsize(self.dtype))


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One payload file: its path in the checkpoint and the (item, key) pairs it holds, in order."""

    path: str
    items: tuple[tuple[ItemDesc, str], ...]


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Who writes which file; ``files[r]`` are the files of rank r.

    ``tensors`` maps every saved tensor to (dtype, global shape), also those with no bytes.
    """

    files: tuple[tuple[FilePlan, ...], ...]
    tensors: dict[str, tuple[str, tuple[int, ...]]]

    def all_files(self) -> list[FilePlan]:
        return [f for rank_files in self.files for f in rank_files]


# A rank's payload is split into several files (written in parallel) only past this size.
MIN_SPLIT_BYTES = 64 << 20


def plan_save(
    ranks: Sequence[Sequence[ItemDesc]], *, max_file_bytes: int | None = None, files_per_rank: int = 1
) -> SavePlan:
    """Check the boxes every rank holds and assign each distinct box to one writer.

    Identical boxes held by several ranks (replicas) are written once, by the holder with
    the least bytes assigned so far (largest boxes first), so ranks write about the same.
    Each rank's items go to up to `files_per_rank` files of about equal size (when it has at
    least MIN_SPLIT_BYTES per file), each cut again at `max_file_bytes`.

    Raises:
        LayoutError: a tensor's dtype or shape differs between ranks, or its distinct boxes
            overlap or leave gaps; every problem is listed.
    """
    holders, meta, problems = collect_holders(ranks)
    for fqn, boxes in holders.items():
        if grid_cuts_of(meta[fqn].shape, list(boxes)) is not None:
            continue  # the cells of a grid tile their tensor by construction
        for problem in tiling_problems(meta[fqn].shape, list(boxes)):
            problems.append(f"{fqn}: {problem}")
    if problems:
        raise LayoutError(f"cannot save: {len(problems)} problem(s): " + summarize(problems))
    return plan_files(holders, meta, len(ranks), max_file_bytes=max_file_bytes, files_per_rank=files_per_rank)


Holders = dict[str, dict[Box, list[int]]]


def collect_holders(ranks: Sequence[Sequence[ItemDesc]]) -> tuple[Holders, dict[str, ItemDesc], list[str]]:
    """Return every tensor's distinct non-empty boxes with the ranks holding each, one description
    per tensor, and the tensors whose dtype or shape differs between ranks."""
    holders: Holders = defaultdict(dict)
    meta: dict[str, ItemDesc] = {}
    problems: list[str] = []
    for rank, items in enumerate(ranks):
        for item in items:
            first = meta.setdefault(item.fqn, item)
            if (first.dtype, first.shape) != (item.dtype, item.shape):
                problems.append(
                    f"{item.fqn}: rank {rank} has {item.dtype}{list(item.shape)}, another rank "
                    f"{first.dtype}{list(first.shape)}"
                )
                continue
            boxes = holders[item.fqn]
            if not item.box.volume and item.box.ndim:
                continue  # an empty box holds no bytes: nothing to write
            owners = boxes.setdefault(item.box, [])
            if rank not in owners:
                owners.append(rank)
    return holders, meta, problems


def plan_files(
    holders: Holders, meta: dict[str, ItemDesc], world: int, *, max_file_bytes: int | None = None, files_per_rank: int = 1
) -> SavePlan:
    """Assign each distinct box (already checked to tile its tensor) to one of its holders and
    group every rank's boxes into files; ``meta`` gives each tensor's dtype and shape."""
    assigned = _assign(holders, meta, world)
    files = tuple(_files(rank, items, max_file_bytes, files_per_rank) for rank, items in enumerate(assigned))
    return SavePlan(files, {fqn: (d.dtype, d.shape) for fqn, d in sorted(meta.items())})


def _assign(holders: dict[str, dict[Box, list[int]]], meta: dict[str, ItemDesc], world: int) -> list[list[ItemDesc]]:
    load = [0] * world
    out: list[list[ItemDesc]] = [[] for _ in range(world)]
    shared = []
    for fqn, boxes in holders.items():
        dtype, shape = meta[fqn].dtype, meta[fqn].shape
        for box, owners in boxes.items():
            item = ItemDesc(fqn, dtype, shape, box)
            if len(owners) == 1:
                out[owners[0]].append(item)
                load[owners[0]] += item.nbytes
            else:
                shared.append((item, owners))
    shared.sort(key=lambda p: (-p[0].nbytes, p[0].fqn, p[0].box.offsets))
    for item, owners in shared:
        writer = min(owners, key=lambda r: (load[r], r))
        out[writer].append(item)
        load[writer] += item.nbytes
    for items in out:
        items.sort(key=lambda i: (i.fqn, i.box.offsets))
    return out


def _files(rank: int, items: list[ItemDesc], max_file_bytes: int | None, files_per_rank: int) -> tuple[FilePlan, ...]:
    total = sum(i.nbytes for i in items)
    parts = max(1, min(files_per_rank, total // MIN_SPLIT_BYTES))
    groups: list[list[ItemDesc]] = [[]]
    size = done = 0
    for item in items:
        over_max = max_file_bytes and size + item.nbytes > max_file_bytes
        next_part = done >= total * len(groups) / parts and len(groups) < parts
        if groups[-1] and (over_max or next_part):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
        done += item.nbytes
    if not groups[-1]:
        return ()
    plans = []
    for n, group in enumerate(groups):
        path = file_name(rank, None if len(groups) == 1 else n)
        # Largest element size first keeps every tensor aligned to its element size in the file.
        sizes = {i.dtype for i in group}
        ordered = sorted(group, key=lambda i: -itemsize(i.dtype)) if len(sizes) > 1 else group
        seen: dict[str, int] = defaultdict(int)
        keyed = []
        for item in ordered:
            k = seen[item.fqn]
            seen[item.fqn] += 1
            keyed.append((item, item.fqn if k == 0 else f"{item.fqn}#{k}"))
        plans.append(FilePlan(path, tuple(keyed)))
    return tuple(plans)


def tensor_entries(plan: SavePlan, index: dict[str, int], kind: Callable[[str], str]) -> dict[str, TensorEntry]:
    """Return the manifest entry of every planned tensor; `index` maps file paths to file indices."""
    shards: dict[str, list[Shard]] = defaultdict(list)
    for f in plan.all_files():
        for item, key in f.items:
            shards[item.fqn].append(Shard(item.box, index[f.path], key))
    return {
        fqn: TensorEntry(
            shape=shape,
            dtype=dtype,
            kind=kind(fqn),  # type: ignore[arg-type]
            shards=compact_shards(shape, shards[fqn]),
        )
        for fqn, (dtype, shape) in plan.tensors.items()
    }


_FILE_NAME = re.compile(r"(?:^|/)rank(?P<rank>\d{5,})(?:-\d{3})?\.safetensors$")


def file_name(rank: int, part: int | None) -> str:
    """The name of rank `rank`'s payload file (its `part`-th, when a rank writes several)."""
    return table_path(rank) if part is None else f"rank{rank:05d}-{part:03d}.safetensors"


def file_writer(path: str) -> int | None:
    """The rank that wrote a saved checkpoint's file at manifest path `path` (None: not a
    rank's payload file, such as a tokenizer file, which rank 0 writes at the commit)."""
    found = _FILE_NAME.search(path)
    return int(found["rank"]) if found else None


# -- saves whose layout tensors are derived (manifest 1.6) ------------------------------------


@dataclass(frozen=True, slots=True)
class LayoutShare:
    """What one rank tells rank 0 of its layout tensors instead of listing their boxes: per state
    group (label) the dtypes it holds them in, and whether it holds exactly the boxes the layout
    gives it (a group it holds nothing of counts as held exactly only if the layout gives it nothing)."""

    dtypes: dict[str, tuple[str, ...]]
    exact: dict[str, bool]


def layout_share(saved: Saved, rank: int, items: Sequence[ItemDesc]) -> tuple[LayoutShare, list[ItemDesc]]:
    """Split a rank's items into its layout tensors, summarized, and the others (listed as
    before). Costs time in proportion to what the rank holds."""
    layout, topology = saved.layout, saved.topology
    held = rank_boxes(layout, topology, rank)
    mine: dict[str, set[tuple[str, Box]]] = {g.label: set() for g in saved.groups}
    dtypes: dict[str, set[str]] = {g.label: set() for g in saved.groups}
    exact = {g.label: True for g in saved.groups}
    others = []
    for item in items:
        found = saved.find(item.fqn)
        if found is None:
            others.append(item)
            continue
        group, _, shape = found
        dtypes[group.label].add(item.dtype)
        if item.shape != shape:
            exact[group.label] = False
        if item.box.volume or not item.box.ndim:
            mine[group.label].add((item.fqn, item.box))
    for group in saved.groups:
        want = {(group.fqn(name), b) for name, boxes in held[group.label].items() for b in boxes if b.volume or not b.ndim}
        exact[group.label] = exact[group.label] and mine[group.label] == want
    return LayoutShare({k: tuple(sorted(v)) for k, v in dtypes.items()}, exact), others


def derived_groups(shares: Sequence[LayoutShare]) -> dict[str, str] | None:
    """The dtype of every state group the ranks hold (a group none holds is left out: a checkpoint
    without optimizer state), when each rank holds exactly its boxes of each, in one dtype shared
    by all; None when the save must list its boxes instead."""
    present = [label for label in shares[0].dtypes if any(s.dtypes[label] for s in shares)]
    if not present:
        return None
    out = {}
    for label in present:
        kinds = {d for s in shares for d in s.dtypes[label]}
        if len(kinds) != 1 or not all(s.exact[label] for s in shares):
            return None
        out[label] = kinds.pop()
    return out


def derived_file(saved: Saved, rank: int, meta: Mapping[str, ItemDesc], listed: Sequence[FilePlan]) -> FilePlan:
    """Rank `rank`'s one file of a derived save: the boxes the rule has it write (under the rule's
    keys; `meta` gives each tensor's dtype and shape) and its share of the listed tensors,
    largest element size first."""
    items = [(ItemDesc(w.fqn, meta[w.fqn].dtype, meta[w.fqn].shape, w.box), w.key) for w in saved.writes(rank)]
    items += [pair for f in listed for pair in f.items]
    if len({i.dtype for i, _ in items}) > 1:
        items.sort(key=lambda pair: -itemsize(pair[0].dtype))
    return FilePlan(file_name(rank, None), tuple(items))
