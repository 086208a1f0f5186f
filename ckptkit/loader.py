"""Load a checkpoint: whole tensors in one process, or exactly the boxes of ShardedTensor targets."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from .boxes import Box, byte_runs
from .catalog import Location, read_manifest, resolve
from .consistency import manifest_findings
from .dtypes import itemsize
from .errors import IntegrityError, LayoutError, ManifestError
from .manifest import Manifest
from .planner import LoadPlan, Read, plan_load
from .safetensors_format import Header, header_length, parse_header
from .sharded import ShardedTensor
from .storage import Storage
from .torch_io import byte_view, is_leaf, leaf_shards, torch_dtype
from .tree import flatten, unflatten

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

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest is malformed or of a newer schema.
        IntegrityError: payload files disagree with the manifest.
        LayoutError: a target tensor is missing from the checkpoint or has another shape or dtype.
    """
    loc = resolve(path, storage)
    manifest = read_manifest(loc)
    findings = manifest_findings(manifest)
    if findings:
        raise ManifestError(f"{loc}: manifest is inconsistent: " + "; ".join(str(f) for f in findings[:10]))
    if target is None:
        tensors = {
            fqn: torch.empty(entry.shape, dtype=torch_dtype(entry.dtype)) for fqn, entry in manifest.tensors.items()
        }
        pieces = {fqn: [ShardedTensor(t, t.shape, (0,) * t.dim())] for fqn, t in tensors.items()}
        leaves: dict[str, Any] = dict(tensors)
    else:
        leaves, _ = flatten(target, is_leaf)
        pieces = {fqn: leaf_shards(leaf) for fqn, leaf in leaves.items()}
        _check_targets(manifest, pieces)
    requests = [(fqn, p.box) for fqn, ps in pieces.items() for p in ps]
    plan = plan_load(manifest, requests)
    _execute(loc, manifest, plan, [p.local for ps in pieces.values() for p in ps])
    return unflatten({**manifest.objects, **leaves})


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


def _execute(loc: Location, manifest: Manifest, plan: LoadPlan, outputs: list[torch.Tensor]) -> None:
    headers = {i: _read_header(loc, manifest, i) for i in plan.files()}
    for target, out in zip(plan.targets, outputs):
        dtype = manifest.tensors[target.fqn].dtype
        for read in sorted(target.reads, key=lambda r: (r.file, r.src_box.offsets)):
            _copy(loc, manifest, headers[read.file], read, target.box, out, dtype)


def _read_header(loc: Location, manifest: Manifest, index: int) -> Header:
    entry = manifest.files[index]
    key = loc.key(entry.path)
    where = f"{loc}/{entry.path}"
    size = loc.storage.size(key)
    if size != entry.size:
        raise IntegrityError(f"{where}: {size} bytes, manifest says {entry.size} (truncated or replaced?)")
    n = header_length(loc.storage.read(key, 0, 8), where=where)
    if 8 + n > size:
        raise IntegrityError(f"{where}: header of {n} bytes runs past the end of the file")
    return parse_header(loc.storage.read(key, 8, n), where=where, file_size=size)


def _copy(
    loc: Location, manifest: Manifest, header: Header, read: Read, box: Box, out: torch.Tensor, dtype: str
) -> None:
    path = manifest.files[read.file].path
    entry = header.entries.get(read.key)
    if entry is None or entry.shape != read.src_box.lengths or entry.dtype != dtype:
        found = "missing" if entry is None else f"{entry.dtype}{list(entry.shape)}"
        raise IntegrityError(
            f"{loc}/{path}: tensor {read.key!r} is {found}, manifest says {dtype}{list(read.src_box.lengths)}"
        )
    key = loc.key(path)
    runs = byte_runs(read.src_box, read.overlap, itemsize(dtype))
    dest = out[read.overlap.shifted(box.offsets).slices()] if out.dim() else out
    # Runs concatenated in order are the overlap in row-major order: read them straight into a
    # contiguous destination, else into one buffer of exactly the needed bytes. Never read more.
    buf = dest if dest.is_contiguous() else torch.empty(read.overlap.lengths, dtype=out.dtype)
    view = byte_view(buf)
    if runs.n_runs == 1:
        loc.storage.readinto(key, entry.begin + runs.start, view)
    else:
        pos = 0
        for offset in runs.offsets():
            loc.storage.readinto(key, entry.begin + offset, view[pos : pos + runs.run_length])
            pos += runs.run_length
    if buf is not dest:
        dest.copy_(buf)
