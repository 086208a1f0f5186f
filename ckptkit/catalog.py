"""Where checkpoints are: locating one, the commit naming rules, the latest pointer, listing a root.

A checkpoint named NAME under a root is committed when ``NAME/manifest.json`` exists. It is
written as ``.NAME.tmp-<id>/`` and renamed to NAME after its manifest is durable (where the
storage can rename); then ``latest`` is replaced atomically with NAME. Anything else under
the root is a leftover: readers ignore it and ``ckptkit ls`` names it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from .errors import CheckpointExistsError, CheckpointNotFoundError, ManifestError, StorageError
from .manifest import MANIFEST_NAME, Manifest, parse_manifest
from .storage import Storage, check_key, open_storage

LATEST_NAME = "latest"
LEASES_NAME = ".leases"  # read leases (ckptkit.retention); not a leftover
_TMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<id>[0-9a-f]+)$")


def temp_name(name: str, uid: str) -> str:
    """Return the name a checkpoint is written under before it is committed."""
    return f".{name}.tmp-{uid}"


@dataclass(frozen=True, slots=True)
class Location:
    """A checkpoint: the storage of its root and its name under that root."""

    storage: Storage
    name: str

    def key(self, relative: str) -> str:
        return f"{self.name}/{relative}"

    def __str__(self) -> str:
        root = getattr(self.storage, "root", "")
        return os.path.join(root, self.name) if root else self.name


def locate(path: str | os.PathLike[str], storage: Storage | None = None) -> Location:
    """Return the location of the checkpoint directory `path` (committed or not).

    With `storage`, `path` is the checkpoint's name under that storage's root.
    """
    if storage is not None:
        return Location(storage, check_key(os.fspath(path)))
    text = os.path.abspath(os.fspath(path)) if "://" not in os.fspath(path) else os.fspath(path)
    parent, name = os.path.split(text.rstrip("/"))
    if not name:
        raise StorageError(f"{path}: not a checkpoint directory path")
    return Location(open_storage(parent), name)


def resolve(path: str | os.PathLike[str], storage: Storage | None = None) -> Location:
    """Return the committed checkpoint at `path`, following ``path/latest`` for a root.

    With `storage`, `path` is a checkpoint name under its root, or ``latest``.

    Raises:
        CheckpointNotFoundError: `path` is neither a committed checkpoint nor a root whose
            latest pointer names one.
    """
    if storage is not None and os.fspath(path) == LATEST_NAME:
        name = read_latest(storage)
        if not name:
            raise CheckpointNotFoundError(f"{storage}: no {LATEST_NAME} pointer")
        path = name
    loc = locate(path, storage)
    if loc.storage.exists(loc.key(MANIFEST_NAME)):
        return loc
    if storage is None and loc.storage.exists(f"{loc.name}/{LATEST_NAME}"):
        root = open_storage(str(loc))
        name = read_latest(root)
        if name and root.exists(f"{name}/{MANIFEST_NAME}"):
            return Location(root, name)
        raise CheckpointNotFoundError(f"{path}/{LATEST_NAME} names {name!r}, which is not a committed checkpoint")
    if loc.storage.exists(loc.name):
        raise CheckpointNotFoundError(f"{path}: no {MANIFEST_NAME}, so not a committed checkpoint (interrupted save?)")
    raise CheckpointNotFoundError(f"{path}: no such checkpoint")


def read_manifest(loc: Location) -> Manifest:
    """Read and validate the manifest of the checkpoint at `loc`."""
    where = str(loc) + "/" + MANIFEST_NAME
    try:
        data = loc.storage.read(loc.key(MANIFEST_NAME))
    except StorageError as exc:
        raise CheckpointNotFoundError(f"{where}: cannot read ({exc})") from exc
    return parse_manifest(data, source=where)


def read_latest(root: Storage) -> str:
    """Return the checkpoint name the root's latest pointer holds ('' when there is none)."""
    if not root.exists(LATEST_NAME):
        return ""
    return root.read(LATEST_NAME).decode("utf-8", "replace").strip()


def write_latest(root: Storage, name: str) -> None:
    """Point the root's latest pointer at `name`, atomically."""
    root.write(LATEST_NAME, [f"{name}\n".encode()])


def refuse_nesting(src: Location, dst: Location) -> None:
    """Refuse a destination that is, contains or lies inside the source checkpoint (writing it
    would add files to a committed checkpoint).

    Raises:
        CheckpointExistsError: the two overlap.
    """
    a, b = str(src), str(dst)
    if os.path.isabs(a) and os.path.isabs(b):  # two local paths
        a, b = os.path.realpath(a), os.path.realpath(b)
    elif src.storage is not dst.storage:
        return
    if a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/"):
        raise CheckpointExistsError(f"{dst}: the destination may not be, contain or lie inside the source {src}")


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


@dataclass(frozen=True, slots=True)
class Entry:
    """One name under a root: a committed checkpoint (with its step) or a leftover and why."""

    name: str
    committed: bool
    step: int | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Listing:
    """What a root holds: committed checkpoints by step, leftovers, and the latest pointer."""

    root: str
    checkpoints: tuple[Entry, ...]
    leftovers: tuple[Entry, ...]
    latest: str


def list_root(path: str | os.PathLike[str]) -> Listing:
    """List the committed checkpoints and the leftovers under a root.

    Raises:
        CheckpointNotFoundError: the root does not exist.
    """
    storage = open_storage(path)
    if not _root_exists(storage):
        raise CheckpointNotFoundError(f"{path}: no such directory")
    committed: list[Entry] = []
    leftovers: list[Entry] = []
    for child in storage.list("", recursive=False):
        name = child.rstrip("/")
        if name in (LATEST_NAME, LEASES_NAME):
            continue
        if not child.endswith("/"):
            leftovers.append(Entry(name, False, reason="stray file"))
            continue
        tmp = _TMP.match(name)
        if tmp:
            leftovers.append(Entry(name, False, reason=f"uncommitted save of {tmp['name']}"))
            continue
        if not storage.exists(f"{name}/{MANIFEST_NAME}"):
            if storage.is_prefix(name):  # an object store may list a prefix whose keys are gone
                leftovers.append(Entry(name, False, reason=f"no {MANIFEST_NAME}"))
            continue
        committed.append(Entry(name, True, step=step_of(storage, name)))
    committed.sort(key=lambda e: (e.step if e.step is not None else -1, e.name))
    return Listing(str(path), tuple(committed), tuple(leftovers), read_latest(storage))


def _root_exists(storage: Storage) -> bool:
    root = getattr(storage, "root", None)
    if isinstance(root, str) and "://" in root:  # an object store: a root exists while it holds keys
        return bool(storage.list("", recursive=False))
    return os.path.isdir(root) if isinstance(root, str) else True


def step_of(storage: Storage, name: str) -> int | None:
    """The step in the manifest of checkpoint `name` (None when it cannot be read)."""
    try:
        raw = json.loads(storage.read(f"{name}/{MANIFEST_NAME}"))
        return int(raw["step"])
    except (ValueError, KeyError, TypeError, StorageError, ManifestError):
        return None
