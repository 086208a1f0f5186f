"""Where checkpoints are: locating one, the naming rules, the latest pointer, what a run root is
(listing a root is ``ckptkit.ops.listing``; the commit itself is ``ckptkit.io.commit``).

A checkpoint named NAME under a root is committed when ``NAME/manifest.json`` exists. It is
written as ``.NAME.tmp-<id>/`` and renamed to NAME after its manifest is durable (where the
storage can rename); then ``latest`` is replaced atomically with NAME, if NAME's step is
higher. Readers ignore anything else under the root; ``ckptkit ls`` names it.

``latest`` holds two lines: NAME, and the checksum of NAME (so that a damaged pointer never
names another checkpoint silently). A pointer of one line (written before the checksum) is read
as NAME. Either way NAME must be one plain name under the root, and the file at most
LATEST_LIMIT bytes.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import CheckpointExistsError, CheckpointNotFoundError, CkptkitError, IntegrityError, ManifestError, StorageError
from .checksum import checksum_of
from ..manifest import MANIFEST_LIMIT, MANIFEST_NAME, FileEntry, Manifest, check_seal, check_version, parse_manifest, strictjson
from ..storage import Storage, check_key, open_storage, plain_name

LATEST_NAME = "latest"
LATEST_LIMIT = 4096
LEASES_NAME = ".leases"  # read leases (ckptkit.writer.retention); not a leftover
RUN_NAME = "run.json"  # the run a root belongs to (ckptkit.io.run); not a leftover
COMPACT_PREFIX = ".compact-"  # ".compact-<id>/" in a checkpoint: the new files of a compaction (ckptkit.ops.compact)
# What a compaction cut off leaves in a checkpoint: its folder.
COMPACT_LEFTOVER = re.compile(r"^\.compact-[0-9a-f]+(/.*)?$")
# What an interrupted atomic write leaves beside its file, anywhere in a checkpoint: its hidden
# temporary file (a compaction's manifest replacement, a flusher killed while another committed).
WRITE_LEFTOVER = re.compile(r"^(?:.+/)?\.[^/]+\.tmp-[0-9a-f]+$")
TEMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<id>[0-9a-f]+)$")  # ".NAME.tmp-<id>": a save being written, or an interrupted one


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

    def file_key(self, entry: FileEntry) -> str:
        """The storage key of a file of this checkpoint's manifest: under this checkpoint, or
        under the earlier checkpoint of the same root it names as its ``base``."""
        return f"{entry.base or self.name}/{entry.path}"

    def file_str(self, entry: FileEntry) -> str:
        """Where a file of this checkpoint's manifest is, as messages say it."""
        return f"{self}/{entry.where()}" if entry.base is None else str(Location(self.storage, entry.base)) + "/" + entry.path

    def __str__(self) -> str:
        root = self.storage.root
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
        try:
            name = read_latest(root)
        except CkptkitError:
            _refuse_foreign(path, loc)  # another tool's `latest` (DeepSpeed's) is not ckptkit's
            raise
        if name and root.exists(f"{name}/{MANIFEST_NAME}"):
            return Location(root, name)
        _refuse_foreign(path, loc)
        raise CheckpointNotFoundError(f"{path}/{LATEST_NAME} names {name!r}, which is not a committed checkpoint")
    if loc.storage.exists(loc.name):
        if storage is None:
            _refuse_foreign(path, loc)
        raise CheckpointNotFoundError(f"{path}: no {MANIFEST_NAME}, so not a committed checkpoint (interrupted save?)")
    raise CheckpointNotFoundError(f"{path}: no such checkpoint")


def _refuse_foreign(path: str | os.PathLike[str], loc: Location) -> None:
    """Say what another tool's checkpoint at `loc` is, and how to bring it in (only on the way to
    refusing `path`: the directory is listed once, and never for a checkpoint that resolves).

    Raises:
        ForeignCheckpointError: `loc` is another tool's checkpoint (or an export convert reads).
        CheckpointNotFoundError: `loc` is an export nothing reads back.
    """
    from .kinds import foreign_problem  # what another tool's checkpoint is (kinds imports this module)

    foreign = foreign_problem(os.fspath(path), [k.removeprefix(f"{loc.name}/") for k in loc.storage.list(loc.name, recursive=False)])
    if foreign is not None:
        raise foreign


def read_manifest(loc: Location) -> Manifest:
    """Read and validate the manifest of the checkpoint at `loc`."""
    where = str(loc) + "/" + MANIFEST_NAME
    try:
        data = manifest_bytes(loc)
    except StorageError as exc:
        raise CheckpointNotFoundError(f"{where}: cannot read ({exc})") from exc
    return parse_manifest(data, source=where)


@contextlib.contextmanager
def still_committed(loc: Location) -> Iterator[None]:
    """Turn a failed read of a checkpoint that is no longer committed (retention or another
    process removed it meanwhile) into that plain fact, not a report of corruption.

    Raises:
        CheckpointNotFoundError: a read failed and the manifest at `loc` is gone.
    """
    try:
        yield
    except (IntegrityError, StorageError) as exc:
        if removed(loc):
            raise removed_error(loc) from exc
        raise


def removed(loc: Location) -> bool:
    """Whether the checkpoint at `loc` is no longer committed (its manifest is gone)."""
    try:
        return not loc.storage.exists(loc.key(MANIFEST_NAME))
    except StorageError:
        return False


def removed_error(loc: Location) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"{loc}: removed while it was being read (by retention or another process)")


def manifest_bytes(loc: Location) -> bytes:
    """The bytes of the manifest at `loc`, refused unread above MANIFEST_LIMIT.

    Raises:
        StorageError: it cannot be read (or is not a regular file).
        ManifestError: it is larger than any manifest.
    """
    key = loc.key(MANIFEST_NAME)
    size = loc.storage.size(key)
    if size > MANIFEST_LIMIT:
        raise ManifestError(f"{loc}/{MANIFEST_NAME}: {size} bytes, over the {MANIFEST_LIMIT}-byte limit of a manifest")
    return loc.storage.read(key, 0, size)


def read_latest(root: Storage) -> str:
    """Return the checkpoint name the root's latest pointer holds ('' when there is none).

    Raises:
        IntegrityError: the pointer is damaged (too large, not text, not a plain name, or not
            matching its checksum).
        StorageError: it cannot be read (or is not a regular file).
    """
    if not root.exists(LATEST_NAME):
        return ""
    where = f"{root.root}/{LATEST_NAME}" if root.root else LATEST_NAME
    size = root.size(LATEST_NAME)
    if size > LATEST_LIMIT:
        raise IntegrityError(f"{where}: {size} bytes, too large for a latest pointer (damaged?)")
    try:
        lines = root.read(LATEST_NAME, 0, size).decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise IntegrityError(f"{where}: not text, so not a latest pointer (damaged?)") from None
    name, checksum = lines[0].strip(), (lines[1].strip() if len(lines) > 1 else "")
    if checksum and checksum != checksum_of(name.encode("utf-8")):
        raise IntegrityError(f"{where}: names {name[:100]!r}, which does not match its checksum (damaged?)")
    if any(line.strip() for line in lines[2:]) or not plain_name(name):
        raise IntegrityError(f"{where}: does not hold one plain checkpoint name (damaged?)")
    return name


def write_latest(root: Storage, name: str) -> None:
    """Point the root's latest pointer at `name`, atomically."""
    root.write(LATEST_NAME, [f"{name}\n{checksum_of(name.encode('utf-8'))}\n".encode()])


def latest_step(root: Storage) -> int | None:
    """The step of the committed checkpoint the root's ``latest`` names; None when it names none
    (no pointer, a damaged one, or a name that is not committed)."""
    try:
        name = read_latest(root)
    except (IntegrityError, StorageError):
        return None
    return step_of(root, name) if name else None


def moves_forward(current: int | None, step: int) -> bool:
    """Whether ``latest`` may move from the checkpoint at step `current` (None: it names none) to
    one at `step`: only to a higher step, so that no command sends a run back in time."""
    return current is None or step > current


def is_run_root(root: Storage) -> bool:
    """Whether a root is a run's: it holds a ``latest`` pointer or a run record, or nothing at
    all (a new root; never the working directory, where a bare destination name lands)."""
    if root.exists(LATEST_NAME) or root.exists(RUN_NAME):
        return True
    if root.capabilities.local_files and os.path.realpath(root.root) == os.path.realpath(os.getcwd()):
        return False
    return not [key for key in root.list("", recursive=False) if key.rstrip("/") != LEASES_NAME]


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


def root_exists(storage: Storage) -> bool:
    """Whether a root exists (on an object store: while it holds keys)."""
    if storage.capabilities.local_files:
        return os.path.isdir(storage.root)
    return bool(storage.list("", recursive=False))


def step_of(storage: Storage, name: str) -> int | None:
    """The step in the manifest of checkpoint `name` (None when it cannot be read)."""
    return _step(storage, name)[0]


def _step(storage: Storage, name: str) -> tuple[int | None, str]:
    """The step of checkpoint `name`, or None and why its manifest cannot be read."""
    raw, problem = sealed_manifest(storage, name)
    if raw is None:
        return None, problem
    step = raw.get("step")
    return (step, "") if type(step) is int else (None, "no step")


def sealed_manifest(storage: Storage, name: str) -> tuple[dict[str, object] | None, str]:
    """The raw manifest of checkpoint `name` (None, and why, when it cannot be read). Lighter
    than parsing it (no schema validation), but size-capped and checked against its seal."""
    loc = Location(storage, name)
    try:
        raw = strictjson.loads(manifest_bytes(loc))
        if not isinstance(raw, dict):
            return None, "not a JSON object"
        check_seal(raw, check_version(raw, source=MANIFEST_NAME), source=MANIFEST_NAME)
        return raw, ""
    except (StorageError, ManifestError, ValueError) as exc:
        return None, str(exc).removeprefix(f"{MANIFEST_NAME}: ")
