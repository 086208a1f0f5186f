"""The memory tier: snapshots in node-local shared memory, replicated to peers, restored from
the cheapest good copy, flushed to storage on failure.

Each node has a folder of its own under the tier's root (``/dev/shm/...``: it outlives the
training processes, not the machine). A memory snapshot is an ordinary ckptkit checkpoint
written there (its files in place under ``NAME/<id>/``, its manifest last), holding the files
of the node's own ranks and, once replicated, the files of the ranks of ``replicas`` other
nodes; every node's folder holds the same manifest. `verify`, `inspect` and `load` read a
node's folder as any other root (a node's copy lacks the files only other nodes hold).

Restoring (`restore`, collective): the ranks say what their nodes hold, choose the newest step
whose every file has a copy (`plan.tiers.choose`), bring each rank's node the files it reads
from a peer (checked against the manifest before they are written), then load through a view
that reads each file from where it was routed; every byte is checked as it is read. A copy
found bad (a peer's sent bytes, or a block read) is left out and the choice is made again,
with the older steps, so nothing is ever restored from a copy that failed its checks and no
restore mixes steps.

Flushing (`flush`, per process, no collective: it runs when peers may be dead): each process
writes the files its node holds of its newest snapshots into storage under a hidden name shared
by every flusher of that snapshot; the one that sees every file there writes the manifest and
renames it into place (on an object store: creates the manifest), a normal committed checkpoint.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..errors import CheckpointExistsError, CheckpointNotFoundError, CkptkitError, IntegrityError, LayoutError, ManifestError, StorageError
from ..io.commit import exists_or_unknown
from ..io.catalog import LATEST_NAME, Location, latest_step, moves_forward, read_manifest, step_of, temp_name, write_latest
from ..io.payload import content_problem
from ..manifest import MANIFEST_NAME, SIDECAR_SUFFIX, Manifest, parse_manifest
from ..ops.collective import Collective, guard, unwrap
from ..plan.save import file_writer
from ..plan.tiers import STORAGE, Assignment, Choice, Held, Route, Stored, assign, choose, leaders, peers
from ..storage import Storage, open_storage
from ..storage.base import Capabilities
from ..storage.local import LocalStorage

log = logging.getLogger(__name__)

NODE_ENV = "CKPTKIT_NODE"
MAX_ATTEMPTS = 16  # restore choices made again after bad copies, before giving up


@dataclass(frozen=True, slots=True)
class MemoryTier:
    """Where and how a `CheckpointManager` keeps snapshots in memory.

    Args:
        root: a folder of node-local shared memory (``/dev/shm/<job>``) holding one folder per
            node; it must be the same path on every node, and survive the training processes.
        node: this process's node (default: ``$CKPTKIT_NODE``, else the host name). Processes
            of one node share its folder; on one machine, give each simulated node its own.
        keep: the snapshots each node keeps (the newest; older ones are deleted once a newer
            one is replicated).
        replicas: how many other nodes hold a copy of each rank's files.
    """

    root: str
    node: str | None = None
    keep: int = 2
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise LayoutError(f"a memory tier keeps at least 1 snapshot, got keep={self.keep}")
        if self.replicas < 0:
            raise LayoutError(f"replicas must be 0 or more, got {self.replicas}")

    def node_name(self) -> str:
        name = self.node or os.environ.get(NODE_ENV) or socket.gethostname()
        if not name or "/" in name or name.startswith("."):
            raise LayoutError(f"node name {name!r}: a plain folder name is needed")
        return name

    def storage(self) -> Storage:
        """This node's folder, written in place (files under ``NAME/<id>/``, the manifest last)."""
        return NodeStorage(os.path.join(self.root, self.node_name()))


class NodeStorage(LocalStorage):
    """A node's folder of the memory tier: local files, written in place rather than renamed,
    so that every node commits the same manifest over the files it holds."""

    def __repr__(self) -> str:
        return f"NodeStorage({self.root!r})"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(rename=False, local_files=True)

    def mapped(self, key: str, size: int) -> Any:
        """The `size` bytes of file `key`, mapped read-only (a numpy array: no copy to send).

        Raises:
            StorageError: it cannot be mapped (missing, shorter than `size`).
        """
        import numpy as np

        try:
            return np.memmap(self.path(key), dtype=np.uint8, mode="r", shape=(size,))
        except (OSError, ValueError) as exc:
            raise StorageError(f"{self.path(key)}: cannot map {size} bytes ({exc})") from exc

    def receiving(self, key: str, size: int) -> tuple[Any, Callable[[bool], None]]:
        """A writable mapping of a new hidden file of `size` bytes to receive file `key` into,
        and the function that ends it: renamed to `key` (True) or removed (False). The file
        appears whole or not at all.

        Raises:
            StorageError: it cannot be created.
        """
        import numpy as np

        final = self.path(key)
        tmp = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            if size:
                mapping = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=(size,))
            else:  # nothing to map: an empty file
                open(tmp, "wb").close()
                mapping = None
        except (OSError, ValueError) as exc:
            raise StorageError(f"{final}: cannot receive {size} bytes ({exc})") from exc
        array = mapping if mapping is not None else np.empty(0, dtype=np.uint8)

        def end(keep: bool) -> None:
            try:
                if keep:
                    if mapping is not None:
                        mapping.flush()
                    os.replace(tmp, final)
                else:
                    os.unlink(tmp)
            except OSError as exc:
                raise StorageError(f"{final}: cannot keep the received copy ({exc})") from exc

        return array, end


# --- what a node holds -----------------------------------------------------------------------


def snapshots(storage: Storage, unreadable: list[str] | None = None) -> list[tuple[Held, Manifest]]:
    """The committed snapshots of a node's folder (newest first), each with the paths held at
    their listed sizes; a manifest that does not parse is not a snapshot (its name is added to
    `unreadable`).

    Raises:
        StorageError: the folder cannot be listed.
    """
    out = []
    for child in _children(storage):
        if not storage.exists(f"{child}/{MANIFEST_NAME}"):
            continue  # being written, or cut off before its manifest
        try:
            manifest = read_manifest(Location(storage, child))
        except (CkptkitError, OSError):
            if unreadable is not None:
                unreadable.append(f"{storage.root}/{child}")
            continue
        files = tuple((f.path, f.size) for f in manifest.files if f.base is None)
        present = frozenset(path for path, size in files if _size(storage, f"{child}/{path}") == size)
        out.append((Held(manifest.checkpoint_id, manifest.step, child, files, present), manifest))
    return sorted(out, key=lambda hm: -hm[0].step)


def stored(storage: Storage, steps: set[int], name_format: str = "step_{step:08d}", bad: frozenset[str] = frozenset(),
           unreadable: list[str] | None = None) -> list[Stored]:
    """The committed checkpoints of a storage root named by `name_format` that a restore may take:
    the newest one not in `bad` (names), and those at `steps` (the steps memory holds).

    Raises:
        StorageError: the root cannot be listed.
    """
    found = []
    for child in _children(storage):
        step = step_of(storage, child)
        if step is not None and child == name_format.format(step=step) and child not in bad:
            found.append((step, child))
        elif step is None and storage.exists(f"{child}/{MANIFEST_NAME}") and unreadable is not None:
            unreadable.append(f"{storage.root}/{child}")
    found.sort(reverse=True)
    out: list[Stored] = []
    newest_taken = False
    for step, name in found:
        if newest_taken and step not in steps:
            continue
        try:
            out.append(Stored(name, step, read_manifest(Location(storage, name)).checkpoint_id))
            newest_taken = True
        except (CkptkitError, OSError):
            if unreadable is not None:
                unreadable.append(f"{storage.root}/{name}")
    return out


def _children(storage: Storage) -> list[str]:
    names = storage.list("", recursive=False)
    return [n.rstrip("/") for n in names if n.endswith("/") and not n.startswith(".") and n.rstrip("/") != LATEST_NAME]


def _size(storage: Storage, key: str) -> int | None:
    try:
        return storage.size(key)
    except (StorageError, OSError):
        return None


# --- after a snapshot: every node's manifest, replicas, retention ----------------------------


def clear_name(coll: Collective, storage: Storage, nodes: Sequence[str], name: str) -> None:
    """Before snapshot `name` is written: each node's folder drops what it holds under that name
    (a snapshot of an abandoned attempt at the same step), then every rank waits for all nodes."""
    if leaders(nodes)[nodes[coll.rank]] == coll.rank:
        try:
            if storage.exists(name):
                storage.delete(name)
        except StorageError:
            pass  # the save refuses the name then, on every rank
    coll.all_gather(None)


def finish_snapshot(coll: Collective, storage: Storage, nodes: Sequence[str], tier: MemoryTier, manifest: Manifest) -> list[str]:
    """After rank 0 committed snapshot `manifest` in its node's folder: commit it in every node's
    folder, send each rank's files to its peers (collective), then, when every replica was
    written, keep the newest snapshots. Returns what went wrong with the copies on other nodes
    (warnings: the snapshot is committed all the same). Every rank makes the same collective
    calls whatever fails locally.

    Raises:
        CkptkitError: rank 0 cannot read back the manifest it committed (on every rank).
    """
    shared: tuple[str, Any] = ("ok", None)
    if coll.rank == 0:
        shared = guard(lambda: (lambda n: (n, storage.read(f"{n}/{MANIFEST_NAME}")))(_name_of(storage, manifest)))
    name, raw = unwrap(coll.broadcast(shared))
    problems = []
    try:
        _commit_copy(storage, name, raw)
    except (CkptkitError, OSError) as exc:
        problems.append(f"node {nodes[coll.rank]}: the manifest was not written ({exc})")
    problems += [f"rank {coll.rank}: {what}" for _, _, _, what in replicate(coll, storage, nodes, tier.replicas, name, manifest)]
    problems = [p for ps in coll.all_gather(problems) for p in ps]  # also: every replica is written
    if not problems and leaders(nodes)[nodes[coll.rank]] == coll.rank:
        retain(storage, tier.keep)  # never drop the last replicated step for one that is not
    return problems


def _name_of(storage: Storage, manifest: Manifest) -> str:
    for held, m in snapshots(storage):
        if m.checkpoint_id == manifest.checkpoint_id:
            return held.name
    raise CheckpointNotFoundError(f"{storage.root}: the snapshot of step {manifest.step} is not committed there")


def _commit_copy(storage: Storage, name: str, raw: bytes) -> None:
    """Write the manifest `raw` of snapshot `name` in this node's folder: unless it is there, and
    in place of another one (a stale snapshot of the same name)."""
    key = f"{name}/{MANIFEST_NAME}"
    try:
        storage.create(key, raw)
    except CheckpointExistsError:
        if storage.read(key) != raw:
            storage.delete(key)
            storage.create(key, raw)


def replicate(
    coll: Collective, storage: Storage, nodes: Sequence[str], replicas: int, name: str, manifest: Manifest
) -> list[tuple[str, int, str, str]]:
    """Send every rank's files of snapshot `name` to its peers, who check them and write them
    into their nodes' folders. Returns this rank's problems (see `_exchange`)."""
    import torch

    entries = {f.path: f for f in manifest.files if f.base is None}
    transfers = [
        (src, dst, path)
        for src in range(len(nodes))
        for dst in peers(nodes, src, replicas)
        for path in sorted(entries)
        if (file_writer(path) or 0) == src
    ]
    return _exchange(coll, storage, name, entries, transfers, torch)


BAD, LOCAL = "bad", "local"


def _exchange(
    coll: Collective, storage: Storage, name: str, entries: Mapping[str, Any], transfers: Sequence[tuple[int, int, str]], torch: Any,
) -> list[tuple[str, int, str, str]]:
    """Post every transfer (sender, receiver, path) of this rank; write each received file after
    checking it against its manifest entry. Never raises for a file: returns problems as (kind,
    sender, path, what), kind ``bad`` (the sender's copy failed its checks on arrival) or
    ``local`` (this rank could not read or write a copy). A sender that cannot read its copy
    sends zeros, which fail their checks: no rank is left waiting."""
    sends, receives = [], []
    outgoing: dict[str, Any] = {}
    problems: list[tuple[str, int, str, str]] = []
    for src, dst, path in transfers:
        if src == coll.rank:
            if path not in outgoing:
                outgoing[path] = _outgoing(storage, f"{name}/{path}", entries[path].size, torch, problems, src, path)
            sends.append((dst, outgoing[path]))
        if dst == coll.rank:
            receives.append((src, path, *_incoming(storage, f"{name}/{path}", entries[path].size, torch)))
    coll.exchange(sends, [(src, buf) for src, _, buf, _, _ in receives])
    for src, path, buf, array, end in receives:
        problem = content_problem(entries[path], memoryview(array))
        if problem:
            problems.append((BAD, src, path, f"the copy of {path} rank {src} sent failed its checks: {problem}"))
        try:
            end(not problem)
        except (CkptkitError, OSError) as exc:
            problems.append((LOCAL, src, path, f"cannot write the copy of {path}: {exc}"))
    return problems


def _outgoing(storage: Storage, key: str, size: int, torch: Any, problems: list[tuple[str, int, str, str]], src: int, path: str) -> Any:
    """The bytes of file `key` to send: mapped from a node's folder (no copy), else read; zeros
    (which fail their checks on arrival) when they cannot be had, with a problem noted."""
    import warnings

    try:
        if isinstance(storage, NodeStorage):
            with warnings.catch_warnings():  # a read-only mapping: gloo only reads what it sends
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(storage.mapped(key, size))
        buf = torch.empty(size, dtype=torch.uint8)
        storage.readinto(key, 0, memoryview(buf.numpy()))
        return buf
    except (CkptkitError, OSError) as exc:
        problems.append((LOCAL, src, path, f"cannot read {path} to send it: {exc}"))
        return torch.zeros(size, dtype=torch.uint8)


def _incoming(storage: Storage, key: str, size: int, torch: Any) -> tuple[Any, Any, Callable[[bool], None]]:
    """Where to receive file `key`: straight into a new file of a node's folder (kept, renamed
    into place, only if it passes its checks), else a buffer written once it passes."""
    if isinstance(storage, NodeStorage):
        try:
            array, end = storage.receiving(key, size)
            return torch.from_numpy(array), array, end
        except StorageError:
            pass  # received into memory; writing it fails the same way, and says so
    buf = torch.empty(size, dtype=torch.uint8)

    def write(keep: bool) -> None:
        if keep:
            storage.write(key, [memoryview(buf.numpy())])

    return buf, buf.numpy(), write


def retain(storage: Storage, keep: int) -> list[str]:
    """Delete a node's snapshots but the newest `keep`, and anything uncommitted older than the
    newest committed one (an interrupted snapshot). Returns the names deleted."""
    held = snapshots(storage)
    if not held:
        return []
    kept = {h.name for h, _ in held[:keep]}
    newest = held[0][0].step
    committed = {h.name for h, _ in held}
    doomed = [
        child for child in _children(storage)
        if child not in kept and (child in committed or (_step_in_name(child) or newest) < newest)
    ]
    return _delete(storage, doomed)


def drop_newer(storage: Storage, step: int) -> list[str]:
    """Delete a node's snapshots (committed or not) of steps after `step`; return their names."""
    steps = {h.name: h.step for h, _ in snapshots(storage)}
    return _delete(storage, [c for c in _children(storage) if steps.get(c, _step_in_name(c) or 0) > step])


def _delete(storage: Storage, names: list[str]) -> list[str]:
    for name in names:
        try:
            storage.delete(name)
        except StorageError:
            pass
    return names


def _step_in_name(name: str) -> int | None:
    """The step of a snapshot folder without a manifest, from the digits of its name."""
    digits = "".join(c if c.isdigit() else " " for c in name).split()
    return int(digits[-1]) if digits else None


# --- restore ---------------------------------------------------------------------------------


@dataclass
class RestoreReport:
    """What a restore read: the step and checkpoint id, this rank's files by where it read each
    (``memory``, ``peer <rank>``, ``storage``), and what it skipped on the way (steps without a
    whole good copy, copies that failed their checks); `manifest`, the restored step's."""

    step: int
    checkpoint_id: str
    name: str
    files: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    manifest: Manifest | None = field(default=None, repr=False)

    def tiers(self) -> dict[str, int]:
        """How many of this rank's files came from each tier."""
        out: dict[str, int] = {}
        for where in self.files.values():
            tier = where.split()[0]
            out[tier] = out.get(tier, 0) + 1
        return out


def restore(
    coll: Collective, node_storage: Storage, nodes: Sequence[str], root: Storage,
    target: Mapping[str, Any] | Callable[[Manifest], Mapping[str, Any]] | None, *, name_format: str = "step_{step:08d}",
) -> tuple[dict[str, Any], RestoreReport]:
    """Restore the newest step every file of which has a good copy in some node or in storage
    (checkpoints named by `name_format`), into `target` (or whole; or what `target` makes of the
    chosen step's manifest, made again if another step is chosen); collective over `coll`,
    whose ranks' nodes are `nodes`. Every rank makes the same collective calls, whatever fails
    on one of them: a failure that is not a bad copy is raised on every rank.

    Raises:
        CheckpointNotFoundError: no tier holds any snapshot or checkpoint (a new run).
        IntegrityError: some are held, but no step has a good copy of every file (each skipped
            step, bad copy and unreadable manifest is named); `target` may have been written.
        CkptkitError: a rank could not read its node's folder or storage, or write a copy.
    """
    import torch

    bad: set[tuple[int, str, str]] = set()
    bad_stored: set[str] = set()
    skipped: list[str] = []
    for _ in range(MAX_ATTEMPTS):
        unreadable: list[str] = []
        mine = _agree(coll, guard(lambda: snapshots(node_storage, unreadable)))
        gathered = coll.all_gather(([h for h, _ in mine], unreadable))
        held = [hs for hs, _ in gathered]
        unreadable = sorted({u for _, us in gathered for u in us})
        steps = {h.step for hs in held for h in hs}
        outcome = guard(lambda: stored(root, steps, name_format, frozenset(bad_stored), unreadable)) if coll.rank == 0 else None
        found, unreadable = _stored_on_all(coll, outcome, unreadable)
        choice = choose(held, found, frozenset(bad), frozenset(bad_stored))
        if choice is None:
            where = f"in memory ({len(steps)} step(s) held) or in storage {root.root}"
            if not steps and not found and not skipped and not unreadable and not bad_stored:
                raise CheckpointNotFoundError(f"nothing to restore: no snapshot or checkpoint {where}")
            why = skipped + [f"{u}: its manifest cannot be read" for u in unreadable]
            raise IntegrityError(f"nothing to restore whole: no step has a good copy of every file {where}"
                                 + (f"; skipped: {'; '.join(why)}" if why else ""))
        manifest, raw = _chosen_manifest(coll, choice, mine, node_storage, root)
        into, needs = _agree(coll, guard(lambda: _needs(manifest, target)))
        plan_routes = assign(choice, coll.all_gather(needs), list(nodes))
        entries = {f.path: f for f in manifest.files if f.base is None}
        problems = _bring(coll, node_storage, choice.name, entries, plan_routes, raw, torch)
        routes = plan_routes.routes[coll.rank]
        loaded: tuple[str, Any] = ("ok", None)
        if not problems:
            loaded = _load(node_storage, root, choice, manifest, routes, into)
        findings = coll.all_gather((problems, loaded[0] if loaded[0] != "ok" else "ok", loaded[1] if loaded[0] != "ok" else None))
        for rank, (problems_of, status, value) in enumerate(findings):
            local = [what for kind, _, _, what in problems_of if kind == LOCAL]
            if local:
                raise CkptkitError(f"restore of step {choice.step}: rank {rank}: {local[0]}")
            if status == "error":
                unwrap(("error", (value[0], f"restore of step {choice.step}: rank {rank}: {value[1]}")))
        if all(not p and status == "ok" for p, status, _ in findings):
            # The restored step is now the newest: newer snapshots (cut off, or left out as bad)
            # would stand in the way of the snapshots the run is about to take again.
            if leaders(nodes)[nodes[coll.rank]] == coll.rank:
                for dropped in drop_newer(node_storage, choice.step):
                    skipped.append(f"{dropped}: deleted from node {nodes[coll.rank]}, newer than the step restored")
            coll.all_gather(None)  # before any rank snapshots again
            report = RestoreReport(choice.step, choice.checkpoint_id, choice.name,
                                   skipped=skipped + list(choice.skipped) + [f"{u}: its manifest cannot be read" for u in unreadable],
                                   manifest=manifest)
            report.files = {p: r.describe() for p, r in routes.items()}
            return loaded[1], report
        for rank, (problems_of, status, value) in enumerate(findings):
            for _, sender, path, what in problems_of:  # a sender's copy failed its checks on arrival
                _mark(bad, nodes, sender, choice.checkpoint_id, path)
                skipped.append(f"step {choice.step}: node {nodes[sender]}'s copy of {path} failed its checks ({what})")
            if status == "bad":
                for tier, path, what in value:
                    if tier == STORAGE and choice.stored is not None:
                        bad_stored.add(choice.stored.name)
                    else:
                        _mark(bad, nodes, rank, choice.checkpoint_id, path)
                    skipped.append(f"step {choice.step}: the {tier} copy of {path} read by rank {rank} failed its checks ({what})")
    raise IntegrityError(f"nothing restored after {MAX_ATTEMPTS} choices; skipped: {'; '.join(skipped)}")


def _agree(coll: Collective, outcome: tuple[str, Any]) -> Any:
    """This rank's result of a `guard`ed step, once every rank did it; the first failure of any
    rank is raised on every rank (so none is left waiting in the next collective)."""
    for rank, (status, value) in enumerate(coll.all_gather(("ok", None) if outcome[0] == "ok" else outcome)):  # never the result
        if status != "ok":
            name, message = value
            unwrap(("error", (name, f"rank {rank}: {message}")))
    return outcome[1]


def _stored_on_all(coll: Collective, outcome: tuple[str, Any] | None, unreadable: list[str]) -> tuple[list[Stored], list[str]]:
    """Rank 0's view of storage (`stored`, guarded) and the unreadable manifests, on every rank."""
    shared = coll.broadcast((outcome, unreadable) if coll.rank == 0 else None)
    return unwrap(shared[0]), shared[1]


def _needs(manifest: Manifest, target: Mapping[str, Any] | Callable[[Manifest], Mapping[str, Any]] | None) -> tuple[Any, list[str]]:
    """The target to load `manifest` into (made by `target` when it is a function), and the
    files that load reads, as the manifest names them (`FileEntry.where`: an incremental
    checkpoint's earlier files as ``../<base>/<path>``)."""
    from ..plan.load import plan_load
    from ..state.torch_io import is_leaf, leaf_shards
    from ..state.tree import flatten

    into = target(manifest) if callable(target) else target
    if into is None:
        return None, [f.where() for f in manifest.files if f.role == "tensors"]
    leaves, _ = flatten(into, is_leaf)
    requests = [(fqn, p.box) for fqn, leaf in leaves.items() for p in leaf_shards(leaf) if fqn in manifest.tensors]
    plan = plan_load(manifest, requests)
    return into, sorted({manifest.files[r.file].where() for t in plan.targets for r in t.reads})


def _load(node: Storage, root: Storage, choice: Choice, manifest: Manifest, routes: Mapping[str, Route], into: Any) -> tuple[str, Any]:
    """Load this rank's part through a view that reads each file from where it was routed:
    ("ok", state), ("bad", [(tier, path, why)]) for copies that fail their checks, or
    ("error", (type, message)) for a failure no copy explains."""
    from ..ops.load import Checkpoint

    view = Location(RoutedStorage(node, root, choice.name, choice.stored.name if choice.stored else None, routes,
                                  everything_stored=choice.from_storage), choice.name)
    try:
        return "ok", Checkpoint(view, manifest).load(into)
    except (IntegrityError, StorageError) as exc:
        bad = _bad_reads(view, manifest, routes)
        return ("bad", bad) if bad else ("error", (type(exc).__name__, str(exc)))
    except CkptkitError as exc:
        return "error", (type(exc).__name__, str(exc))


def _mark(bad: set[tuple[int, str, str]], nodes: Sequence[str], rank: int, checkpoint_id: str, path: str) -> None:
    for r, node in enumerate(nodes):
        if node == nodes[rank]:
            bad.add((r, checkpoint_id, path))


def _chosen_manifest(
    coll: Collective, choice: Choice, mine: list[tuple[Held, Manifest]], storage: Storage, root: Storage
) -> tuple[Manifest, bytes]:
    """The chosen step's manifest and its bytes on every rank: from the lowest rank whose node
    holds it (parsed and checked again by each rank), or from storage."""
    local = next((m for h, m in mine if h.checkpoint_id == choice.checkpoint_id), None)
    holders = coll.all_gather(local is not None)
    if any(holders):
        src = holders.index(True)
        shared = coll.broadcast(guard(lambda: storage.read(f"{choice.name}/{MANIFEST_NAME}")) if coll.rank == src else None, src=src)
        raw = unwrap(shared)
        return _agree(coll, guard(lambda: local if local is not None else parse_manifest(raw, source=f"{choice.name} of rank {src}"))), raw
    assert choice.stored is not None
    stored_name = choice.stored.name
    return _agree(coll, guard(lambda: read_manifest(Location(root, stored_name)))), b""


def _bring(
    coll: Collective, storage: Storage, name: str, entries: Mapping[str, Any], routes: Assignment, raw: bytes, torch: Any
) -> list[tuple[str, int, str, str]]:
    """Bring the files routed from peers into the receivers' nodes (and the manifest with them)."""
    if not routes.transfers:
        return []
    problems = _exchange(coll, storage, name, entries, routes.transfers, torch)
    if any(dst == coll.rank for _, dst, _ in routes.transfers):
        try:
            _commit_copy(storage, name, raw)
        except (CkptkitError, OSError) as exc:
            problems.append((LOCAL, coll.rank, MANIFEST_NAME, f"cannot write the manifest of {name}: {exc}"))
    coll.all_gather(None)  # every received file is written before any rank of its node reads it
    return problems


def _bad_reads(view: Location, manifest: Manifest, routes: Mapping[str, Route]) -> list[tuple[str, str, str]]:
    """Which of the routed copies fail their checks (after a load failed)."""
    from ..ops.verify import checksum_findings

    index = {f.where(): i for i, f in enumerate(manifest.files)}
    findings, _ = checksum_findings(view, manifest, [index[p] for p in routes if p in index], 2, None)
    return [(routes[f.where].tier, f.where, f.message) for f in findings if f.where in routes]


class RoutedStorage:
    """Read-only: the files of one snapshot, each from where it was routed (this node's folder
    for memory and peer copies, storage's checkpoint for storage ones; everything from storage
    when the step is read from storage alone, the earlier checkpoints an incremental one reads
    included)."""

    def __init__(self, node: Storage, root: Storage, name: str, stored_name: str | None, routes: Mapping[str, Route], *,
                 everything_stored: bool = False) -> None:
        self.node, self.store, self.name, self.stored_name, self.routes = node, root, name, stored_name, routes
        self.everything_stored = everything_stored
        self.root = root.root if everything_stored else node.root  # where messages say the files are

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(rename=False)

    def _where(self, key: str) -> tuple[Storage, str]:
        inside = key.startswith(f"{self.name}/")
        path = key.removeprefix(f"{self.name}/")
        if self.everything_stored or not inside:  # not inside: an earlier checkpoint's file (a base)
            return self.store, f"{self.stored_name}/{path}" if inside and self.stored_name else key
        route = self.routes.get(path, self.routes.get(path.removesuffix(SIDECAR_SUFFIX)))  # a sidecar: as its file
        if route is not None and route.tier == STORAGE and self.stored_name is not None:
            return self.store, f"{self.stored_name}/{path}"
        return self.node, key

    def local_path(self, key: str) -> str:
        raise StorageError("a restore's view has no local paths")

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        s, k = self._where(key)
        return s.read(k, offset, length)

    def readinto(self, key: str, offset: int, buffer: memoryview) -> None:
        s, k = self._where(key)
        s.readinto(k, offset, buffer)

    def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        s, k = self._where(key)
        s.readv(k, offset, buffers)

    def size(self, key: str) -> int:
        s, k = self._where(key)
        return s.size(k)

    def exists(self, key: str) -> bool:
        if key == f"{self.name}/{MANIFEST_NAME}":
            return True  # the manifest in hand was chosen and checked
        s, k = self._where(key)
        return s.exists(k)

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
        return self.node.list(prefix, recursive=recursive)

    def is_prefix(self, key: str) -> bool:
        return self.node.is_prefix(key)

    def write(self, key: str, chunks: Any) -> int:
        raise StorageError("a restore's view is read-only")

    def delete(self, prefix: str) -> None:
        raise StorageError("a restore's view is read-only")

    def rename(self, src: str, dst: str) -> None:
        raise StorageError("a restore's view is read-only")

    def create(self, key: str, data: bytes) -> None:
        raise StorageError("a restore's view is read-only")


# --- flush -----------------------------------------------------------------------------------


class FlushReport(BaseModel):
    """What a flush did (and what ``ckptkit flush --json`` prints): the node folder it read, the
    storage it wrote to, the checkpoint committed there (or already there; None when none was),
    its step, the files this process wrote, and why snapshots were not committed."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    node: str
    root: str
    committed: str | None
    step: int | None
    written: list[str]
    notes: list[str]


def flush(node_storage: Storage, root: Storage, *, deadline_s: float = 60.0, offset: int = 0) -> FlushReport:
    """Write this node's newest snapshots that storage does not hold into storage: each file this
    node holds that passes its checks and is not there yet, under a hidden name shared by every
    flusher of the snapshot, then (once every file is there, whoever sees it first) the
    manifest, and the rename into place: a normal committed checkpoint, and ``latest`` moved to
    it when it is newer. Needs no other process; run it in every surviving process (`offset`,
    such as a local rank, spreads the processes of a node over its files).

    Nothing committed changes when it fails or passes `deadline_s`: what it wrote stays under
    the hidden name (``ckptkit clean`` removes it).
    """
    started = time.monotonic()
    written: list[str] = []
    notes: list[str] = []

    def report(held: Held | None = None) -> FlushReport:
        return FlushReport(node=node_storage.root, root=root.root, committed=held.name if held else None,
                           step=held.step if held else None, written=written, notes=notes)

    for held, manifest in snapshots(node_storage):
        if _committed_in(root, held.name, manifest.checkpoint_id):
            return report(held)
        if exists_or_unknown(root, f"{held.name}/{MANIFEST_NAME}"):  # another checkpoint of that name: never written into
            notes.append(f"{held.name}: storage holds another checkpoint of that name")
            continue
        stage = temp_name(held.name, "f" + manifest.checkpoint_id[:12]) if root.capabilities.rename else held.name
        entries = [f for f in manifest.files if f.base is None]
        order = entries[offset % len(entries):] + entries[: offset % len(entries)] if entries else []
        for entry in order:
            if time.monotonic() - started > deadline_s:
                notes.append(f"deadline of {deadline_s:g} s passed while writing {held.name}")
                return report()
            key = f"{stage}/{entry.path}"
            if entry.path not in held.present or _size(root, key) == entry.size:
                continue
            try:
                data = node_storage.read(f"{held.name}/{entry.path}")
            except StorageError as exc:
                notes.append(f"{held.name}/{entry.path}: cannot read ({exc})")
                continue
            problem = content_problem(entry, memoryview(data))
            if problem:
                notes.append(f"{held.name}/{entry.path}: not written, {problem}")
                continue
            root.write(key, [data])
            written.append(entry.path)
        missing = [f.path for f in entries if _size(root, f"{stage}/{f.path}") != f.size]
        if missing:
            notes.append(f"{held.name}: {len(missing)} file(s) not in storage yet, e.g. {missing[0]}")
            continue
        raw = node_storage.read(f"{held.name}/{MANIFEST_NAME}")
        if _commit_flushed(root, stage, held.name, raw):
            if moves_forward(latest_step(root), held.step):
                write_latest(root, held.name)
        elif not _committed_in(root, held.name, manifest.checkpoint_id):
            notes.append(f"{held.name}: another checkpoint of that name is in storage")
            continue
        return report(held)
    return report()


def flush_node(node: str | os.PathLike[str], root: str, *, deadline_s: float = 60.0, offset: int = 0) -> FlushReport:
    """`flush` of a node's folder of the memory tier (a path) into the storage at `root` (a
    directory or URL), for a launcher or watchdog once the training processes are gone.

    Raises:
        CheckpointNotFoundError: `node` holds no committed snapshot.
        CkptkitError: nothing was committed (why: the report's notes, in the message).
    """
    folder = os.fspath(node)
    node_storage = NodeStorage(folder)
    if not os.path.isdir(folder) or not snapshots(node_storage):
        raise CheckpointNotFoundError(f"{folder}: no memory snapshot here (a node's folder of the memory tier holds step_* snapshots)")
    done = flush(node_storage, open_storage(root), deadline_s=deadline_s, offset=offset)
    if done.committed is None:
        raise CkptkitError(f"{folder}: nothing flushed to {root}: " + "; ".join(done.notes))
    return done


def _committed_in(root: Storage, name: str, checkpoint_id: str) -> bool:
    """Whether storage holds snapshot `checkpoint_id` committed as `name`."""
    try:
        return root.exists(f"{name}/{MANIFEST_NAME}") and read_manifest(Location(root, name)).checkpoint_id == checkpoint_id
    except (CkptkitError, OSError):
        return False


def _commit_flushed(root: Storage, stage: str, name: str, raw: bytes) -> bool:
    """Commit the flushed snapshot under `stage` as `name`; False when another process did first
    (or a checkpoint of that name is there)."""
    if not root.capabilities.rename:
        try:
            root.create(f"{name}/{MANIFEST_NAME}", raw)
        except CheckpointExistsError:
            return False
        return True
    root.write(f"{stage}/{MANIFEST_NAME}", [raw])
    try:
        root.rename(stage, name)
    except StorageError:
        return False
    return True


__all__ = ["FlushReport", "MemoryTier", "NodeStorage", "RestoreReport", "flush", "flush_node", "restore"]
