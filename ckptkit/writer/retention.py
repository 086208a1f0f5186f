"""Which checkpoints of a root to keep, and their deletion (the read leases that protect a
checkpoint being read, and the deletion marks deleters agree with readers through, are
``ckptkit.io.leases``).

`plan_deletions` is pure: given the committed checkpoints (name, step), the latest pointer and
the policy, it names the checkpoints to delete. A checkpoint is deleted only when it is
committed, older than a newer committed one, not the latest, not pinned, not kept by
``keep_last`` / ``keep_every``, not being read, and not a base another checkpoint that stays
reads files of (an incremental save's, ``ckptkit.io.chain``). `apply` does the deleting: the
manifest first, so that a checkpoint half deleted never looks committed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ..io import leases
from ..io.catalog import LEASES_NAME as LEASES
from ..io.chain import dependencies, needed
from ..io.leases import MARK_PREFIX
from ..errors import StorageError
from ..manifest import MANIFEST_NAME
from ..storage import Storage, plain_name


@dataclass(frozen=True, slots=True)
class Policy:
    """Keep the newest `keep_last` checkpoints (None: all) and every step divisible by
    `keep_every` (None: none beyond keep_last), plus the `pinned` steps."""

    keep_last: int | None = None
    keep_every: int | None = None
    pinned: frozenset[int] = frozenset()


def plan_deletions(
    committed: list[tuple[str, int]], latest: str, policy: Policy, busy: Collection[str] = (),
    depends: Mapping[str, Collection[str]] | None = None,
) -> list[str]:
    """Return the names to delete among `committed` (name, step), oldest first; never a base
    (`depends`: each checkpoint's bases) of one that stays."""
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
    if depends:
        kept = needed({k: set(v) for k, v in depends.items()}, (name for name, _ in committed if name not in out))
        out = [name for name in out if name not in kept]
    return out


def apply(storage: Storage, names: list[str]) -> list[str]:
    """Delete each checkpoint of `names` that no live lease holds and no other committed
    checkpoint reads files of; return those deleted, in the order of `names`.

    The newest go first (a checkpoint that refers to an older one of `names` goes before it).
    Each is first marked as being deleted, then its leases are checked again (a reader, or an
    incremental save that refers to it, may have taken one since `busy`), then what the root's
    committed checkpoints refer to (a save that refers to it may have committed since): if held
    or referred to, it is left as it was, mark removed. Otherwise its manifest goes first, then
    the rest, its leases and marks last (one that cannot be deleted is left, at worst as a
    leftover without manifest).
    """
    deleted = {name for name in reversed(names) if _delete(storage, name)}
    return [name for name in names if name in deleted]


def depends(storage: Storage) -> dict[str, set[str]]:
    """The bases of every checkpoint under the root (``ckptkit.io.chain.dependencies``)."""
    try:
        names = [k.rstrip("/") for k in storage.list("", recursive=False)]
    except StorageError:
        return {}
    return dependencies(storage, [n for n in names if plain_name(n)])


def busy(storage: Storage, names: Collection[str]) -> set[str]:
    """Return the names among `names` that hold a live read lease (a first, cheap filter:
    `apply` checks again under its mark)."""
    out = set()
    for name in names:
        with contextlib.suppress(StorageError):
            if leases.held(storage, name):
                out.add(name)
    return out


def _delete(storage: Storage, name: str) -> bool:
    """Mark `name`, re-check its leases, and delete it unless one is live; return whether deleted."""
    mark = f"{LEASES}/{name}/{MARK_PREFIX}{leases.owner_id()}"
    try:
        storage.write(mark, [leases.owner_doc()])
        if leases.held(storage, name) or any(name in bases for other, bases in depends(storage).items() if other != name):
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


