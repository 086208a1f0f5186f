"""Apply a retention policy to a root by hand: the rules `CheckpointManager` applies after each
save (``ckptkit.writer.retention``), with the same read leases honoured."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict

from . import retention
from ..errors import CheckpointNotFoundError, LayoutError
from ..ops.listing import list_root
from ..storage import open_storage
from .clean import Removal


class PruneReport(BaseModel):
    """What ``ckptkit prune --json`` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    root: str
    dry_run: bool
    keep_last: int
    keep_every: int | None
    removed: list[Removal]  # the checkpoints deleted, and why (with dry_run: what would be)
    kept: list[str]  # the committed checkpoints that stay, oldest first
    busy: list[str]  # the policy would delete them, but a live read lease holds them
    bases: list[str] = []  # the policy would delete them, but a checkpoint that stays reads their files


def prune(
    root: str | os.PathLike[str], *, keep_last: int, keep_every: int | None = None, dry_run: bool = False
) -> PruneReport:
    """Delete the committed checkpoints under `root` that the policy does not keep: all but the
    newest `keep_last` and the steps divisible by `keep_every`; never the one ``latest`` names,
    the newest, one a live read lease holds, or one whose files a checkpoint that stays reads
    (an incremental save's base). With `dry_run`, only say which.

    Raises:
        LayoutError: `keep_last` or `keep_every` is below 1.
        CheckpointNotFoundError: `root` does not exist or is not a root of checkpoints.
    """
    if keep_last < 1 or (keep_every is not None and keep_every < 1):
        raise LayoutError(f"keep_last and keep_every must be at least 1, got {keep_last} and {keep_every}")
    listing = list_root(root)
    if listing.kind != "run-root":
        raise CheckpointNotFoundError(f"{root}: not a root of checkpoints ({listing.kind}); prune the root that holds it")
    storage = open_storage(root)
    committed = [(c.name, c.step) for c in listing.checkpoints if c.step is not None]
    policy = retention.Policy(keep_last, keep_every)
    by_policy = retention.plan_deletions(committed, listing.latest or "", policy)
    doomed = retention.plan_deletions(committed, listing.latest or "", policy, depends=retention.depends(storage))
    held = retention.busy(storage, doomed)
    free = [name for name in doomed if name not in held]
    deleted = free if dry_run else retention.apply(storage, free)
    busy = sorted(held | (set(free) - set(deleted)))
    kept = [c.name for c in listing.checkpoints if c.name not in deleted]
    why = f"not among the newest {keep_last}" + (f" nor a step divisible by {keep_every}" if keep_every else "")
    return PruneReport(root=str(root), dry_run=dry_run, keep_last=keep_last, keep_every=keep_every,
                       removed=[Removal(name=name, reason=why) for name in deleted], kept=kept, busy=busy,
                       bases=[name for name in by_policy if name not in doomed])
