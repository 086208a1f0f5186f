"""Load a checkpoint: whole tensors in one process, or exactly the boxes of ShardedTensor targets."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any

import torch

from ..io.catalog import Location, still_committed
from ..errors import LayoutError, summarize
from ..state.mapped import can_map, map_files, tensor_of
from ..io.read import Reader
from ..boxes import Box
from ..manifest import Manifest
from ..plan.load import plan_load
from ..io.payload import open_checkpoint
from ..state.device import DEFAULT_PINNED_BYTES, BouncePool, device_problems, load_through
from ..state.host_memory import host_empty
from ..state.sharded import ShardedTensor
from ..storage import Storage
from ..state.torch_io import byte_array, is_leaf, leaf_shards, torch_dtype
from ..state.tree import flatten, from_json, unflatten

# Reads run on this many threads (the engine cuts long reads into pieces), so that page faults
# in fresh tensors, waits on the disk and checksumming overlap.
READ_THREADS = 4

class Checkpoint:
    """A committed checkpoint opened once: its checked manifest, and loads that share the checked
    payload headers (what a trainer resuming reads: the manifest's metadata, then its tensors)."""

    def __init__(self, location: Location, manifest: Manifest) -> None:
        self.location = location
        self.manifest = manifest
        self._reader = Reader(location, manifest)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.location)!r}, step={self.manifest.step})"

    def load(self, target: Mapping[str, Any] | None = None, *, pinned_bytes: int = DEFAULT_PINNED_BYTES,
             mapped: bool = False) -> dict[str, Any]:
        """Load the checkpoint, whole or into `target`; see :func:`ckptkit.load`."""
        manifest = self.manifest
        if mapped and target is not None:
            raise ValueError("mapped=True returns new tensors that map the checkpoint's files: give no target")
        with still_committed(self.location):
            if target is None:
                self._reader.open_files_of(manifest.tensors)  # every payload file, those of empty tensors included
                views = self._mapped_views() if mapped else {}
                tensors = {fqn: host_empty(entry.shape, torch_dtype(entry.dtype))
                           for fqn, entry in manifest.tensors.items() if fqn not in views}
                pieces = {fqn: [ShardedTensor(t, t.shape, (0,) * t.dim())] for fqn, t in tensors.items()}
                leaves: dict[str, Any] = {fqn: views[fqn] if fqn in views else tensors[fqn] for fqn in manifest.tensors}
            else:
                leaves, _ = flatten(target, is_leaf)
                pieces = {fqn: leaf_shards(leaf) for fqn, leaf in leaves.items()}
            fill(self._reader, pieces, pinned_bytes=pinned_bytes)
        return unflatten({**{k: from_json(v) for k, v in manifest.objects.items()}, **leaves})

    def _mapped_views(self) -> dict[str, torch.Tensor]:
        """The tensors a mapped load maps (``ckptkit.state.mapped``), by name: their files mapped,
        locked and checked whole."""
        reader, manifest = self._reader, self.manifest
        plan = plan_load(manifest, [(fqn, Box((0,) * len(e.shape), e.shape)) for fqn, e in manifest.tensors.items()])
        targets = [t for t in plan.targets if can_map(reader, t)]
        with ThreadPoolExecutor(max_workers=READ_THREADS) as threads:
            files = map_files(reader, sorted({t.reads[0].file for t in targets}), threads)
        return {t.fqn: tensor_of(reader, files, t, torch_dtype(manifest.tensors[t.fqn].dtype)) for t in targets}


def open(path: str | os.PathLike[str], *, storage: Storage | None = None) -> Checkpoint:  # noqa: A001
    """Open the committed checkpoint at `path` (or the one a root's ``latest`` names): read and
    check its manifest once; load from it with ``.load(target)``.

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest is malformed or of a newer schema.
    """
    return Checkpoint(*open_checkpoint(path, storage))


def load(
    path: str | os.PathLike[str], target: Mapping[str, Any] | None = None, *, storage: Storage | None = None,
    pinned_bytes: int = DEFAULT_PINNED_BYTES, mapped: bool = False,
) -> dict[str, Any]:
    """Load a committed checkpoint (or the one a root's ``latest`` names).

    Without `target`, return the saved nested dict with every tensor whole. With `target`
    (a nested dict like the one saved), fill each of its tensors in place: a plain tensor
    receives the whole tensor, a ``ShardedTensor`` (or list of them) exactly its box,
    whatever sharding the checkpoint was written with; only the needed byte ranges are read.
    Returns the target's structure with its tensors, plus every non-tensor value saved.
    With `storage`, `path` is the checkpoint's name under that backend's root (or ``latest``).

    Target tensors may be on the CPU or on CUDA devices, mixed. Bytes for CUDA targets are read
    into a small pool of reused pinned host buffers (at most `pinned_bytes` in all, 1 GiB by
    default) and copied to the device on a side stream while the next bytes are read; a target
    larger than one buffer (a quarter of the pool) is read in chunks along its leading dim. The
    host never holds a whole copy of the state. Every copy has finished when the call returns.

    Every byte returned is checked against the payload's block checksums (reading whole the
    blocks at the ends of each range); a checkpoint written before block checksums (schema 1.1
    and older) is checked file by file where a load reads all of a file's tensor bytes.

    With ``mapped=True`` (no `target`), each tensor held whole by one shard of a local payload
    file is instead a view of that file, mapped copy-on-write: no new memory, no copy. Every
    block of a mapped file is checked through the mapping before the call returns, its pages
    locked in memory first so that none is read again from disk unchecked (where locking is
    refused, for want of ``CAP_IPC_LOCK`` or ``RLIMIT_MEMLOCK``, the load warns with
    ``ckptkit.state.mapped.UnlockedWarning`` and goes on). Writing to such a tensor copies the page
    written; the file never changes. Other tensors (on S3, cut over several shards, patched) are
    read as without it. See ``ckptkit.state.mapped``.

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest is malformed or of a newer schema.
        IntegrityError: payload files disagree with the manifest.
        LayoutError: a target tensor is missing from the checkpoint, has another shape or dtype,
            or is on a device other than cpu and cuda (or on cuda where CUDA is not available).
        ValueError: ``mapped=True`` with a `target`.
    """
    return open(path, storage=storage).load(target, pinned_bytes=pinned_bytes, mapped=mapped)


def fill(
    reader: Reader, pieces: Mapping[str, list[ShardedTensor]], *, pinned_bytes: int = DEFAULT_PINNED_BYTES,
    pool: BouncePool | None = None,
) -> None:
    """Fill every ShardedTensor of `pieces` (by fqn) in place with its box of the checkpoint
    `reader` reads (reuse one reader across calls: it keeps the checked headers).

    CPU tensors are read into directly; CUDA tensors through `pool` (default: a new pool of
    `pinned_bytes`, allocated only when a target is on CUDA), see :func:`ckptkit.load`.

    Raises:
        LayoutError: a target tensor is missing from the checkpoint, has another shape or dtype,
            or is on a device ckptkit cannot load into.
        IntegrityError: a payload file or a byte read does not match the manifest.
    """
    _check_targets(reader.manifest, pieces)
    host = {fqn: [p for p in ps if p.local.device.type == "cpu"] for fqn, ps in pieces.items()}
    device = [(fqn, p) for fqn, ps in pieces.items() for p in ps if p.local.device.type != "cpu"]
    with ThreadPoolExecutor(max_workers=READ_THREADS) as threads:
        _fill_host(reader, host, threads)
        if device:
            moving = sum(p.local.numel() * p.local.element_size() for _, p in device)
            load_through(reader, device, pool or BouncePool(pinned_bytes, moving=moving), threads=threads)


def _fill_host(reader: Reader, pieces: Mapping[str, list[ShardedTensor]], threads: ThreadPoolExecutor) -> None:
    flat = [p for ps in pieces.values() for p in ps]
    plan = plan_load(reader.manifest, [(fqn, p.box) for fqn, ps in pieces.items() for p in ps])
    dests = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p in flat:
        out = p.local
        if not out.is_contiguous():  # read into a contiguous buffer of exactly the box, then copy
            out = host_empty(out.shape, out.dtype)
            copies.append((out, p.local))
        dests.append(byte_array(out))
    reader.fill(plan.targets, dests, pool=threads)
    with torch.no_grad():  # a target may be a parameter
        for buf, dest in copies:
            dest.copy_(buf)


def _check_targets(manifest: Manifest, pieces: Mapping[str, list[ShardedTensor]]) -> None:
    problems = device_problems((fqn, p.local.device) for fqn, ps in pieces.items() for p in ps)
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
        raise LayoutError(f"cannot load into target: {len(problems)} problem(s): " + summarize(problems))
