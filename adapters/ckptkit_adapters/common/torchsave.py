"""Read ``torch.save`` archives in place, without torch: the zip directory, the pickled
description of a tensor or a plain value (through `safepickle`), and a tensor's bytes copied
straight from its storage record into a caller's buffer.

An archive written by ``torch.save`` (torch 1.6 and later) is an uncompressed zip: ``<name>/data.pkl``
(the pickled object; a tensor is ``torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, requires_grad, hooks)``, or ``_rebuild_tensor_v3`` with a dtype for the dtypes that have
no legacy storage class, the storage a persistent id ``('storage', <storage class>, <key>,
<location>, <numel>)``), ``<name>/data/<key>`` (each storage's raw bytes, 64-byte aligned),
``<name>/byteorder`` and a few small version records. The archive may sit anywhere in a larger
file (a DCP ``.distcp`` file holds one per chunk): it is read through a window of the file.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptkit.errors import IntegrityError
from ckptkit.manifest.dtypes import itemsize
from ckptkit_adapters.common.safepickle import Allowlist, Record, record_type, unpickle

# The largest data.pkl read: a tensor's description is about 150 bytes, a value's a few KiB.
PICKLE_LIMIT = 64 << 20

# torch dtype names (as ``torch.<name>``) -> ckptkit dtype names. Aliases included.
TORCH_DTYPES: dict[str, str] = {
    "float64": "float64", "double": "float64", "float32": "float32", "float": "float32",
    "float16": "float16", "half": "float16", "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32", "int16": "int16", "short": "int16",
    "int8": "int8", "uint64": "uint64", "uint32": "uint32", "uint16": "uint16", "uint8": "uint8", "bool": "bool",
    "complex64": "complex64", "cfloat": "complex64",
}
# torch dtypes ckptkit has no name for: a tensor of one is listed as skipped, not refused.
OTHER_TORCH_DTYPES = (
    "complex128", "cdouble", "complex32", "chalf", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "qint32", "quint8", "quint4x2", "quint2x4", "bits1x8", "bits2x4",
    "bits4x2", "bits8", "bits16", "bit", *(f"int{n}" for n in range(1, 8)), *(f"uint{n}" for n in range(1, 8)),
)
# Legacy storage classes (``torch.FloatStorage``...) name the dtype of a _rebuild_tensor_v2 tensor.
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
}


@dataclass(frozen=True, slots=True)
class TorchDtype:
    """A ``torch.<name>`` dtype as a pickle names it; ``dtype`` is ckptkit's name, or None."""

    name: str

    @property
    def dtype(self) -> str | None:
        return TORCH_DTYPES.get(self.name)


@dataclass(frozen=True, slots=True)
class _StorageClass:
    name: str
    dtype: str | None  # None: UntypedStorage (bytes; the tensor names its dtype)


@dataclass(frozen=True, slots=True)
class _StorageRef:
    key: str
    dtype: str | None
    numel: int


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor as an archive describes it: dtype, shape and element strides over its storage
    record `key`, starting `offset` elements in; `nbytes` is the record's size in bytes."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    key: str
    nbytes: int


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, *_: Any) -> StoredTensor:
    return _stored(storage, storage.dtype if isinstance(storage, _StorageRef) else None, offset, size, stride)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any, *_: Any) -> StoredTensor:
    return _stored(storage, dtype.dtype if isinstance(dtype, TorchDtype) else None, offset, size, stride)


def _stored(storage: Any, dtype: str | None, offset: Any, size: Any, stride: Any) -> StoredTensor:
    if not isinstance(storage, _StorageRef) or dtype is None:
        raise ValueError("a tensor without a storage of a known dtype")
    if not _ints(size) or not _ints(stride) or len(size) != len(stride) or not isinstance(offset, int):
        raise ValueError("a tensor with malformed size, stride or offset")
    width = 1 if storage.dtype is None else itemsize(storage.dtype)
    return StoredTensor(dtype, tuple(size), tuple(stride), offset, storage.key, storage.numel * width)


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


_ORDERED_DICT = ("collections", "OrderedDict")
# The classes a pickle of tensors needs (a format's allowlist starts from this one).
TENSOR_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch.storage", "UntypedStorage"): _StorageClass("UntypedStorage", None),
    _ORDERED_DICT: record_type("collections.OrderedDict"),  # the (empty) backward hooks
    **{("torch", name): _StorageClass(name, dtype) for name, dtype in STORAGE_DTYPES.items()},
    **{("torch", name): TorchDtype(name) for name in TORCH_DTYPES},
}
class StateDict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` as a pickle rebuilds a state dict: its items; the
    ``_metadata`` attribute torch pickles beside them (module versions) is dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> Any:
    return data


# A state dict (``torch.save(model.state_dict())``, a ``pytorch_model.bin``): tensors, parameters,
# nested dicts of them.
STATE_DICT_ALLOWED: dict[tuple[str, str], Any] = {
    **TENSOR_ALLOWED,
    _ORDERED_DICT: StateDict,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
}
def encode_latin1(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for bytes (``latin1`` text only)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ValueError("_codecs.encode of something other than latin-1 text")
    return text.encode("latin-1")


# A plain value (a DCP BytesIO entry): Python builtins only; an OrderedDict reads as a dict.
_VALUE_ALLOWED: dict[tuple[str, str], Any] = {_ORDERED_DICT: dict, ("_codecs", "encode"): encode_latin1}  # bytes, as protocol 2 pickles them


@dataclass(frozen=True, slots=True)
class Archive:
    """A torch.save archive at bytes [start, start + length) of file `fd`: its records by name,
    as (local header offset, size) within the archive."""

    fd: int
    where: str
    prefix: str
    start: int
    length: int
    records: dict[str, tuple[int, int]]

    def read(self, name: str, limit: int) -> bytes:
        """Return record `name` (under the archive's prefix), refusing one over `limit` bytes."""
        start, size = self.locate(name)
        if size > limit:
            raise IntegrityError(f"{self.where}: {self.prefix}/{name} is {size} bytes, over the {limit}-byte limit")
        buf = bytearray(size)
        pread_into(self.fd, memoryview(buf), start, self.where)
        return bytes(buf)

    def has(self, name: str) -> bool:
        return f"{self.prefix}/{name}" in self.records

    def locate(self, name: str) -> tuple[int, int]:
        """Return where record `name`'s bytes are in the file (absolute offset) and its size.

        Raises:
            IntegrityError: no such record, or its bytes lie outside the archive.
        """
        full = f"{self.prefix}/{name}"
        try:
            header_offset, size = self.records[full]
        except KeyError:
            raise IntegrityError(f"{self.where}: the torch.save archive has no record {full}") from None
        header = bytearray(_LOCAL_HEADER.size)
        if header_offset + len(header) > self.length:
            raise IntegrityError(f"{self.where}: record {full} lies outside the archive")
        pread_into(self.fd, memoryview(header), self.start + header_offset, self.where)
        fields = _LOCAL_HEADER.unpack(bytes(header))
        if fields[0] != b"PK\x03\x04":
            raise IntegrityError(f"{self.where}: record {full} has no local header")
        data = header_offset + len(header) + fields[9] + fields[10]
        if data + size > self.length:
            raise IntegrityError(f"{self.where}: record {full} lies outside the archive (truncated?)")
        return self.start + data, size


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of file `fd`, as a seekable read-only file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self.fd, self.start, self.length, self.pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        got = os.preadv(self.fd, [view[:n]], self.start + self.pos) if n else 0
        self.pos += got
        return got


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def open_archive(fd: int, start: int, length: int, where: str) -> Archive:
    """Read the zip directory of the torch.save archive at bytes [start, start + length) of `fd`.

    Raises:
        IntegrityError: not a zip, a compressed record, or a record outside the window.
    """
    try:
        with zipfile.ZipFile(_Window(fd, start, length)) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise IntegrityError(f"{where}: not a torch.save archive ({exc})") from None
    pickles = [i.filename for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pickles) != 1:
        raise IntegrityError(f"{where}: not a torch.save archive (no single <name>/data.pkl)")
    records = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise IntegrityError(f"{where}: record {info.filename} is compressed; torch.save stores records uncompressed")
        records[info.filename] = (info.header_offset, info.file_size)
    return Archive(fd, where, pickles[0].split("/")[0], start, length, records)


def stored_tensor(archive: Archive) -> StoredTensor:
    """Return the description of the tensor an archive holds, checked against its record.

    Raises:
        ManifestError: the pickle needs a class outside the tensor allowlist (the message names it).
        IntegrityError: the archive is not one tensor, or its storage record is too small.
    """
    obj = stored_object(archive, TENSOR_ALLOWED)
    if not isinstance(obj, StoredTensor):
        raise IntegrityError(f"{archive.where}: {archive.prefix}/data.pkl holds a {type(obj).__name__}, not a tensor")
    return obj


def stored_object(archive: Archive, allowed: Allowlist) -> Any:
    """Return the object an archive holds, each tensor in it as a `StoredTensor` checked
    against its storage record (the bytes stay in the file). `allowed` is the allowlist of
    the format (`TENSOR_ALLOWED` plus its classes).

    Raises:
        ManifestError: the pickle needs a class outside `allowed` (the message names it).
        IntegrityError: a tensor's storage record is missing or too small.
    """
    _check_byteorder(archive)
    tensors: list[StoredTensor] = []

    def storage(pid: Any) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageClass)
                and isinstance(pid[2], str) and isinstance(pid[4], int) and pid[4] >= 0):
            raise ValueError(f"unexpected persistent id {pid!r}")
        return _StorageRef(pid[2], pid[1].dtype, pid[4])

    def track(make: Any) -> Any:
        def rebuild(*args: Any) -> StoredTensor:
            t: StoredTensor = make(*args)
            tensors.append(t)
            return t
        return rebuild

    where = f"{archive.where}: {archive.prefix}/data.pkl"
    tracked = {**allowed, **{k: track(v) for k, v in allowed.items() if v in (_rebuild_v2, _rebuild_v3)}}
    obj = unpickle(archive.read("data.pkl", PICKLE_LIMIT), tracked, where=where, persistent=storage)
    for t in tensors:
        _check_stored(archive, t)
    return obj


def _check_stored(archive: Archive, obj: StoredTensor) -> None:
    _, size = archive.locate(f"data/{obj.key}")
    if size < obj.nbytes:
        raise IntegrityError(f"{archive.where}: storage record {obj.key} has {size} bytes, the tensor's storage {obj.nbytes}")
    width = itemsize(obj.dtype)
    count: int = math.prod(obj.shape)
    last = obj.offset + sum((n - 1) * s for n, s in zip(obj.shape, obj.stride))  # the last element's index
    if count and (last + 1) * width > obj.nbytes:
        raise IntegrityError(f"{archive.where}: the tensor reaches past its storage record {obj.key}")


def stored_value(archive: Archive) -> Any:
    """Return the plain Python value an archive holds (builtins only: no class is rebuilt).

    Raises:
        ManifestError: the pickle needs a class (the message names it) or holds a tensor.
    """
    _check_byteorder(archive)
    where = f"{archive.where}: {archive.prefix}/data.pkl"
    return unpickle(archive.read("data.pkl", PICKLE_LIMIT), _VALUE_ALLOWED, where=where)


def plain(value: Any) -> Any:
    """An unpickled value as JSON-like Python: tuples as lists, non-string keys as strings,
    torch dtypes by name (``torch.float16``), a stand-in `Record` as its state (or, with none,
    the arguments it was built with). Tensors and other objects stay as they are (and are then
    not JSON)."""
    if isinstance(value, TorchDtype):
        return f"torch.{value.name}"
    if isinstance(value, Record):
        return plain(value.state if value.state is not None else list(value.args))
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): plain(v) for k, v in value.items()}
    return value


def _check_byteorder(archive: Archive) -> None:
    if archive.has("byteorder") and archive.read("byteorder", 64) != b"little":
        raise IntegrityError(f"{archive.where}: a big-endian torch.save archive; only little-endian ones are read")


def copy_tensor(archive: Archive, stored: StoredTensor, dest: np.ndarray[Any, Any]) -> None:
    """Copy the stored tensor's bytes into `dest`: a uint8 array of its shape plus a last dim
    of the element size (a view of a larger buffer is fine). Contiguous data into a contiguous
    destination is read straight into it; otherwise the span is read once and gathered."""
    width = itemsize(stored.dtype)
    if tuple(dest.shape) != (*stored.shape, width):
        raise IntegrityError(f"{archive.where}: a tensor of shape {list(stored.shape)}, expected {list(dest.shape[:-1])}")
    count = math.prod(stored.shape)
    if not count:
        return
    start, _ = archive.locate(f"data/{stored.key}")
    begin = start + stored.offset * width
    if _contiguous(stored.shape, stored.stride) and dest.flags.c_contiguous:
        pread_into(archive.fd, dest.reshape(-1).data, begin, archive.where)
        return
    span = (sum((n - 1) * s for n, s in zip(stored.shape, stored.stride)) + 1) * width
    raw = np.empty(span, dtype=np.uint8)
    pread_into(archive.fd, raw.data, begin, archive.where)
    strides = tuple(s * width for s in stored.stride) + (1,)
    dest[...] = np.lib.stride_tricks.as_strided(raw, shape=dest.shape, strides=strides, writeable=False)


def contiguous_range(archive: Archive, stored: StoredTensor) -> tuple[int, int] | None:
    """Where a stored tensor's bytes lie in the file (begin, end) when they are one run in C
    order, else None (a strided view)."""
    if not _contiguous(stored.shape, stored.stride):
        return None
    width = itemsize(stored.dtype)
    start, _ = archive.locate(f"data/{stored.key}")
    begin = start + stored.offset * width
    return begin, begin + math.prod(stored.shape) * width


def copy_flat(archive: Archive, stored: StoredTensor, start: int, dest: memoryview) -> None:
    """Copy elements [start, start + n) of a 1-D contiguous stored tensor into `dest` (n
    elements' bytes): a flat partition read in place, a range at a time.

    Raises:
        IntegrityError: the tensor is not 1-D contiguous, or the range reaches past its end.
    """
    width = itemsize(stored.dtype)
    count = dest.nbytes // width
    if len(stored.shape) != 1 or not _contiguous(stored.shape, stored.stride):
        raise IntegrityError(f"{archive.where}: a flat partition of shape {list(stored.shape)}, expected 1-D and contiguous")
    if start < 0 or start + count > stored.shape[0]:
        raise IntegrityError(f"{archive.where}: elements {start}-{start + count} of a flat partition of {stored.shape[0]}")
    if not count:
        return
    begin, _ = archive.locate(f"data/{stored.key}")
    pread_into(archive.fd, dest.cast("B"), begin + (stored.offset + start) * width, archive.where)


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether elements are laid out row-major without gaps (the stride of a dim of size 1 is free)."""
    step = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    """Fill `view` from `fd` at `offset`.

    Raises:
        IntegrityError: the file ends first (truncated).
    """
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise IntegrityError(f"{where}: the file ends at byte {offset + done}, {len(view) - done} bytes short (truncated?)")
        done += got


__all__ = [
    "OTHER_TORCH_DTYPES", "STATE_DICT_ALLOWED", "TENSOR_ALLOWED", "TORCH_DTYPES", "StateDict", "Archive", "StoredTensor", "TorchDtype", "contiguous_range",
    "copy_flat", "copy_tensor", "open_archive", "plain", "pread_into", "stored_object", "stored_tensor", "stored_value",
]
