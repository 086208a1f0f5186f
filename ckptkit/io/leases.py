"""Read leases and deletion marks: how a reader keeps a checkpoint while it reads it, and how a
deleter (retention) learns that it must not delete it (no torch).

A read lease is a small file ``.leases/<name>/<host>-<pid>-<id>`` under the root, held while
a reader uses the checkpoint (`lease`). A lease of a process of this host that no longer runs
is stale and ignored.

Readers and deleters agree through a second kind of file there, a deletion mark
``.leases/<name>/.deleting-<host>-<pid>-<id>``. Each side writes its own file first and then
looks for the other's: the deleter marks, checks for live leases and backs off (removing its
mark) if it finds one, else deletes (``ckptkit.writer.retention``); the reader leases, then
checks for a live mark and then for the manifest (in that order), and gives up with
`CheckpointNotFoundError` if either says the checkpoint is going. Whichever wrote second sees
the first's file, so a reader either keeps an intact checkpoint until it releases its lease or
learns that retention removed it. A mark, like a lease, of a process of this host that no
longer runs is stale and ignored. An incremental save leases the checkpoint it refers to until
it commits, so that its base is never deleted under it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
from collections.abc import Iterator

from ..errors import CheckpointNotFoundError, StorageError
from ..manifest import MANIFEST_NAME
from ..storage import Storage
from .catalog import LEASES_NAME as LEASES

MARK_PREFIX = ".deleting-"  # a deletion mark among the leases (a lease starts with its host)


@contextlib.contextmanager
def lease(storage: Storage, name: str) -> Iterator[None]:
    """Hold a read lease on checkpoint `name` of the root `storage` for the duration of the block.

    Raises:
        CheckpointNotFoundError: retention removed the checkpoint, or is removing it, before
            the lease was taken (the lease is released).
    """
    key = f"{LEASES}/{name}/{owner_id()}"
    storage.write(key, [owner_doc()])
    try:
        # The mark first: a deleter drops its mark only after deleting the manifest (or after
        # backing off, keeping the checkpoint), so no mark then a manifest means it stays.
        if marked(storage, name) or not storage.exists(f"{name}/{MANIFEST_NAME}"):
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
    return [key for key in keys if not live(storage, key)]


def held(storage: Storage, name: str) -> bool:
    """Whether a live read lease holds checkpoint `name`."""
    return any(live(storage, key) for key in storage.list(f"{LEASES}/{name}") if not is_mark(key))


def marked(storage: Storage, name: str) -> bool:
    """Whether a live deleter has marked checkpoint `name` as being deleted."""
    return any(live(storage, key) for key in storage.list(f"{LEASES}/{name}") if is_mark(key))


def is_mark(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(MARK_PREFIX)


def owner_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def owner_doc() -> bytes:
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()


def live(storage: Storage, key: str) -> bool:
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


__all__ = ["MARK_PREFIX", "drop_if_empty", "held", "is_mark", "lease", "live", "marked", "owner_doc", "owner_id", "stale"]
