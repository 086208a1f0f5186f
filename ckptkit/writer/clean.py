"""Remove what interrupted saves left under a root, and the leases of readers that are gone.

Only leftovers (``ckptkit.ops.listing``: ``.NAME.tmp-<id>`` directories, and ckptkit payloads
with no manifest) are removed; never a committed checkpoint, never one a live read lease
holds, never a directory ckptkit does not know. Run it when no save into the root is in
progress: a save being written looks exactly like an interrupted one.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

from . import retention
from ..io import leases
from ..errors import CheckpointNotFoundError
from ..io.catalog import LEASES_NAME
from ..ops.listing import list_root
from ..storage import open_storage


class Removal(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    reason: str


class CleanReport(BaseModel):
    """What ``ckptkit clean --json`` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    root: str
    dry_run: bool
    removed: list[Removal]  # with dry_run: what would be removed
    busy: list[str]  # leftovers left in place because a live read lease holds them
    stale_leases: int  # leases and marks of processes that no longer run, removed (or to remove), empty lease folders too


def clean(root: str | os.PathLike[str], *, dry_run: bool = False) -> CleanReport:
    """Remove the leftovers of interrupted saves under `root` (with `dry_run`, only say which).

    Raises:
        CheckpointNotFoundError: `root` does not exist, or is not a root of checkpoints (it is
            a checkpoint or an export itself).
        StorageError: a removal failed (those before it are done).
    """
    listing = list_root(root)
    if listing.kind != "run-root":
        raise CheckpointNotFoundError(f"{root}: not a root of checkpoints ({listing.kind}); clean the root that holds it")
    storage = open_storage(root)
    held = retention.busy(storage, [left.name for left in listing.leftovers])
    removed = [Removal(name=left.name, reason=left.reason) for left in listing.leftovers if left.name not in held]
    busy = sorted(held)
    stale = leases.stale(storage)
    if not dry_run:
        for item in removed:
            storage.delete(item.name)
            leases.drop_if_empty(storage, item.name)
        for key in stale:
            storage.delete(key)
        for child in storage.list(LEASES_NAME, recursive=False):
            leases.drop_if_empty(storage, child.rstrip("/").rsplit("/", 1)[-1])
    return CleanReport(root=str(root), dry_run=dry_run, removed=removed, busy=busy, stale_leases=len(stale))
