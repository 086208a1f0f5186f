"""Verify a checkpoint against its manifest: schema, files, headers, tiling, checksums (no torch).

Every finding is collected and reported at once. Checksums stream every file in 8 MiB chunks:
a few threads read ahead (reads release the GIL) while the calling thread hashes in order.
Under torch.distributed (``torchrun ... -m ckptkit.cli verify``) the ranks split the payload
files by bytes and every rank returns the same report, the one a single process gives.
"""

from __future__ import annotations

import os
import queue
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict

from .collective import default_collective, guard, unwrap
from .reports import SkippedEntry
from ..io.catalog import COMPACT_LEFTOVER, WRITE_LEFTOVER, Location, manifest_bytes, removed, removed_error, resolve
from ..io.chain import base_problems
from ..io.checksum import BlockHasher, Hasher, hasher_for
from ..manifest.consistency import Finding, manifest_findings
from ..errors import CkptkitError, ForeignCheckpointError, IntegrityError, ManifestError, StorageError
from ..manifest import MANIFEST_NAME, SIDECAR_SUFFIX, FileEntry, Manifest, parse_manifest
from ..io.safetensors import header_length, parse_header
from ..manifest.shards import KeyIndex, Keys, file_keys, spec_keys
from ..io.payload import block_digests, header_problems
from ..storage import Storage

CHUNK = 8 << 20
WORKERS = 4


class FindingModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    code: str
    where: str
    message: str


class VerifyReport(BaseModel):
    """What ``ckptkit verify`` found; ``ok`` is True when there is no finding."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str
    ok: bool
    quick: bool
    files: int
    bytes_read: int
    tensors: int
    findings: list[FindingModel]
    # Another tool's checkpoint, read through its adapter (nothing converted): the adapter's name,
    # and the entries `ckptkit convert` would skip. It has no checksums:
    # every tensor is read whole and its size checked against the format's metadata.
    read_through: str | None = None
    skipped: list[SkippedEntry] = []


def verify(
    path: str | os.PathLike[str],
    *,
    quick: bool = False,
    workers: int = WORKERS,
    progress: Callable[[int], None] | None = None,
    storage: Storage | None = None,
    process_group: Any = None,
) -> VerifyReport:
    """Check the committed checkpoint at `path` and return every finding.

    Args:
        path: a checkpoint directory, or a root whose ``latest`` names one.
        quick: skip the checksums (sizes, headers and tiling are still checked).
        workers: threads that read chunks ahead of the hashing.
        progress: called with the number of bytes hashed as hashing proceeds.
        storage: read through this backend; `path` is then a checkpoint name under its root.
        process_group: under torch.distributed, every rank of the group calls this (the default
            group when it is initialised): each hashes its share of the files (`share`), and
            each returns the whole report. `progress` counts this rank's bytes.

    Another tool's checkpoint at `path` (a local directory ``ckptkit convert`` reads) is read
    through its adapter: its metadata, then every tensor (``quick``: only the metadata and
    scalars), each checked against what the metadata says of it; it has no checksums to check.

    Raises:
        CheckpointNotFoundError: nothing committed at `path` (nothing to verify).
    """
    coll = default_collective(process_group)
    try:
        loc = resolve(path, storage)
    except ForeignCheckpointError as exc:  # read whole by rank 0 (its adapter reads no share)
        mine = guard(lambda: _foreign(exc, quick)) if coll.rank == 0 else None
        return unwrap(coll.broadcast(mine)) if coll.world_size > 1 else _foreign(exc, quick)
    findings: list[Finding] = []
    manifest = _manifest(loc, findings)
    if manifest is None:
        return _report(loc, quick, findings, 0, 0, 0)
    findings += manifest_findings(manifest)
    findings += [Finding("base", where, message) for where, message in base_problems(loc, manifest)]
    bad_paths = {f.where for f in findings if f.code == "path"}
    files = [(i, e) for i, e in enumerate(manifest.files) if e.where() not in bad_paths]
    # A tensor whose spec is unsound is not expanded (a grid of 10^9 cells would be).
    unsound = {f.where for f in findings if f.code in ("schema", "tiling")}
    expected = file_keys(manifest.tensors, skip=unsound)
    keys = KeyIndex(manifest.tensors, skip=unsound)
    # The keys of an unsound tensor are not checked against headers (it is reported already).
    unchecked = {k for fqn in unsound if fqn in manifest.tensors for k in spec_keys(manifest.tensors[fqn])}
    present = []
    for index, entry in files:
        problem = _file_findings(loc, manifest, index, expected.get(index, {}), keys, unchecked)
        findings += problem
        if not problem:
            present.append(index)
    findings += _stray_findings(loc, manifest)
    hashed = 0
    if not quick:
        own = share(manifest, present, coll.world_size)[coll.rank]
        outcome = guard(lambda: checksum_findings(loc, manifest, own, max(1, workers), progress))
        if coll.world_size > 1:
            outcomes = coll.gather(outcome)
            outcome = coll.broadcast(_merged(outcomes, manifest, present) if outcomes is not None else None)
        found, hashed = unwrap(outcome)
        findings += found
    if findings and removed(loc):  # removed meanwhile: that, not damage
        raise removed_error(loc)
    return _report(loc, quick, findings, len(files), hashed, len(manifest.tensors))


def share(manifest: Manifest, files: list[int], ranks: int) -> list[list[int]]:
    """Payload files `files` (indices) split among `ranks` by bytes (pure): largest first, each to
    the rank holding the fewest bytes so far (the lowest rank of those); each share in file order."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    held = [0] * ranks
    for index in sorted(files, key=lambda i: (-manifest.files[i].size, i)):
        rank = min(range(ranks), key=lambda r: (held[r], r))
        shares[rank].append(index)
        held[rank] += manifest.files[index].size
    return [sorted(s) for s in shares]


def _merged(outcomes: list[tuple[str, Any]], manifest: Manifest, files: list[int]) -> tuple[str, Any]:
    """The ranks' checksum outcomes as one process's: findings in file order, bytes summed, or the first error."""
    failed = [o for o in outcomes if o[0] != "ok"]
    if failed:
        return failed[0]
    order = {manifest.files[i].where(): n for n, i in enumerate(files)}
    found = sorted((f for _, (fs, _) in outcomes for f in fs), key=lambda f: order.get(f.where, len(order)))
    return ("ok", (found, sum(h for _, (_, h) in outcomes)))


def _foreign(exc: ForeignCheckpointError, quick: bool) -> VerifyReport:
    from .convert import detect_format, survey  # the adapters' readers, imported only for another tool's checkpoint

    fmt = None
    try:
        fmt = detect_format(exc.path)
        found = survey(exc.path, source_format=fmt, read=not quick)
    except CkptkitError as error:
        code = "integrity" if isinstance(error, IntegrityError) else "metadata"
        return VerifyReport(source=exc.path, ok=False, quick=quick, files=0, bytes_read=0, tensors=0,
                            findings=[FindingModel(code=code, where=exc.path, message=str(error).removeprefix(f"{exc.path}: "))],
                            read_through=fmt)
    return VerifyReport(source=exc.path, ok=True, quick=quick, files=found.files, bytes_read=found.bytes_read,
                        tensors=len(found.manifest.tensors), findings=[], read_through=found.format,
                        skipped=list(found.report.skipped))


def _manifest(loc: Location, findings: list[Finding]) -> Manifest | None:
    try:
        data = manifest_bytes(loc)
    except (StorageError, ManifestError) as exc:
        findings.append(Finding("manifest", MANIFEST_NAME, str(exc)))
        return None
    try:
        return parse_manifest(data, source=MANIFEST_NAME)
    except ManifestError as exc:
        findings.append(Finding("manifest", MANIFEST_NAME, str(exc).removeprefix(f"{MANIFEST_NAME}: ")))
        return None


def _file_findings(
    loc: Location, manifest: Manifest, index: int, expected: Keys, keys: KeyIndex, unchecked: set[str]
) -> list[Finding]:
    entry = manifest.files[index]
    key, where = loc.file_key(entry), entry.where()
    try:
        if not loc.storage.exists(key):
            return [Finding("missing", where, "file listed in the manifest does not exist")]
        size = loc.storage.size(key)
    except StorageError as exc:
        return [Finding("path", where, str(exc))]
    if size != entry.size:
        return [Finding("size", where, f"{size} bytes, manifest says {entry.size}")]
    if entry.role != "tensors":
        return []
    if entry.encoding == "raw":  # no header: its one shard's size is a manifest check (`_mapping_findings`)
        return []
    try:
        n = header_length(loc.storage.read(key, 0, 8), where=where)
        if 8 + n > size:
            raise IntegrityError(f"{where}: header of {n} bytes runs past the end of the file")
        header = parse_header(loc.storage.read(key, 8, n), where=where, file_size=size)
    except (IntegrityError, StorageError) as exc:
        return [Finding("header", where, str(exc).removeprefix(f"{where}: "))]
    missing = [f"tensor {k!r} (of {fqn}) is missing" for k, (_, _, fqn) in expected.items() if k not in header.entries]
    borrowed = entry.base is not None
    return [Finding("header", where, p) for p in missing + header_problems(header, index, keys, unchecked, borrowed=borrowed)]


def _stray_findings(loc: Location, manifest: Manifest) -> list[Finding]:
    listed = {e.path for e in manifest.files if e.base is None} | {MANIFEST_NAME}
    listed |= {e.path + SIDECAR_SUFFIX for e in manifest.files if e.base is None and e.sidecar()}
    try:
        keys = loc.storage.list(loc.name)
    except StorageError:
        return []
    head = loc.name + "/"
    used = {e.path.split("/")[0] for e in manifest.files if e.base is None}
    # an interrupted compaction's new files (`ckptkit.ops.compact`), an interrupted write's temporary
    # file: not damage, `ckptkit clean` removes them
    return [
        Finding("extra", k[len(head) :], "file is not listed in the manifest")
        for k in keys
        if k[len(head) :] not in listed and not WRITE_LEFTOVER.match(k[len(head) :])
        and not (COMPACT_LEFTOVER.match(k[len(head) :]) and k[len(head) :].split("/")[0] not in used)
    ]


def checksum_findings(
    loc: Location, manifest: Manifest, files: list[int], workers: int, progress: Callable[[int], None] | None
) -> tuple[list[Finding], int]:
    """Check the checksums of payload files `files` (indices): hash every file in order while
    `workers` threads read the next chunks ahead (bounded window); return findings and bytes hashed.

    A file with block checksums (schema 1.2) is checked block by block (what readers check);
    an older one against its whole-file checksum.
    """
    findings: list[Finding] = []
    hashers: dict[int, Hasher | BlockHasher] = {}
    for i in files:
        blocks = manifest.files[i].blocks
        try:
            hashers[i] = BlockHasher(blocks.size) if blocks is not None else hasher_for(manifest.files[i].checksum)
        except CkptkitError as exc:
            findings.append(Finding("checksum", manifest.files[i].where(), str(exc)))
    chunks = [(i, o, min(CHUNK, manifest.files[i].size - o)) for i in hashers for o in range(0, manifest.files[i].size, CHUNK)]
    failed: dict[int, str] = {}
    hashed = 0
    # Buffers are reused: fresh ones would cost a page fault per 4 KiB on every chunk.
    free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    for _ in range(workers + 2):
        free.put(bytearray(CHUNK))

    def read(chunk: tuple[int, int, int]) -> tuple[bytearray, str]:
        index, offset, length = chunk
        buffer = free.get()
        try:
            loc.storage.readinto(loc.file_key(manifest.files[index]), offset, memoryview(buffer)[:length])
        except StorageError as exc:
            return buffer, str(exc)
        return buffer, ""

    for (index, _, length), (buffer, error) in zip(chunks, _read_ahead(read, chunks, workers)):
        if error and index not in failed:
            failed[index] = error
        if index not in failed:
            hashers[index].update(memoryview(buffer)[:length])
            hashed += length
            if progress is not None:
                progress(length)
        free.put(buffer)
    for index, hasher in hashers.items():
        entry = manifest.files[index]
        if index in failed:
            findings.append(Finding("checksum", entry.where(), f"cannot read: {failed[index]}"))
        elif isinstance(hasher, BlockHasher):
            try:
                expected = block_digests(loc.storage, loc.file_key(entry), entry, entry.where())
            except IntegrityError as exc:
                findings.append(Finding("checksum", entry.where(), str(exc)))
                continue
            findings += _block_findings(entry, hasher.finish(), expected)
        elif hasher.digest() != entry.checksum:
            findings.append(
                Finding("checksum", entry.where(), f"content hashes to {hasher.digest()}, manifest says {entry.checksum}")
            )
    order = {manifest.files[i].where(): n for n, i in enumerate(files)}
    return sorted(findings, key=lambda f: order.get(f.where, len(order))), hashed  # file by file, as a split run merges them


def _block_findings(entry: FileEntry, digests: bytes, expected: bytes) -> list[Finding]:
    assert entry.blocks is not None
    bad = [i for i in range(0, max(len(digests), len(expected)), 8) if digests[i : i + 8] != expected[i : i + 8]]
    if not bad:
        return []
    size = entry.blocks.size
    first = bad[0] // 8
    return [Finding("checksum", entry.where(), f"{len(bad)} block(s) of {size} bytes do not match their checksums, "
                                            f"the first at bytes {first * size} to {min((first + 1) * size, entry.size)}")]


def _read_ahead(fn: Callable[[Any], Any], items: list[Any], workers: int) -> Iterator[Any]:
    """Yield fn(item) for every item in order, running up to workers + 2 calls ahead on threads."""
    window = workers + 2
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future[Any]] = deque(pool.submit(fn, item) for item in items[:window])
        rest = iter(items[window:])
        while pending:
            result = pending.popleft().result()
            nxt = next(rest, None)
            if nxt is not None:
                pending.append(pool.submit(fn, nxt))
            yield result


def _report(loc: Location, quick: bool, findings: list[Finding], files: int, hashed: int, tensors: int) -> VerifyReport:
    return VerifyReport(
        source=str(loc),
        ok=not findings,
        quick=quick,
        files=files,
        bytes_read=hashed,
        tensors=tensors,
        findings=[FindingModel(code=f.code, where=f.where, message=f.message) for f in findings],
    )
