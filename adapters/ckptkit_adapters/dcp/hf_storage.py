"""Read a torch DCP save written with ``HuggingFaceStorageWriter`` as DCP metadata (no torch).

Such a save has no ``.metadata``: its ``*.safetensors`` files say it all. Each file's header
metadata holds ``DCP_SHARDING_INFO``, a JSON object giving, for every tensor entry of the file,
the offsets of that chunk in its tensor (``saved_offsets``). A consolidated save (the default,
or ``enable_consolidation``) holds whole tensors at offsets 0 in ``model-0000k-of-0000n``
files; a distributed one (``save_distributed``) one chunk per rank and tensor in
``shard-0000r-model-...`` files. The format records no global shapes: a tensor's shape is where
its chunks end (as torch's own reader infers it), so a missing file whose chunks end a tensor
cannot be told from a smaller tensor; gaps and overlaps are found by the tiling check.

`read_safetensors_save` gives the `DcpMetadata` the ``dcp`` converter plans from: chunks as
raw byte ranges (`StorageRef.raw`), dtypes from the safetensors headers.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit_adapters.common.dcp_metadata import METADATA_NAME, Chunk, DcpMetadata, StorageKey, StorageRef, TensorMeta
from ckptkit_adapters.common.files import safetensors_header
from ckptkit_adapters.common.torchsave import TorchDtype

SHARDING_INFO = "DCP_SHARDING_INFO"


def is_safetensors_save(path: str) -> bool:
    """Whether `path` is a ``HuggingFaceStorageWriter`` save: safetensors files whose headers
    carry DCP's sharding info, and no ``.metadata`` or ``config.json`` (a model directory)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return False
    files = [n for n in names if n.endswith(".safetensors")]
    if not files or METADATA_NAME in names or "config.json" in names:
        return False
    try:
        return SHARDING_INFO in safetensors_header(os.path.join(path, files[0])).metadata
    except (IntegrityError, OSError, ValueError):
        return False


def read_safetensors_save(path: str) -> DcpMetadata:
    """Read every safetensors file of the save at `path` into DCP metadata.

    Raises:
        ManifestError: a file without DCP's sharding info, or info that does not describe its
            entries (offsets missing or of the wrong length), a tensor saved with two dtypes.
        IntegrityError: a file with a malformed or truncated header; the same chunk twice.
    """
    chunks: dict[str, list[Chunk]] = defaultdict(list)
    dtypes: dict[str, set[str]] = defaultdict(set)
    storage: dict[StorageKey, StorageRef] = {}
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        where = os.path.join(path, name)
        header = safetensors_header(where)
        try:
            info = json.loads(header.metadata[SHARDING_INFO])
        except (KeyError, ValueError):
            raise ManifestError(f"{where}: no readable {SHARDING_INFO} in its header (not a file of this DCP save)") from None
        for key, entry in header.entries.items():
            offsets = (info.get(key) or {}).get("saved_offsets") if isinstance(info, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == len(entry.shape)
                    and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)):
                raise ManifestError(f"{where}: {SHARDING_INFO} gives no offsets of {len(entry.shape)} dims for {key!r}")
            index = (key, tuple(offsets))
            if index in storage:
                raise IntegrityError(f"{where}: {key} at {offsets} is saved twice (also in {storage[index].path})")
            chunks[key].append(Chunk(tuple(offsets), entry.shape))
            dtypes[key].add(entry.dtype)
            storage[index] = StorageRef(name, entry.begin, entry.end - entry.begin, (), raw=True)
    entries: dict[str, TensorMeta | None] = {}
    for key, pieces in chunks.items():
        if len(dtypes[key]) != 1:
            raise ManifestError(f"{path}: {key} is saved in several dtypes ({', '.join(sorted(dtypes[key]))})")
        entries[key] = TensorMeta(TorchDtype(next(iter(dtypes[key]))), _extent(pieces), tuple(pieces))
    return DcpMetadata(entries, storage, None)


def _extent(chunks: list[Chunk]) -> tuple[int, ...]:
    """A tensor's shape: where its chunks end, dim by dim."""
    return tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].offsets)))


__all__ = ["SHARDING_INFO", "is_safetensors_save", "read_safetensors_save"]
