"""Which checkpoints of a root to keep, and read leases that protect a checkpoint being read.

`plan_deletions` is pure: given the committed checkpoints (name, step), the latest pointer and
the policy, it names the checkpoints to delete. A checkpoint is deleted only when it is
committed, older than a newer committed one, not the latest, not pinned, not kept by
``keep_last`` / ``keep_every``, and not being read. `apply` does the deleting: the manifest
first, so that a checkpoint half deleted never looks committed.

A read lease is a small file ``.leases/<name>/<host>-<pid>-<id>`` under the root, held while
a reader uses the checkpoint (`lease`). A lease of a process of this host that no longer runs
is stale and ignored.
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
from ..errors import StorageError
from ..manifest import MANIFEST_NAME
from ..storage import Storage


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
    """Delete each checkpoint of `names`: its manifest first, then the rest. Return those deleted
    (one that cannot be deleted is left, at worst as a leftover without manifest)."""
    done = []
    for name in names:
        try:
            storage.delete(f"{name}/{MANIFEST_NAME}")
            storage.delete(name)
            storage.delete(f"{LEASES}/{name}")
        except StorageError:
            continue
        done.append(name)
    return done


def busy(storage: Storage, names: Collection[str]) -> set[str]:
    """Return the names among `names` that hold a live read lease."""
    out = set()
    for name in names:
        try:
            leases = storage.list(f"{LEASES}/{name}")
        except StorageError:
            continue
        if any(_live(storage, key) for key in leases):
            out.add(name)
    return out


@contextlib.contextmanager
def lease(storage: Storage, name: str) -> Iterator[None]:
    """Hold a read lease on checkpoint `name` of the root `storage` for the duration of the block."""
    key = f"{LEASES}/{name}/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    storage.write(key, [json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()])
    try:
        yield
    finally:
        with contextlib.suppress(StorageError):
            storage.delete(key)


def _live(storage: Storage, key: str) -> bool:
    try:
        doc = json.loads(storage.read(key))
    except (StorageError, ValueError):
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
