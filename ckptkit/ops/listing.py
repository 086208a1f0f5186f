"""What a root holds: its committed checkpoints (step, topology, size, time), the other
directories named for what they are, the leftovers of interrupted saves, and what is wrong with
its ``latest`` pointer (no torch).

`classify` is pure: from the names a directory holds it says what the directory is. Only
interrupted saves (``.NAME.tmp-<id>``, or ckptkit payload files with no manifest) are
leftovers, the things ``ckptkit clean`` removes; exports, other tools' checkpoints and unknown
directories are named and left alone.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import CheckpointNotFoundError, CkptkitError, IntegrityError, StorageError
from ..io.catalog import (
    LATEST_NAME,
    LEASES_NAME,
    RUN_NAME,
    TEMP_PATTERN,
    locate,
    read_latest,
    root_exists,
    COMPACT_LEFTOVER,
    WRITE_LEFTOVER,
    sealed_manifest,
)
from ..io.kinds import DESCRIPTIONS, FOREIGN, Kind, classify
from ..io.run_record import RunRecord, read_run
from ..manifest import MANIFEST_NAME, Topology
from ..storage import Storage, open_storage

class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListedCheckpoint(_Report):
    name: str
    step: int | None
    topology: Topology | None  # None when the manifest does not hold a readable one
    payload_bytes: int | None  # the payload files' total size as the manifest lists them (its own: an incremental save's
    # files of earlier checkpoints are not counted)
    created_at: str | None
    is_latest: bool  # the root's latest pointer names it
    # Another tool's checkpoint, given as ROOT and read through this adapter: its step and the
    # topology it was saved at as the adapter reads them, payload_bytes the folder's files.
    read_through: str | None = None


class Other(_Report):
    """A directory or file under the root that is not a committed checkpoint nor a leftover."""

    name: str
    kind: Kind
    detail: str


class Leftover(_Report):
    """What an interrupted save left: ``ckptkit clean`` removes it."""

    name: str
    reason: str


class ListingReport(_Report):
    """What ``ckptkit ls --json`` prints."""

    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    root: str
    kind: Kind  # what ROOT itself is: a run root, or (given by mistake) a checkpoint, an export...
    latest: str | None  # the name ``latest`` holds (null: no pointer, or a damaged one)
    run: RunRecord | None
    checkpoints: list[ListedCheckpoint]
    others: list[Other]
    leftovers: list[Leftover]
    warnings: list[str]


def list_root(path: str | os.PathLike[str]) -> ListingReport:
    """List what the root `path` holds.

    Raises:
        CheckpointNotFoundError: the root does not exist.
    """
    storage = open_storage(path)
    if not root_exists(storage):
        raise CheckpointNotFoundError(f"{path}: no such directory")
    children = storage.list("", recursive=False)
    kind = classify(children)
    latest, warnings = _latest(storage)
    if kind not in ("run-root", "unknown", "leftover"):  # ROOT is itself a checkpoint or an export
        readable = kind == "checkpoint" or kind in FOREIGN and storage.capabilities.local_files
        warnings.append(f"{path} is {DESCRIPTIONS[kind]}, not a root of checkpoints; "
                        + ("ckptkit inspect it, or ckptkit ls its parent" if readable else "ckptkit ls its parent"))
        loc = locate(path)
        raw = sealed_manifest(loc.storage, loc.name)[0] if kind == "checkpoint" else None
        itself = (_checkpoint(raw, loc.name, None) if raw is not None
                  else _foreign(os.fspath(path), warnings) if readable and kind != "checkpoint" else None)
        return ListingReport(root=str(path), kind=kind, latest=latest, run=None, checkpoints=[itself] if itself else [],
                             others=[], leftovers=[], warnings=warnings)
    checkpoints: list[ListedCheckpoint] = []
    others: list[Other] = []
    leftovers: list[Leftover] = []
    for child in children:
        _entry(storage, child, latest, checkpoints, others, leftovers)
    checkpoints.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    warnings += _latest_warnings(latest, checkpoints, {o.name for o in others if o.kind == "damaged"}, bool(leftovers))
    run, problem = _run(storage)
    warnings += [problem] if problem else []
    return ListingReport(root=str(path), kind="run-root", latest=latest, run=run, checkpoints=checkpoints, others=others,
                         leftovers=leftovers, warnings=warnings)


def _entry(storage: Storage, child: str, latest: str | None, checkpoints: list[ListedCheckpoint], others: list[Other],
           leftovers: list[Leftover]) -> None:
    """Sort one name under the root into checkpoints, others or leftovers."""
    name = child.rstrip("/")
    if name in (LATEST_NAME, LEASES_NAME, RUN_NAME):
        return
    if not child.endswith("/"):
        others.append(Other(name=name, kind="unknown", detail="a file"))
        return
    tmp = TEMP_PATTERN.match(name)
    if tmp:
        leftovers.append(Leftover(name=name, reason=f"uncommitted save of {tmp['name']}"))
        return
    keys = [key.removeprefix(f"{name}/") for key in storage.list(name, recursive=False)]
    kind = classify(keys)
    if kind == "checkpoint":
        raw, problem = sealed_manifest(storage, name)
        if raw is not None:
            checkpoints.append(_checkpoint(raw, name, latest))
            leftovers += _leftovers_inside(storage, name, keys, raw)
        else:  # a manifest is there: not a leftover, and nothing that clean removes
            others.append(Other(name=name, kind="damaged", detail=f"unreadable {MANIFEST_NAME}: {problem}"))
    elif kind == "leftover":
        leftovers.append(Leftover(name=name, reason=f"no {MANIFEST_NAME} (an interrupted save)"))
    elif kind == "unknown" and not storage.capabilities.local_files and not storage.is_prefix(name):
        return  # an object store may list a prefix whose keys are gone
    else:
        others.append(Other(name=name, kind=kind, detail=DESCRIPTIONS[kind]))


def _checkpoint(raw: dict[str, Any], name: str, latest: str | None) -> ListedCheckpoint:
    """The listing of checkpoint `name` from its sealed manifest `raw`."""
    step = raw.get("step")
    try:
        topology = Topology.model_validate(raw.get("topology"))
    except ValidationError:
        topology = None
    files = raw.get("files")
    sizes = [f.get("size") for f in files if isinstance(f, dict) and f.get("base") is None] if isinstance(files, list) else []
    created = raw.get("created_at")
    return ListedCheckpoint(
        name=name, step=step if type(step) is int else None, topology=topology,
        payload_bytes=sum(n for n in sizes if type(n) is int) if sizes else None,
        created_at=created if isinstance(created, str) else None, is_latest=name == latest,
    )


def _leftovers_inside(storage: Storage, name: str, keys: list[str], raw: dict[str, Any]) -> list[Leftover]:
    """What interrupted writes left in checkpoint `name` (its sealed manifest `raw` names none of
    it): the folders of an interrupted compaction, and the temporary files of interrupted atomic
    writes beside its files (where the storage renames: a flusher killed while another committed)."""
    files = raw.get("files")
    if not isinstance(files, list):
        return []
    paths = [f["path"] for f in files if isinstance(f, dict) and isinstance(f.get("path"), str) and f.get("base") is None]
    used = {path.split("/", 1)[0] for path in paths}
    found = [Leftover(name=f"{name}/{folder}", reason=f"files of an interrupted compaction of {name}")
             for folder in (k.rstrip("/") for k in keys if COMPACT_LEFTOVER.match(k.rstrip("/"))) if folder not in used]
    inside = [k for k in keys if WRITE_LEFTOVER.match(k)]
    if storage.capabilities.rename:
        for folder in sorted({path.rsplit("/", 1)[0] for path in paths if "/" in path}):
            inside += [key.removeprefix(f"{name}/") for key in storage.list(f"{name}/{folder}", recursive=False)
                       if WRITE_LEFTOVER.match(key.removeprefix(f"{name}/"))]
    return found + [Leftover(name=f"{name}/{path}", reason=f"the temporary file of an interrupted write in {name}") for path in inside]


def _foreign(path: str, warnings: list[str]) -> ListedCheckpoint | None:
    """Another tool's checkpoint, read through its adapter (metadata only); None, with a warning
    saying why, when it cannot be read."""
    from .convert import survey  # the adapters' readers, imported only for another tool's checkpoint

    try:
        found = survey(path)
    except CkptkitError as exc:
        warnings.append(f"cannot read it: {exc}")
        return None
    source = found.manifest.info.source
    return ListedCheckpoint(name=os.path.basename(os.path.normpath(path)), step=found.manifest.step,
                            topology=source.topology if source else None, payload_bytes=found.file_bytes, created_at=None,
                            is_latest=False, read_through=found.format)


def _latest(storage: Storage) -> tuple[str | None, list[str]]:
    try:
        return read_latest(storage) or None, []
    except (IntegrityError, StorageError) as exc:
        return None, [f"{LATEST_NAME} is damaged: {exc}"]


def _latest_warnings(latest: str | None, checkpoints: list[ListedCheckpoint], damaged: set[str], leftovers: bool) -> list[str]:
    names = {c.name for c in checkpoints}
    out = []
    if latest is not None and latest in damaged:
        out.append(f"{LATEST_NAME} names {latest}, whose {MANIFEST_NAME} cannot be read: ckptkit verify it")
    elif latest is not None and latest not in names:
        out.append(f"{LATEST_NAME} names {latest}, which is not a committed checkpoint here: "
                   "--resume latest fails until a new save moves it")
    elif latest is None and checkpoints:
        out.append(f"no {LATEST_NAME} pointer, though {len(checkpoints)} checkpoint(s) are committed: "
                   "resume one by its path")
    if leftovers:
        out.append("leftovers of interrupted saves: ckptkit clean removes them")
    return out


def _run(storage: Storage) -> tuple[RunRecord | None, str]:
    try:
        return read_run(storage), ""
    except (IntegrityError, StorageError) as exc:
        return None, str(exc)
