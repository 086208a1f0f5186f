"""Restoring from tiers, planned: which step to restore, and where each rank reads each file from.

A memory tier keeps snapshots in each node's own folder of node-local shared memory: the files
its ranks wrote, and replicas of other nodes' ranks' files. After a restart every rank says what
its node holds (`Held`); `choose` takes the newest step whose every file has a copy not known to
be bad in some node or in storage, never a mix of steps; `assign` then gives each rank, for each
file it reads, the cheapest copy: its own node's, a peer's (sent over the process group), or
storage's. Pure: no storage, no collectives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MEMORY = "memory"
PEER = "peer"
STORAGE = "storage"


@dataclass(frozen=True, slots=True)
class Held:
    """A committed snapshot in one node's folder: its checkpoint id, step and name, every file its
    manifest lists (path and size), and the paths the folder holds at the listed size."""

    checkpoint_id: str
    step: int
    name: str
    files: tuple[tuple[str, int], ...]
    present: frozenset[str]


@dataclass(frozen=True, slots=True)
class Stored:
    """A committed checkpoint in storage: its name, step and checkpoint id (the id says whether it
    is a flushed memory snapshot, whose files can stand in for missing copies one by one)."""

    name: str
    step: int
    checkpoint_id: str


@dataclass(frozen=True, slots=True)
class Choice:
    """The step to restore: its checkpoint id and name; `holders`, for each file, the ranks whose
    node holds a usable copy; `stored`, the storage checkpoint with the same id (a flushed copy,
    or the one chosen when no node holds the step), else None."""

    checkpoint_id: str
    step: int
    name: str
    files: tuple[tuple[str, int], ...]
    holders: Mapping[str, tuple[int, ...]]
    stored: Stored | None
    skipped: tuple[str, ...] = ()

    @property
    def from_storage(self) -> bool:
        """Whether no node holds the step: it is read from storage alone."""
        return not any(self.holders.values())


@dataclass(frozen=True, slots=True)
class Route:
    """Where one rank reads one file: its node's copy (``memory``), a peer rank's (``peer``, sent
    to this rank's node first) or storage's."""

    tier: str
    rank: int | None = None

    def describe(self) -> str:
        return f"{PEER} {self.rank}" if self.tier == PEER else self.tier


@dataclass(frozen=True, slots=True)
class Assignment:
    """Each rank's route for each file it reads, and the transfers that bring peers' copies:
    (sender rank, receiver rank, path), in the order every rank posts them."""

    routes: tuple[dict[str, Route], ...]
    transfers: tuple[tuple[int, int, str], ...] = field(default=())


def choose(
    held: Sequence[Sequence[Held]], stored: Sequence[Stored], bad: frozenset[tuple[int, str, str]] = frozenset(),
    bad_stored: frozenset[str] = frozenset(),
) -> Choice | None:
    """The newest step that can be restored whole, or None.

    `held[r]` is what rank r's node holds; `bad` the copies found bad so far as (rank, checkpoint
    id, path) (a bad copy is bad for every rank of its node: they hold the same folder, so callers
    list it under each); `bad_stored` the names of storage checkpoints found bad. A node's snapshot
    counts only when every rank's manifest of that id agrees on its files. At equal steps memory
    wins; a step in storage with another id is a separate checkpoint, chosen whole or not at all.
    """
    snapshots: dict[str, Held] = {}
    holders: dict[str, dict[str, list[int]]] = {}
    for rank, snaps in enumerate(held):
        for snap in snaps:
            first = snapshots.setdefault(snap.checkpoint_id, snap)
            if first.files != snap.files or first.step != snap.step:
                continue  # not the same checkpoint after all: ignore this copy
            by_path = holders.setdefault(snap.checkpoint_id, {})
            for path in snap.present:
                if (rank, snap.checkpoint_id, path) not in bad:
                    by_path.setdefault(path, []).append(rank)
    by_id = {s.checkpoint_id: s for s in stored if s.name not in bad_stored}
    skipped: list[str] = []
    candidates = sorted(
        [(s.step, 1, s.checkpoint_id) for s in snapshots.values()] + [(s.step, 0, s.checkpoint_id) for s in by_id.values()],
        reverse=True,
    )
    for step, in_memory, checkpoint_id in candidates:
        if not in_memory:
            s = by_id[checkpoint_id]
            if checkpoint_id in snapshots:
                continue  # its memory copies came first, completed from it where they lack files
            return Choice(checkpoint_id, step, s.name, (), {}, s, tuple(skipped))
        snap = snapshots[checkpoint_id]
        have = holders.get(checkpoint_id, {})
        backing = by_id.get(checkpoint_id)
        missing = [path for path, _ in snap.files if not have.get(path) and backing is None]
        if missing:
            skipped.append(f"step {step} ({snap.name}): no good copy of {len(missing)} file(s), e.g. {missing[0]}")
            continue
        return Choice(
            checkpoint_id, step, snap.name, snap.files, {p: tuple(have.get(p, ())) for p, _ in snap.files}, backing,
            tuple(skipped),
        )
    return None


def assign(choice: Choice, needs: Sequence[Sequence[str]], nodes: Sequence[str]) -> Assignment:
    """Route each rank's needed files (`needs[r]`, paths) given the node of each rank (`nodes[r]`).

    A file the rank's node holds is read there. Otherwise, when a peer node holds it, one
    rank of that node sends it to the lowest rank of this node that needs it (once per node: the
    others of the node read the received copy), the senders chosen so that each sends about the
    same bytes; else it is read from storage.
    """
    if choice.from_storage:
        return Assignment(tuple({p: Route(STORAGE) for p in need} for need in needs))
    size = dict(choice.files)
    node_has: dict[str, set[str]] = {node: set() for node in nodes}
    for path, ranks in choice.holders.items():
        for r in ranks:
            node_has[nodes[r]].add(path)
    sent = [0] * len(nodes)
    incoming: dict[tuple[str, str], tuple[int, int]] = {}  # (node, path) -> (sender, receiver)
    routes: list[dict[str, Route]] = []
    for rank, need in enumerate(needs):
        mine: dict[str, Route] = {}
        for path in need:
            if path in node_has[nodes[rank]]:
                mine[path] = Route(MEMORY)
            elif (nodes[rank], path) in incoming:
                mine[path] = Route(PEER, incoming[nodes[rank], path][0])
            elif choice.holders.get(path):
                sender = min(choice.holders[path], key=lambda r: (sent[r], r))
                sent[sender] += size.get(path, 0)
                incoming[nodes[rank], path] = (sender, rank)
                mine[path] = Route(PEER, sender)
            else:
                mine[path] = Route(STORAGE)
        routes.append(mine)
    transfers = tuple((s, r, path) for (_, path), (s, r) in incoming.items())
    return Assignment(tuple(routes), transfers)


def peers(nodes: Sequence[str], rank: int, replicas: int) -> list[int]:
    """The ranks that hold replicas of `rank`'s files: the ranks of the same local index on the
    next `replicas` nodes (in name order, wrapping; fewer when there are fewer other nodes)."""
    order = sorted(set(nodes))
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    mine = order.index(nodes[rank])
    local = members[nodes[rank]].index(rank)
    out = []
    for k in range(1, min(replicas, len(order) - 1) + 1):
        ranks = members[order[(mine + k) % len(order)]]
        out.append(ranks[local % len(ranks)])
    return out


def leaders(nodes: Sequence[str]) -> dict[str, int]:
    """The lowest rank of each node (it keeps the node's folder: retention)."""
    out: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        out.setdefault(node, rank)
    return out


__all__ = ["Assignment", "Choice", "Held", "Route", "Stored", "assign", "choose", "leaders", "peers"]
