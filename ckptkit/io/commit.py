"""The one commit path: where a checkpoint's files go until it commits, the commit itself, and the
clean-up of one that did not.

Call order: `refuse_existing` (before anything is written), `staging` (where the files go), the
writes under ``Staging.key``, then `commit` (manifest last, then ``latest``) or, on failure,
`discard`. Where the storage renames, files go under ``.NAME.tmp-<id>/`` and are renamed at
commit; an object store gets them in place under ``NAME/<id>/`` and the conditional create of
the manifest decides which of two concurrent writers committed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import CheckpointExistsError, StorageError
from ..manifest import MANIFEST_NAME
from ..storage import Storage
from .catalog import Location, temp_name, write_latest


@dataclass(frozen=True, slots=True)
class Staging:
    """Where the files of a checkpoint being written go until it is committed.

    Where the storage can rename, under the temporary name ``.NAME.tmp-<id>`` (renamed at
    commit); elsewhere (object stores) in place, under ``NAME/<id>/``, so that two writers of
    the same name never overwrite each other's files: the manifest decides which one committed.
    """

    root: str  # the key prefix of the files being written
    paths: str  # the prefix of their paths in the manifest ("" or "<id>/")

    def key(self, path: str) -> str:
        """The storage key of the file whose manifest path (without prefix) is `path`."""
        return f"{self.root}/{self.paths}{path}"

    def path(self, path: str) -> str:
        """The manifest path of file `path`."""
        return self.paths + path


def staging(loc: Location, uid: str) -> Staging:
    """Return where a new checkpoint at `loc` is written before its commit."""
    if loc.storage.capabilities.rename:
        return Staging(temp_name(loc.name, uid), "")
    return Staging(loc.name, f"{uid}/")


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


def commit(loc: Location, stage: Staging, manifest: bytes, *, update_latest: bool) -> None:
    """Commit the checkpoint written under `stage`: write its manifest and rename it to its name
    (or, where the storage cannot rename, create its manifest only if none exists), then (with
    `update_latest`) move the root's latest pointer to it.

    Raises:
        CheckpointExistsError: another writer committed the same name first.
    """
    if loc.storage.capabilities.rename:
        loc.storage.write(f"{stage.root}/{MANIFEST_NAME}", [manifest])
        try:
            loc.storage.rename(stage.root, loc.name)
        except StorageError:
            if loc.storage.exists(loc.key(MANIFEST_NAME)):
                raise CheckpointExistsError(f"{loc}: another writer committed this checkpoint first") from None
            raise
    else:
        loc.storage.create(loc.key(MANIFEST_NAME), manifest)
    if update_latest:
        write_latest(loc.storage, loc.name)


def discard(storage: Storage, stage: Staging | str) -> None:
    """Delete the files of a checkpoint that did not commit, quietly (they are a leftover if this
    fails). Files written in place are kept when the manifest there lists them: the commit
    happened, and only a later step (moving ``latest``) failed."""
    if isinstance(stage, str):
        prefix = stage
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
        return False
    except (ValueError, AttributeError, TypeError):
        return True  # unreadable: keep everything rather than guess
