"""Which checkpoints of a root to keep, and read leases that protect a checkpoint being read.

`plan_deletions` is pure: given the committed checkpoints (name, step), the latest pointer and
the policy, it names the checkpoints to delete. A checkpoint is deleted only when it is
committed, older than a newer committed one, not the latest, not pinned, not kept by
``keep_last`` / ``keep_every``, and not being read. `apply` does the deleting: the manifest
first, so that a checkpoint half deleted never looks committed.

A read lease is a small file ``.leases/<name>/<host>-<pid>-<id>`` under the root, held while
a reader uses the checkpoint (`lease`). A lease of a process of this host that no longer runs
is stale and ignored.

Readers and deleters agree through a second kind of file there, a deletion mark
``.leases/<name>/.deleting-<host>-<pid>-<id>``. Each side writes its own file first and then
looks for the other's: the deleter marks, checks for live leases and backs off (removing its
mark) if it finds one, else deletes; the reader leases, then checks for a live mark and then for
the manifest (in that order), and gives up with `CheckpointNotFoundError` if either says the
checkpoint is going. Whichever wrote second sees the first's file, so a reader either keeps an
intact checkpoint until it releases its lease or learns that retention removed it. A mark, like
a lease, of a process of this host that no longer runs is stale and ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from ..io.catalog import LEASES_NAME as LEASES
from ..errors import CheckpointNotFoundError, StorageError
from ..manifest import MANIFEST_NAME
from ..storage import Storage

MARK_PREFIX = ".deleting-"  # a deletion mark among the leases (a lease starts with its host)


@dataclass(frozen=True, slots=True)
class Policy:
    """Keep the newest `keep_last` checkpoints (None: all) and every step divisible by
    `keep_every` (None: none beyond keep_last), plus the `pinned` steps."""

    keep_last: int | None = None
    keep_every: int | None = None
    pinned: frozenset[int] = frozenset()


def plan_deletions(
    committed: list[tuple[str, int]], latest: str, policy: Policy, busy: Collection[str] = ()
) -> list[str]:
    """Return the names to delete among `committed` (name, step), oldest first."""
    if policy.keep_last is None or not committed:
        return []
    ordered = sorted(committed, key=lambda c: (c[1], c[0]))
    newest_step = ordered[-1][1]
    keep = {name for name, _ in ordered[-policy.keep_last :]}
    out = []
    for name, step in ordered:
        if name in keep or name == latest or name in busy or step in policy.pinned or step >= newest_step:
            continue
        if policy.keep_every and step % policy.keep_every == 0:
            continue
        out.append(name)
    return out


def apply(storage: Storage, names: list[str]) -> list[str]:
    """Delete each checkpoint of `names` that no live lease holds; return those deleted.

    Each is first marked as being deleted, then its leases are checked again (a reader may have
    taken one since `busy`): a held one is left as it was, mark removed. Otherwise its manifest
    goes first, then the rest, its leases and marks last (one that cannot be deleted is left, at
    worst as a leftover without manifest).
    """
    return [name for name in names if _delete(storage, name)]


def busy(storage: Storage, names: Collection[str]) -> set[str]:
    """Return the names among `names` that hold a live read lease (a first, cheap filter:
    `apply` checks again under its mark)."""
    out = set()
    for name in names:
        with contextlib.suppress(StorageError):
            if _held(storage, name):
                out.add(name)
    return out


@contextlib.contextmanager
def lease(storage: Storage, name: str) -> Iterator[None]:
    """Hold a read lease on checkpoint `name` of the root `storage` for the duration of the block.

    Raises:
        CheckpointNotFoundError: retention removed the checkpoint, or is removing it, before
            the lease was taken (the lease is released).
    """
    key = f"{LEASES}/{name}/{_owner_id()}"
    storage.write(key, [_owner_doc()])
    try:
        # The mark first: a deleter drops its mark only after deleting the manifest (or after
        # backing off, keeping the checkpoint), so no mark then a manifest means it stays.
        if _marked(storage, name) or not storage.exists(f"{name}/{MANIFEST_NAME}"):
            where = f"{storage.root}/{name}" if storage.root else name
            raise CheckpointNotFoundError(f"{where}: removed by retention (deleted or being deleted); read a newer one")
        yield
    finally:
        with contextlib.suppress(StorageError):
            storage.delete(key)
        drop_if_empty(storage, name)


def drop_if_empty(storage: Storage, name: str) -> None:
    """Remove the lease folder of checkpoint `name` if it holds nothing (a local directory; an
    object store has no empty folders). Only an empty directory is removed, atomically, so a
    lease another reader takes meanwhile is never deleted with it."""
    if not storage.capabilities.local_files:
        return
    with contextlib.suppress(OSError):
        os.rmdir(storage.local_path(f"{LEASES}/{name}"))


def stale(storage: Storage) -> list[str]:
    """The keys of leases and deletion marks under the root whose process (of this host) no
    longer runs."""
    try:
        keys = storage.list(LEASES)
    except StorageError:
        return []
    return [key for key in keys if not _live(storage, key)]


def _delete(storage: Storage, name: str) -> bool:
    """Mark `name`, re-check its leases, and delete it unless one is live; return whether deleted."""
    mark = f"{LEASES}/{name}/{MARK_PREFIX}{_owner_id()}"
    try:
        storage.write(mark, [_owner_doc()])
        if _held(storage, name):
            _unmark(storage, mark)
            return False
        storage.delete(f"{name}/{MANIFEST_NAME}")
    except StorageError:
        _unmark(storage, mark)  # the manifest is there (or gone): readers see which, with no mark
        return False
    deleted = True
    try:
        storage.delete(name)
    except StorageError:
        deleted = False  # a leftover without manifest
    with contextlib.suppress(StorageError):
        storage.delete(f"{LEASES}/{name}")  # marks and leases last: the manifest is gone already
    return deleted


def _unmark(storage: Storage, mark: str) -> None:
    with contextlib.suppress(StorageError):
        storage.delete(mark)


def _held(storage: Storage, name: str) -> bool:
    """Whether a live read lease holds checkpoint `name`."""
    return any(_live(storage, key) for key in storage.list(f"{LEASES}/{name}") if not _is_mark(key))


def _marked(storage: Storage, name: str) -> bool:
    """Whether a live deleter has marked checkpoint `name` as being deleted."""
    return any(_live(storage, key) for key in storage.list(f"{LEASES}/{name}") if _is_mark(key))


def _is_mark(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(MARK_PREFIX)


def _owner_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _owner_doc() -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()


def _live(storage: Storage, key: str) -> bool:
    try:
        doc = json.loads(storage.read(key))
    except StorageError:
        return storage.exists(key)  # gone since listed: released; else unreadable: assume held
    except ValueError:
        return True  # unreadable: assume a reader holds it
    if doc.get("host") != socket.gethostname():
        return True  # another machine's reader: cannot check, so it counts
    try:
        os.kill(int(doc["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, ValueError, TypeError):
        return True
    return True
