"""The I/O of an incremental save (``ckptkit.save(..., incremental=True)``; the plan is
``ckptkit.plan.incremental``): the checkpoint it refers to, leased until the commit; on each rank,
each box hashed, a changed 16-bit box compared with the earlier checkpoint's to find the elements
that changed, and the rank's file of what changed written.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from ..boxes import Box
from ..errors import CheckpointNotFoundError, IntegrityError, ManifestError, StorageError
from ..io.catalog import Location, read_latest, read_manifest
from ..io.commit import Staging
from ..io.leases import lease
from ..io.read import Reader
from ..io.write import Written, write_safetensors
from ..manifest import FileEntry, Manifest
from ..manifest.dtypes import itemsize
from ..plan.incremental import DIGEST, Ask, Assembled, Held, Outcome, ask_of, asks_for, assemble, held_boxes
from ..plan.load import plan_load
from ..plan.save import FilePlan, SavePlan
from ..state.torch_io import byte_view, host_contiguous
from ..storage import Storage

_native: types.ModuleType | None
try:  # the compiled compare (_changed.c), built with the package where a C compiler was found
    from . import _changed as _native
except ImportError:  # the package was installed without a C compiler: numpy finds them
    _native = None


@dataclass(frozen=True, slots=True)
class Base:
    """The checkpoint an incremental save refers to: its name and manifest, and what it holds
    of each planned item (by rank, file, item)."""

    name: str
    manifest: Manifest
    held: list[list[list[Held | None]]]

    def asks(self, plan: SavePlan) -> list[tuple[str, list[list[Ask]]]]:
        """What each rank is told: the base's name and, for each of its items, what it holds."""
        return [(self.name, [[ask_of(item, h) for (item, _), h in zip(f.items, found)] for f, found in zip(files, held)])
                for files, held in zip(plan.files, self.held)]


def find_base(loc: Location, plan: SavePlan, stack: contextlib.ExitStack) -> Base | None:
    """The checkpoint the root's ``latest`` names, leased for as long as `stack` is open, with what
    it holds of the plan's items; None (a full save) when there is none, it is being deleted, or
    it cannot be read."""
    try:
        name = read_latest(loc.storage)
        if not name or name == loc.name:
            return None
        stack.enter_context(lease(loc.storage, name))
        manifest = read_manifest(Location(loc.storage, name))
    except (CheckpointNotFoundError, IntegrityError, ManifestError, StorageError):
        return None
    return Base(name, manifest, asks_for(plan, held_boxes(manifest, name)))


def no_base(plan: SavePlan) -> list[tuple[str, list[list[Ask]]]]:
    """What each rank is told when there is nothing to refer to: every item is written whole."""
    return [("", [[Ask(None)] * len(f.items) for f in files]) for files in plan.files]


def write_changed(
    storage: Storage, key: str, f: FilePlan, local: dict[tuple[str, Box], torch.Tensor], asks: Sequence[Ask],
    base: Reader | None,
) -> tuple[Written | None, Outcome]:
    """Hash each item of a planned file; write the file of the items that changed (whole, or as a
    patch over the base's box, `base` read for it); return it (None: nothing changed) and what
    was done with each item."""
    written: list[int] = []
    digests: dict[str, str] = {}
    unchanged: list[int] = []
    patched: list[tuple[int, int, str, str, str]] = []
    arrays: list[tuple[str, str, tuple[int, ...], memoryview]] = []
    for i, (item, name) in enumerate(f.items):
        data = byte_view(host_contiguous(local[(item.fqn, item.box)]))
        digest = DIGEST + xxhash.xxh3_128_hexdigest(data)
        ask = asks[i]
        if digest == ask.digest:
            unchanged.append(i)
            continue
        indices = _changed(base, item.fqn, item.box, data, ask.patch_budget) if ask.patch_budget and base is not None else None
        if indices is None:
            written.append(i)
            digests[name] = digest
            arrays.append((name, item.dtype, item.box.lengths, data))
            continue
        values = np.frombuffer(data, np.uint16)[indices]
        keys = (f"{name}@indices", f"{name}@values")
        arrays += [(keys[0], "uint32" if indices.dtype == np.uint32 else "int64", (len(indices),), indices.view(np.uint8).data),
                   (keys[1], item.dtype, (len(values),), values.view(np.uint8).data)]
        patched.append((i, len(indices), digest, *keys))
    outcome = Outcome(tuple(written), digests, tuple(unchanged), tuple(patched))
    if not arrays:
        return None, outcome
    arrays.sort(key=lambda a: -itemsize(a[1]))  # each array aligned to its element size in the file
    bodies: Iterator[memoryview] = (a[3] for a in arrays)
    return write_safetensors(storage, key, f.path, [(k, d, s) for k, d, s, _ in arrays], bodies), outcome


def _changed(base: Reader, fqn: str, box: Box, data: memoryview, budget: int) -> np.ndarray[Any, Any] | None:
    """The flat positions of the 16-bit elements of `data` that differ from the base's box, or
    None when they take more than `budget` bytes as a patch (the box is then written whole)."""
    before = np.empty(len(data), np.uint8)
    try:
        base.fill(plan_load(base.manifest, [(fqn, box)]).targets, [before.reshape(_byte_shape(box))])
    except (IntegrityError, StorageError, KeyError):  # the base cannot give its box: written whole
        return None
    return changed_positions(before, np.frombuffer(data, np.uint8), budget // (4 + 2), np.uint32 if box.volume <= 1 << 32 else np.int64)


def _byte_shape(box: Box) -> tuple[int, ...]:
    return (*box.lengths[:-1], box.lengths[-1] * 2) if box.ndim else (2,)


def changed_positions(before: np.ndarray[Any, Any], after: np.ndarray[Any, Any], limit: int,
                      dtype: type[np.integer[Any]] = np.int64) -> np.ndarray[Any, Any] | None:
    """List the positions of the 16-bit elements that differ between two byte arrays of equal
    length, rising, as `dtype` (np.uint32 or np.int64), or return None when there are more than
    `limit`.

    One pass over each array on the calling thread (no thread pool to contend for on a busy
    machine): the compiled loop where the package was built with it, else numpy."""
    n = len(before) // 2
    limit = min(limit, n)
    before, after = np.ascontiguousarray(before[: n * 2]), np.ascontiguousarray(after[: n * 2])  # views unless strided
    if _native is not None:
        out = np.empty(limit + 8, dtype)  # the loop's room: a block's 8 stores past the last position
        found = _native.positions(before, after, out, limit)
        return None if found < 0 else out[:found]
    return _numpy_positions(before, after, limit, dtype)


CHUNK_ELEMENTS = 1 << 18  # 512 KiB of each array compared at a time: the mask stays in cache (early exit past the limit)


def _numpy_positions(before: np.ndarray[Any, Any], after: np.ndarray[Any, Any], limit: int,
                     dtype: type[np.integer[Any]]) -> np.ndarray[Any, Any] | None:
    """`changed_positions` with numpy, over contiguous arrays of whole elements: chunk by chunk
    into one reused mask small enough to stay in cache, whose set positions are then listed
    (flatnonzero: about 15 ns a changed element of a random change, the branch on each element
    mispredicted)."""
    a16, b16 = before.view(np.uint16), after.view(np.uint16)
    n = len(a16)
    mask = np.empty(min(n, CHUNK_ELEMENTS), dtype=bool)
    parts: list[np.ndarray[Any, Any]] = []
    found = 0
    for lo in range(0, n, CHUNK_ELEMENTS):
        hi = min(n, lo + CHUNK_ELEMENTS)
        differ = mask[: hi - lo]
        np.not_equal(a16[lo:hi], b16[lo:hi], out=differ)
        at = np.flatnonzero(differ)
        if not len(at):
            continue
        found += len(at)
        if found > limit:
            return None
        parts.append((at + lo).astype(dtype, copy=False))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def assembled(results: list[Any], plan: SavePlan, stage: Staging, base: Base | None) -> Assembled:
    """An incremental save's files, shards and patches from what each rank wrote (rank 0)."""
    own: list[list[FileEntry | None]] = []
    outcomes: list[list[Outcome]] = []
    for rank, (_, done) in enumerate(results):
        own.append([None if written is None else written.entry(stage.path(plan.files[rank][n].path)).model_copy(
            update={"contents": outcome.digests}) for n, (written, outcome) in enumerate(done)])
        outcomes.append([outcome for _, outcome in done])
    held = base.held if base is not None else [[[None] * len(f.items) for f in files] for files in plan.files]
    return assemble(plan, own, outcomes, held)


def base_reader(storage: Storage, name: str) -> Reader | None:
    """A reader of the base `name` of the same root, for the boxes a rank compares (None when
    there is no base, or it cannot be read: changed boxes are then written whole)."""
    if not name:
        return None
    try:
        loc = Location(storage, name)
        return Reader(loc, read_manifest(loc))
    except (CheckpointNotFoundError, ManifestError, StorageError):
        return None


__all__ = ["Base", "assembled", "base_reader", "changed_positions", "find_base", "no_base", "write_changed"]
