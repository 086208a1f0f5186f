"""Load a checkpoint: whole tensors in one process, or exactly the boxes of ShardedTensor targets."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any

import torch

from .boxes import Runs, byte_runs
from .catalog import Location
from .dtypes import itemsize
from .errors import IntegrityError, LayoutError
from .manifest import Manifest
from .planner import LoadPlan, plan_load
from .checksum import hasher_for
from .payload import Headers, header_entry, open_checkpoint, read_header
from .sharded import ShardedTensor
from .storage import Storage
from .torch_io import byte_view, is_leaf, leaf_shards, torch_dtype
from .tree import flatten, unflatten

# Reads run on this many threads; a long contiguous read is cut into pieces of PIECE bytes so that
# page faults in fresh tensors, waits on the disk and checksumming overlap.
READ_THREADS = 4
PIECE = 16 << 20

def load(
    path: str | os.PathLike[str], target: Mapping[str, Any] | None = None, *, storage: Storage | None = None
) -> dict[str, Any]:
    """Load a committed checkpoint (or the one a root's ``latest`` names).

    Without `target`, return the saved nested dict with every tensor whole. With `target`
    (a nested dict like the one saved), fill each of its tensors in place: a plain tensor
    receives the whole tensor, a ``ShardedTensor`` (or list of them) exactly its box,
    whatever sharding the checkpoint was written with; only the needed byte ranges are read.
    Returns the target's structure with its tensors, plus every non-tensor value saved.
    With `storage`, `path` is the checkpoint's name under that backend's root (or ``latest``).

    Every payload file whose tensor bytes are all read (as in a whole load) is also checked
    against its checksum, from the bytes read anyway; partial reads skip that check (run
    ``ckptkit verify`` to check everything).

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest is malformed or of a newer schema.
        IntegrityError: payload files disagree with the manifest.
        LayoutError: a target tensor is missing from the checkpoint or has another shape or dtype.
    """
    loc, manifest = open_checkpoint(path, storage)
    if target is None:
        tensors = {
            fqn: torch.empty(entry.shape, dtype=torch_dtype(entry.dtype)) for fqn, entry in manifest.tensors.items()
        }
        pieces = {fqn: [ShardedTensor(t, t.shape, (0,) * t.dim())] for fqn, t in tensors.items()}
        leaves: dict[str, Any] = dict(tensors)
    else:
        leaves, _ = flatten(target, is_leaf)
        pieces = {fqn: leaf_shards(leaf) for fqn, leaf in leaves.items()}
    fill(loc, manifest, pieces)
    return unflatten({**manifest.objects, **leaves})


def fill(
    loc: Location, manifest: Manifest, pieces: Mapping[str, list[ShardedTensor]], headers: Headers | None = None
) -> None:
    """Fill every ShardedTensor of `pieces` (by fqn) in place with its box of the checkpoint.

    `headers` caches the checked payload headers (by file index) across calls.
    """
    _check_targets(manifest, pieces)
    requests = [(fqn, p.box) for fqn, ps in pieces.items() for p in ps]
    plan = plan_load(manifest, requests)
    _execute(loc, manifest, plan, [p.local for ps in pieces.values() for p in ps], {} if headers is None else headers)


def read_tensor(loc: Location, manifest: Manifest, fqn: str, headers: Headers | None = None) -> torch.Tensor:
    """Return the whole tensor `fqn` of the checkpoint, read from whatever shards hold it."""
    entry = manifest.tensors[fqn]
    out = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
    fill(loc, manifest, {fqn: [ShardedTensor(out, tuple(out.shape), (0,) * out.dim())]}, headers)
    return out


def _check_targets(manifest: Manifest, pieces: Mapping[str, list[ShardedTensor]]) -> None:
    problems = []
    for fqn, ps in pieces.items():
        entry = manifest.tensors.get(fqn)
        if entry is None:
            problems.append(f"{fqn}: not in the checkpoint")
            continue
        for p in ps:
            if tuple(p.global_shape) != entry.shape:
                problems.append(f"{fqn}: target global shape {list(p.global_shape)}, checkpoint {list(entry.shape)}")
            if p.local.dtype != torch_dtype(entry.dtype):
                problems.append(f"{fqn}: target dtype {p.local.dtype}, checkpoint {entry.dtype}")
    if problems:
        raise LayoutError(f"cannot load into target: {len(problems)} problem(s): " + "; ".join(problems[:20]))


def _execute(loc: Location, manifest: Manifest, plan: LoadPlan, outputs: list[torch.Tensor], headers: Headers) -> None:
    """Run the plan's reads on a few threads, in file and offset order; check the checksum of every
    file read whole, from the bytes read (hashing overlaps the reads still in flight)."""
    for i in plan.files():
        if i not in headers:
            headers[i] = read_header(loc, manifest, i)
    jobs = []
    for target, out in zip(plan.targets, outputs):
        dtype = manifest.tensors[target.fqn].dtype
        for read in target.reads:
            entry = header_entry(loc, manifest, headers[read.file][0], read, dtype)
            runs = byte_runs(read.src_box, read.overlap, itemsize(dtype))
            jobs.append((read.file, entry.begin + runs.start, entry.begin, runs, read, target.box, out))
    jobs.sort(key=lambda j: (j[0], j[1]))
    checks = _whole_file_checks(manifest, headers, jobs)
    tasks: list[tuple[int, str, list[tuple[int, memoryview]]]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for file, _, begin, runs, read, box, out in jobs:
        dest = out[read.overlap.shifted(box.offsets).slices()] if out.dim() else out
        # Runs concatenated in order are the overlap in row-major order: read them straight into a
        # contiguous destination, else into one buffer of exactly the needed bytes. Never read more.
        buf = dest if dest.is_contiguous() else torch.empty(read.overlap.lengths, dtype=out.dtype)
        if buf is not dest:
            copies.append((buf, dest))
        key = loc.key(manifest.files[file].path)
        for pieces in _pieces(begin, runs, byte_view(buf)):
            tasks.append((file, key, pieces))
    with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
        done = pool.map(lambda t: _read_pieces(loc.storage, t[1], t[2]), tasks)
        for (file, _, pieces), _ in zip(tasks, done):
            check = checks.get(file)
            if check is not None:
                for offset, view in pieces:
                    check.feed(offset, view)
    for buf, dest in copies:
        dest.copy_(buf)
    for file, check in checks.items():
        check.finish(f"{loc}/{manifest.files[file].path}")


def _pieces(begin: int, runs: Runs, view: memoryview) -> list[list[tuple[int, memoryview]]]:
    """Cut one read into tasks of (file offset, destination bytes): a long single run into pieces
    that threads read in parallel, many short runs into one task."""
    if runs.n_runs == 1:
        start = begin + runs.start
        return [[(start + o, view[o : o + PIECE])] for o in range(0, max(len(view), 1), PIECE)]
    pieces = []
    pos = 0
    for offset in runs.offsets():
        pieces.append((begin + offset, view[pos : pos + runs.run_length]))
        pos += runs.run_length
    return [pieces]


def _read_pieces(storage: Storage, key: str, pieces: list[tuple[int, memoryview]]) -> None:
    for offset, view in pieces:
        storage.readinto(key, offset, view)


class _FileCheck:
    """Hash a payload file from the pieces a load reads anyway, when they cover it whole.

    Pieces may arrive out of order; those ahead of the hashed prefix wait (as views, no copy).
    """

    def __init__(self, checksum: str, size: int, prefix: bytes) -> None:
        self.expected = checksum
        self.size = size
        self.hasher = hasher_for(checksum)
        self.hasher.update(prefix)
        self.pos = len(prefix)
        self.pending: dict[int, memoryview] = {}

    def feed(self, offset: int, view: memoryview) -> None:
        if offset != self.pos:
            self.pending[offset] = view
            return
        self.hasher.update(view)
        self.pos += len(view)
        while self.pos in self.pending:
            nxt = self.pending.pop(self.pos)
            self.hasher.update(nxt)
            self.pos += len(nxt)

    def finish(self, where: str) -> None:
        digest = self.hasher.digest()
        if self.pos != self.size or digest != self.expected:
            raise IntegrityError(
                f"{where}: checksum mismatch: content hashes to {digest}, manifest says {self.expected}"
            )


def _whole_file_checks(
    manifest: Manifest, headers: Headers, jobs: list[Any]
) -> dict[int, _FileCheck]:
    """Return a checksum check for every file whose tensor bytes the jobs read exactly once, all of them."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for file, _, begin, runs, *_ in jobs:
        spans.setdefault(file, []).extend((begin + o, begin + o + runs.run_length) for o in runs.offsets())
    checks = {}
    for file, intervals in spans.items():
        header, prefix = headers[file]
        intervals.sort()
        position = header.data_start
        for lo, hi in intervals:
            if lo != position:
                break
            position = hi
        else:
            if position == manifest.files[file].size:
                entry = manifest.files[file]
                checks[file] = _FileCheck(entry.checksum, entry.size, prefix)
    return checks
