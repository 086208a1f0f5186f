"""Read the ``.metadata`` file of a torch.distributed.checkpoint directory, safely.

The file is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``: every entry of the
flattened state dict (a tensor's dtype, global shape and chunks, or a BytesIO value) and where
each chunk or value is stored (``_StorageInfo``: file, offset, length). It is unpickled through
`safepickle` with exactly the classes that file needs, each replaced by a stand-in that runs
nothing; anything else is refused with an error naming the class. The stand-ins are then read
into the frozen dataclasses below, checking every field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from ckptkit.errors import ManifestError
from ckptkit_adapters.common.files import read_small
from ckptkit_adapters.common.safepickle import record_type, unpickle
from ckptkit_adapters.common.torchsave import OTHER_TORCH_DTYPES, TORCH_DTYPES, TorchDtype

METADATA_NAME = ".metadata"
# No .metadata past this size is read (a few hundred bytes per chunk: 10,000 tensors over
# 4,096 ranks stay far below it).
METADATA_LIMIT = 4 << 30

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_RECORDS = {
    name: record_type(f"{module}.{name}")
    for module, name in [
        (_MD, "Metadata"), (_MD, "TensorStorageMetadata"), (_MD, "BytesStorageMetadata"), (_MD, "ChunkStorageMetadata"),
        (_MD, "TensorProperties"), (_MD, "StorageMeta"), (_MD, "MetadataIndex"), (_FS, "_StorageInfo"),
    ]
}


def _size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size(dims)``, as a tuple of ints."""
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        raise ValueError(f"torch.Size of {dims!r}")
    return tuple(dims)


def _name(value: Any) -> str:
    """An enum member, layout or path rebuilt as plain data (never used beyond its check)."""
    return str(value)


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts)


# Everything a torch 2.x .metadata written by FileSystemWriter needs, and nothing else.
ALLOWED: dict[tuple[str, str], Any] = {
    **{(r.qualname.rsplit(".", 1)[0], name): r for name, r in _RECORDS.items()},
    (_MD, "_MEM_FORMAT_ENCODING"): _name,  # TensorProperties' (deprecated) memory format
    ("torch", "Size"): _size,
    ("torch.serialization", "_get_layout"): _name,  # TensorProperties' (deprecated) layout
    **{("torch", name): TorchDtype(name) for name in (*TORCH_DTYPES, *OTHER_TORCH_DTYPES)},
    # StorageMeta.checkpoint_id, when the save was given a path object
    **{(module, cls): _path for module in ("pathlib", "pathlib._local")
       for cls in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}


@dataclass(frozen=True, slots=True)
class Chunk:
    """A box of a tensor that one rank saved: per-dim offsets and sizes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A tensor entry: its dtype (torch's name), global shape and chunks."""

    dtype: TorchDtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class StorageRef:
    """Where a chunk's (or a value's) torch.save archive is: file, offset, length, and the
    stream transforms (compression...) applied to it, if any. `raw`: the bytes are the chunk's
    elements themselves in C order (a safetensors entry of a ``HuggingFaceStorageWriter`` save)."""

    path: str
    offset: int
    length: int
    transforms: tuple[str, ...]
    raw: bool = False


StorageKey = tuple[str, "tuple[int, ...] | None"]  # (flattened key, chunk offsets; None for a value)


@dataclass(frozen=True, slots=True)
class DcpMetadata:
    """A DCP checkpoint's metadata: entries in saved order (None for a BytesIO value) and storage."""

    entries: dict[str, TensorMeta | None]
    storage: dict[StorageKey, StorageRef]
    version: str | None


def read_metadata(directory: str, allowed: Mapping[tuple[str, str], Any] = ALLOWED) -> DcpMetadata:
    """Read and check ``directory/.metadata``, unpickled through `allowed` (`ALLOWED`, or a
    format's wider list: Megatron-Core's adds its cached save plans).

    Raises:
        ManifestError: the pickle needs a class outside the allowlist (named), or the metadata
            is malformed (the field is named), or of a DCP version this converter does not read.
        StorageError: the file is missing or not a regular file.
        IntegrityError: it is over METADATA_LIMIT, or truncated while read.
    """
    path = os.path.join(directory, METADATA_NAME)
    data = read_small(path, METADATA_LIMIT, "DCP metadata")
    return parse_metadata(unpickle(bytes(data), allowed, where=path), where=path)


RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")


def rank_metadata_files(directory: str) -> list[str]:
    """The per-rank metadata files of a save without collectives (``__<rank>.metadata``), by rank."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = sorted((int(m.group(1)), n) for n in names if (m := RANK_METADATA.match(n)))
    return [n for _, n in found]


def read_rank_metadata(directory: str, allowed: Mapping[tuple[str, str], Any] = ALLOWED) -> DcpMetadata:
    """Read and merge the ``__<rank>.metadata`` files a ``dcp.save(..., use_collectives=False)``
    leaves (each rank's own chunks and values, nothing shared): every tensor's chunks are
    joined; a chunk or value that several ranks saved is taken from the lowest rank (without
    collectives each rank writes its copy of replicated state).

    Raises:
        ManifestError: a file refused or malformed (as `read_metadata`), or ranks that disagree
            on a tensor's dtype or global shape, or call one key a tensor and a value.
    """
    entries: dict[str, TensorMeta | None] = {}
    storage: dict[StorageKey, StorageRef] = {}
    version = None
    for name in rank_metadata_files(directory):
        path = os.path.join(directory, name)
        md = parse_metadata(unpickle(bytes(read_small(path, METADATA_LIMIT, "DCP metadata")), allowed, where=path), where=path)
        version = version or md.version
        for key, meta in md.entries.items():
            if key not in entries:
                entries[key] = meta
                continue
            have = entries[key]
            if (have is None) != (meta is None):
                raise ManifestError(f"{path}: {key} is a tensor on one rank and a value on another")
            if have is not None and meta is not None:
                if (have.dtype, have.shape) != (meta.dtype, meta.shape):
                    raise ManifestError(f"{path}: {key} is {meta.dtype.name}{list(meta.shape)} here, "
                                        f"{have.dtype.name}{list(have.shape)} on a lower rank")
                known = {c.offsets for c in have.chunks}
                entries[key] = TensorMeta(have.dtype, have.shape,
                                          have.chunks + tuple(c for c in meta.chunks if c.offsets not in known))
        for index, ref in md.storage.items():
            storage.setdefault(index, ref)
    return DcpMetadata(entries, storage, version)


def parse_metadata(obj: Any, *, where: str) -> DcpMetadata:
    """Read the unpickled stand-in of ``Metadata`` into a `DcpMetadata`, checking every field."""
    fields = _fields(obj, "Metadata", where)
    version = fields.get("version")
    if version is not None and (not isinstance(version, str) or not version.startswith("1.")):
        raise ManifestError(f"{where}: DCP metadata version {version!r}; this converter reads version 1.x")
    entries_raw = fields.get("state_dict_metadata")
    storage_raw = fields.get("storage_data")
    if not isinstance(entries_raw, dict) or not isinstance(storage_raw, dict):
        raise ManifestError(f"{where}: state_dict_metadata and storage_data must be dicts (a FileSystemWriter save)")
    entries: dict[str, TensorMeta | None] = {}
    for key, value in entries_raw.items():
        if not isinstance(key, str):
            raise ManifestError(f"{where}: an entry key {key!r} is not a string")
        entries[key] = _entry(value, f"{where}: {key}")
    storage: dict[StorageKey, StorageRef] = {}
    for index, info in storage_raw.items():
        key = _index(index, where)
        storage[key] = _storage(info, f"{where}: {key[0]}")
    return DcpMetadata(entries, storage, version)


def _fields(obj: Any, name: str, where: str) -> dict[str, Any]:
    """The fields of stand-in `obj` of class `name` (its pickled ``__dict__``)."""
    if not isinstance(obj, _RECORDS[name]):
        raise ManifestError(f"{where}: expected a {name}, found {type(obj).__name__}")
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2:  # (dict state, slot state)
        state = {**(state[0] or {}), **(state[1] or {})}
    if state is None:
        return {}
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise ManifestError(f"{where}: malformed {name}")
    return state


def _entry(value: Any, where: str) -> TensorMeta | None:
    if isinstance(value, _RECORDS["BytesStorageMetadata"]):
        return None
    fields = _fields(value, "TensorStorageMetadata", where)
    shape = _dims(fields.get("size"), "size", where)
    chunks = fields.get("chunks")
    if not isinstance(chunks, list):
        raise ManifestError(f"{where}: chunks must be a list")
    out = []
    for chunk in chunks:
        c = _fields(chunk, "ChunkStorageMetadata", where)
        offsets, sizes = _dims(c.get("offsets"), "chunk offsets", where), _dims(c.get("sizes"), "chunk sizes", where)
        if not len(offsets) == len(sizes) == len(shape):
            raise ManifestError(f"{where}: a chunk of {len(offsets)} dims in a tensor of {len(shape)}")
        out.append(Chunk(offsets, sizes))
    return TensorMeta(_dtype(fields.get("properties"), where), shape, tuple(out))


def _dtype(props: Any, where: str) -> TorchDtype:
    if not isinstance(props, _RECORDS["TensorProperties"]):
        raise ManifestError(f"{where}: expected TensorProperties, found {type(props).__name__}")
    state = props.state  # (dtype, layout, requires_grad, memory format, pin_memory) since torch 2.0
    dtype = state[0] if isinstance(state, tuple) and state else state.get("dtype") if isinstance(state, dict) else None
    if not isinstance(dtype, TorchDtype):
        raise ManifestError(f"{where}: no dtype in the tensor's properties")
    return dtype


def _dims(value: Any, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ManifestError(f"{where}: {what} {value!r} are not non-negative integers")
    return value


def _index(index: Any, where: str) -> StorageKey:
    fields = _fields(index, "MetadataIndex", where)
    fqn, offset = fields.get("fqn"), fields.get("offset")
    if not isinstance(fqn, str):
        raise ManifestError(f"{where}: a storage index without a key")
    return fqn, None if offset is None else _dims(offset, "storage offsets", f"{where}: {fqn}")


def _storage(info: Any, where: str) -> StorageRef:
    fields = _fields(info, "_StorageInfo", where)
    path, offset, length = fields.get("relative_path"), fields.get("offset"), fields.get("length")
    transforms = fields.get("transform_descriptors") or ()
    if not isinstance(path, str) or not _plain_file(path):
        raise ManifestError(f"{where}: storage file {path!r} is not a plain file name in the checkpoint directory")
    if not (_count(offset) and _count(length)):
        raise ManifestError(f"{where}: storage offset {offset!r} and length {length!r} must be non-negative integers")
    if not isinstance(transforms, (list, tuple)) or not all(isinstance(t, str) for t in transforms):
        raise ManifestError(f"{where}: malformed transform descriptors")
    return StorageRef(path, offset, length, tuple(transforms))


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _plain_file(name: str) -> bool:
    """A file directly in the checkpoint directory: one segment, not hidden, printable."""
    return bool(name) and name.isprintable() and "/" not in name and "\\" not in name and not name.startswith(".")


__all__ = ["ALLOWED", "METADATA_NAME", "rank_metadata_files", "read_rank_metadata", "Chunk", "DcpMetadata", "StorageRef", "TensorMeta", "parse_metadata", "read_metadata"]
