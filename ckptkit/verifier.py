"""Verify a checkpoint against its manifest: schema, files, headers, tiling, checksums (no torch).

Every finding is collected and reported at once. Checksums stream each file in chunks and
run files in parallel threads (reads and xxh3 both release the GIL).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from .catalog import Location, resolve
from .checksum import hasher_for
from .consistency import Finding, manifest_findings
from .errors import CkptkitError, IntegrityError, ManifestError, StorageError
from .manifest import MANIFEST_NAME, Manifest, parse_manifest
from .safetensors_format import header_length, parse_header
from .shards import iter_shards
from .storage import Storage

CHUNK = 16 << 20
WORKERS = 4


class FindingModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    code: str
    where: str
    message: str


class VerifyReport(BaseModel):
    """What ``ckptkit verify`` found; ``ok`` is True when there is no finding."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    ok: bool
    quick: bool
    files_checked: int
    bytes_hashed: int
    tensors: int
    findings: list[FindingModel]


@dataclass
class _Progress:
    callback: Callable[[int], None] | None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, n: int) -> None:
        if self.callback is not None:
            with self.lock:
                self.callback(n)


def verify(
    path: str | os.PathLike[str],
    *,
    quick: bool = False,
    workers: int = WORKERS,
    progress: Callable[[int], None] | None = None,
    storage: Storage | None = None,
) -> VerifyReport:
    """Check the committed checkpoint at `path` and return every finding.

    Args:
        path: a checkpoint directory, or a root whose ``latest`` names one.
        quick: skip the checksums (sizes, headers and tiling are still checked).
        workers: files hashed in parallel.
        progress: called with the number of bytes hashed as hashing proceeds.
        storage: read through this backend; `path` is then a checkpoint name under its root.

    Raises:
        CheckpointNotFoundError: nothing committed at `path` (nothing to verify).
    """
    loc = resolve(path, storage)
    findings: list[Finding] = []
    manifest = _manifest(loc, findings)
    if manifest is None:
        return _report(loc, quick, findings, 0, 0, 0)
    findings += manifest_findings(manifest)
    bad_paths = {f.where for f in findings if f.code == "path"}
    files = [(i, e) for i, e in enumerate(manifest.files) if e.path not in bad_paths]
    present = []
    for index, entry in files:
        problem = _file_findings(loc, manifest, index)
        findings += problem
        if not problem:
            present.append(index)
    findings += _stray_findings(loc, manifest)
    hashed = 0
    if not quick:
        tracker = _Progress(progress)
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            results = list(pool.map(lambda i: _checksum_finding(loc, manifest, i, tracker), present))
        for finding, nbytes in results:
            hashed += nbytes
            if finding:
                findings.append(finding)
    return _report(loc, quick, findings, len(files), hashed, len(manifest.tensors))


def _manifest(loc: Location, findings: list[Finding]) -> Manifest | None:
    try:
        data = loc.storage.read(loc.key(MANIFEST_NAME))
    except StorageError as exc:
        findings.append(Finding("manifest", MANIFEST_NAME, str(exc)))
        return None
    try:
        return parse_manifest(data, source=MANIFEST_NAME)
    except ManifestError as exc:
        findings.append(Finding("manifest", MANIFEST_NAME, str(exc).removeprefix(f"{MANIFEST_NAME}: ")))
        return None


def _file_findings(loc: Location, manifest: Manifest, index: int) -> list[Finding]:
    entry = manifest.files[index]
    key = loc.key(entry.path)
    try:
        if not loc.storage.exists(key):
            return [Finding("missing", entry.path, "file listed in the manifest does not exist")]
        size = loc.storage.size(key)
    except StorageError as exc:
        return [Finding("path", entry.path, str(exc))]
    if size != entry.size:
        return [Finding("size", entry.path, f"{size} bytes, manifest says {entry.size}")]
    if entry.role != "tensors":
        return []
    try:
        n = header_length(loc.storage.read(key, 0, 8), where=entry.path)
        if 8 + n > size:
            raise IntegrityError(f"{entry.path}: header of {n} bytes runs past the end of the file")
        header = parse_header(loc.storage.read(key, 8, n), where=entry.path, file_size=size)
    except (IntegrityError, StorageError) as exc:
        return [Finding("header", entry.path, str(exc).removeprefix(f"{entry.path}: "))]
    expected: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for fqn, tensor in manifest.tensors.items():
        for shard in iter_shards(tensor):
            if shard.file == index:
                expected[shard.key] = (tensor.dtype, shard.box.lengths, fqn)
    found = []
    for key_name, (dtype, lengths, fqn) in expected.items():
        got = header.entries.get(key_name)
        if got is None:
            found.append(Finding("header", entry.path, f"tensor {key_name!r} (of {fqn}) is missing"))
        elif (got.dtype, got.shape) != (dtype, lengths):
            found.append(
                Finding("header", entry.path, f"tensor {key_name!r} is {got.dtype}{list(got.shape)}, manifest says {dtype}{list(lengths)}")
            )
    for extra in sorted(set(header.entries) - set(expected)):
        found.append(Finding("header", entry.path, f"tensor {extra!r} is not in the manifest"))
    return found


def _stray_findings(loc: Location, manifest: Manifest) -> list[Finding]:
    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    try:
        keys = loc.storage.list(loc.name)
    except StorageError:
        return []
    head = loc.name + "/"
    return [
        Finding("extra", k[len(head) :], "file is not listed in the manifest")
        for k in keys
        if k[len(head) :] not in listed
    ]


def _checksum_finding(loc: Location, manifest: Manifest, index: int, progress: _Progress) -> tuple[Finding | None, int]:
    entry = manifest.files[index]
    try:
        hasher = hasher_for(entry.checksum)
    except CkptkitError as exc:
        return Finding("checksum", entry.path, str(exc)), 0
    key = loc.key(entry.path)
    buffer = bytearray(min(CHUNK, max(entry.size, 1)))
    view = memoryview(buffer)
    done = 0
    try:
        while done < entry.size:
            n = min(len(view), entry.size - done)
            loc.storage.readinto(key, done, view[:n])
            hasher.update(view[:n])
            done += n
            progress.add(n)
    except StorageError as exc:
        return Finding("checksum", entry.path, f"cannot read: {exc}"), done
    digest = hasher.digest()
    if digest != entry.checksum:
        return Finding("checksum", entry.path, f"content hashes to {digest}, manifest says {entry.checksum}"), done
    return None, done


def _report(loc: Location, quick: bool, findings: list[Finding], files: int, hashed: int, tensors: int) -> VerifyReport:
    return VerifyReport(
        path=str(loc),
        ok=not findings,
        quick=quick,
        files_checked=files,
        bytes_hashed=hashed,
        tensors=tensors,
        findings=[FindingModel(code=f.code, where=f.where, message=f.message) for f in findings],
    )
