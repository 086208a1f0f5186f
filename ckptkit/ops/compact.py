"""Compact an incremental checkpoint: rewrite it as a full one, in place, crash-safe (no torch).

A checkpoint of an incremental save reads files of earlier checkpoints and applies patches; its
restore reads its whole chain. `compact` writes every box whole (patches applied) into new files
under ``NAME/.compact-<id>/``, each checked on the way as any read is, then replaces the manifest
in one atomic write. The checkpoint keeps its name, step and content; it refers to no earlier
checkpoint any more, so retention may release them. Its own earlier files stay, listed with the
role ``kept``, for the later checkpoints that read them. Until the manifest is replaced nothing
a reader sees has changed; a compaction cut off before that leaves its ``.compact-<id>``
folder, which `verify` does not count as damage and ``ckptkit clean`` removes.
"""

from __future__ import annotations

import os
import uuid
from collections import defaultdict
from collections.abc import Iterator

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict

from ..io.catalog import COMPACT_PREFIX as PREFIX, Location, still_committed
from ..io.leases import lease
from ..io.payload import open_checkpoint
from ..io.read import Reader, byte_shape
from ..io.write import write_safetensors
from ..manifest import FileEntry, Manifest, manifest_to_json
from ..manifest.dtypes import itemsize
from ..manifest.model import Shard
from ..manifest.shards import compact_shards, iter_shards
from ..plan.incremental import DIGEST
from ..plan.load import plan_load
from ..storage import Storage

FILE_BYTES = 1 << 30  # new files are cut at this size


class CompactReport(BaseModel):
    """What ``ckptkit compact --json`` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    checkpoint: str
    step: int
    compacted: bool  # False: it was a full checkpoint already, nothing written
    bases_before: list[str]  # the earlier checkpoints it read files of
    patches_before: int
    files_written: int
    bytes_written: int
    kept_files: int  # its own earlier files, kept for the later checkpoints that read them


def compact(path: str | os.PathLike[str], *, storage: Storage | None = None) -> CompactReport:
    """Rewrite the committed checkpoint at `path` as a full one, in place (see the module).

    Raises:
        CheckpointNotFoundError: nothing committed at `path`, or retention removed it meanwhile.
        IntegrityError: a byte read does not match its checksum (nothing is replaced).
        StorageError: a write failed (nothing is replaced).
    """
    loc, manifest = open_checkpoint(path, storage)
    patches = sum(len(t.patches) for t in manifest.tensors.values())
    if not manifest.bases() and not patches:
        return CompactReport(checkpoint=str(loc), step=manifest.step, compacted=False, bases_before=[], patches_before=0,
                             files_written=0, bytes_written=0, kept_files=0)
    with lease(loc.storage, loc.name), still_committed(loc):
        target, written = _rewritten(loc, manifest, PREFIX + uuid.uuid4().hex[:12])
        loc.storage.write(loc.key("manifest.json"), [manifest_to_json(target)])
    return CompactReport(checkpoint=str(loc), step=manifest.step, compacted=True, bases_before=list(manifest.bases()),
                         patches_before=patches, files_written=len(written), bytes_written=sum(f.size for f in written),
                         kept_files=sum(1 for f in target.files if f.role == "kept"))


def _rewritten(loc: Location, manifest: Manifest, folder: str) -> tuple[Manifest, list[FileEntry]]:
    """Write every box of `manifest` whole under `folder`; return the manifest of the result and
    the files written."""
    reader = Reader(loc, manifest)
    groups: list[list[tuple[str, Shard]]] = [[]]
    size = 0
    for fqn, entry in sorted(manifest.tensors.items()):
        for shard in iter_shards(entry):
            nbytes = shard.box.volume * itemsize(entry.dtype)
            if groups[-1] and size + nbytes > FILE_BYTES:
                groups.append([])
                size = 0
            groups[-1].append((fqn, shard))
            size += nbytes
    written: list[FileEntry] = []
    shards: dict[str, list[Shard]] = defaultdict(list)
    for n, group in enumerate(g for g in groups if g):
        path = f"{folder}/part{n:05d}.safetensors"
        seen: dict[str, int] = defaultdict(int)
        keyed = []
        for fqn, shard in sorted(group, key=lambda p: -itemsize(manifest.tensors[p[0]].dtype)):  # aligned to their sizes
            k = seen[fqn]
            seen[fqn] += 1
            keyed.append((fqn, shard, fqn if k == 0 else f"{fqn}#{k}"))
        digests: dict[str, str] = {}

        def bodies(keyed: list[tuple[str, Shard, str]] = keyed, digests: dict[str, str] = digests) -> Iterator[memoryview]:
            for fqn, shard, key in keyed:
                entry = manifest.tensors[fqn]
                out = np.empty(byte_shape(shard.box.lengths, itemsize(entry.dtype)), np.uint8)
                reader.fill(plan_load(manifest, [(fqn, shard.box)]).targets, [out])
                data = out.reshape(-1).data
                digests[key] = DIGEST + xxhash.xxh3_128_hexdigest(data)
                yield data

        file = write_safetensors(loc.storage, loc.key(path), path,
                                 [(key, manifest.tensors[fqn].dtype, shard.box.lengths) for fqn, shard, key in keyed], bodies())
        index = len(written)
        written.append(file.entry().model_copy(update={"contents": digests}))
        for fqn, shard, key in keyed:
            shards[fqn].append(Shard(shard.box, index, key))
    kept = [f.model_copy(update={"role": "kept", "contents": None}) for f in manifest.files
            if f.base is None and f.role in ("tensors", "kept")]
    others = [f for f in manifest.files if f.role in ("tokenizer", "asset", "format") and f.base is None]
    tensors = {fqn: e.model_copy(update={"shards": compact_shards(e.shape, shards[fqn]), "patches": ()})
               for fqn, e in manifest.tensors.items()}
    return manifest.model_copy(update={"files": (*written, *others, *kept), "tensors": tensors, "derived": None}), written


__all__ = ["PREFIX", "CompactReport", "compact"]
