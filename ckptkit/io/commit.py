"""The one commit path: where a checkpoint's files go until it commits, the commit itself, and the
clean-up of one that did not.

Call order: `refuse_existing` (before anything is written), `staging` (where the files go), the
writes under ``Staging.key``, then `commit` (the marker last: a checkpoint's manifest, an export's
report; then ``latest``) or, on failure, `discard`. Where the storage renames, files go under
``.NAME.tmp-<id>/`` and are renamed at commit. An object store gets a checkpoint's files in place
under ``NAME/<id>/`` (the manifest names them), and the conditional create of the manifest
decides which of two concurrent writers committed; an export, whose files must keep the paths
the tool reading it expects, first claims ``NAME`` (``NAME/.ckptkit-claim``, created only if
none exists), so a second writer fails before writing anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import CheckpointExistsError, StorageError
from ..manifest import MANIFEST_NAME
from ..storage import Storage
from .catalog import LATEST_NAME, Location, latest_step, moves_forward, temp_name, write_latest


@dataclass(frozen=True, slots=True)
class Staging:
    """Where the files of a checkpoint being written go until it is committed.

    Where the storage can rename, under the temporary name ``.NAME.tmp-<id>`` (renamed at
    commit); elsewhere (object stores) in place, under ``NAME/<id>/``, so that two writers of
    the same name never overwrite each other's files: the manifest decides which one committed.
    """

    root: str  # the key prefix of the files being written
    paths: str  # the prefix of their paths in the manifest ("" or "<id>/")
    claimed: bool = False  # written in place under this writer's claim of the name

    def key(self, path: str) -> str:
        """The storage key of the file whose manifest path (without prefix) is `path`."""
        return f"{self.root}/{self.paths}{path}"

    def path(self, path: str) -> str:
        """The manifest path of file `path`."""
        return self.paths + path


CLAIM_NAME = ".ckptkit-claim"
REPORT_NAME = "export_report.json"  # an export's marker: written last, it commits the export


def staging(loc: Location, uid: str, *, fixed_paths: bool = False) -> Staging:
    """Return where a new checkpoint (or export) at `loc` is written before its commit.

    With `fixed_paths` (an export: its files keep their paths), a storage that cannot rename
    gets the files in place once this writer has claimed the name.

    Raises:
        CheckpointExistsError: another writer holds the claim (nothing was written).
    """
    if loc.storage.capabilities.rename:
        return Staging(temp_name(loc.name, uid), "")
    if not fixed_paths:
        return Staging(loc.name, f"{uid}/")
    try:
        loc.storage.create(loc.key(CLAIM_NAME), uid.encode())
    except CheckpointExistsError:
        raise CheckpointExistsError(
            f"{loc}: another writer is writing it ({CLAIM_NAME} exists; remove {loc} if that writer died)"
        ) from None
    # A writer that committed has dropped its claim: the name must hold nothing but ours.
    if loc.storage.list(loc.name) != [loc.key(CLAIM_NAME)]:
        try:
            loc.storage.delete(loc.key(CLAIM_NAME))
        finally:
            raise CheckpointExistsError(f"{loc}: already exists (another writer committed it); choose another path")
    return Staging(loc.name, "", claimed=True)


def refuse_existing(loc: Location) -> None:
    """Refuse to write a checkpoint where one is committed (or, where the storage renames, where
    anything exists: the rename would fail).

    Raises:
        CheckpointExistsError: there is one.
    """
    if not loc.storage.exists(loc.name):
        return
    committed = loc.storage.exists(loc.key(MANIFEST_NAME))
    if committed or loc.storage.capabilities.rename:
        what = "a committed checkpoint" if committed else "an uncommitted directory"
        raise CheckpointExistsError(f"{loc}: {what} already exists; choose another path or remove it")


def commit(
    loc: Location, stage: Staging, marker: bytes, *, update_latest: bool, marker_name: str = MANIFEST_NAME,
    step: int | None = None,
) -> bool:
    """Commit what was written under `stage`: write its marker (the manifest, or an export's
    report) and rename it to its name (or, where the storage cannot rename, create the marker
    only if none exists, then drop this writer's claim), then (with `update_latest`) move the
    root's latest pointer to it if its `step` is higher than the one ``latest`` names (or
    ``latest`` names no committed checkpoint). Returns whether ``latest`` was moved.

    Raises:
        CheckpointExistsError: another writer committed the same name first.
        StorageError: a write failed: before the marker, nothing was committed; when moving
            ``latest``, the checkpoint is committed and the pointer still names the previous one
            (the message says which).
    """
    if loc.storage.capabilities.rename:
        loc.storage.write(f"{stage.root}/{marker_name}", [marker])
        try:
            loc.storage.rename(stage.root, loc.name)
        except StorageError:
            if loc.storage.exists(loc.key(marker_name)):
                raise CheckpointExistsError(f"{loc}: another writer committed it first") from None
            raise
    else:
        loc.storage.create(loc.key(marker_name), marker)
        if stage.claimed:
            try:
                loc.storage.delete(loc.key(CLAIM_NAME))
            except StorageError:
                pass  # committed all the same; a claim left behind only keeps others from writing here
    if not update_latest or (step is not None and not moves_forward(latest_step(loc.storage), step)):
        return False
    _move_latest(loc)
    return True


def _move_latest(loc: Location) -> None:
    """Point the root's ``latest`` at the checkpoint just committed. Its failure comes after the
    commit, so the error says so: the checkpoint stays, loadable by its name."""
    try:
        write_latest(loc.storage, loc.name)
    except OSError as exc:  # StorageError, or a backend's bare OSError (ENOSPC)
        raise StorageError(
            f"{loc}: the checkpoint is committed, but the {LATEST_NAME} pointer was not moved to it "
            f"(it still names the previous one): {exc}; load it by its name (the next save moves {LATEST_NAME})"
        ) from exc


def discard(storage: Storage, stage: Staging | str) -> None:
    """Delete the files of a checkpoint that did not commit, quietly (they are a leftover if this
    fails). Files written in place are kept when the manifest there lists them: the commit
    happened, and only a later step (moving ``latest``) failed. A claimed name is all this
    writer's: everything under it goes, the claim last."""
    if isinstance(stage, str):
        prefix = stage
    elif stage.claimed:
        prefix = stage.root
    else:
        prefix = f"{stage.root}/{stage.paths}".rstrip("/")
        if stage.paths and _listed(storage, stage):
            return
    try:
        storage.delete(prefix)
    except StorageError:
        pass


def _listed(storage: Storage, stage: Staging) -> bool:
    """Whether the manifest at ``stage.root`` lists files under the stage's prefix."""
    try:
        raw = json.loads(storage.read(f"{stage.root}/{MANIFEST_NAME}"))
        return any(str(f.get("path", "")).startswith(stage.paths) for f in raw.get("files", []))
    except StorageError:
        return exists_or_unknown(storage, f"{stage.root}/{MANIFEST_NAME}")  # one there but unreadable: keep
    except (ValueError, AttributeError, TypeError):
        return True  # unreadable: keep everything rather than guess


def exists_or_unknown(storage: Storage, key: str) -> bool:
    """Whether `key` exists; True when even that cannot be told (keep rather than delete, and
    write nothing there)."""
    try:
        return storage.exists(key)
    except (StorageError, OSError):
        return True
