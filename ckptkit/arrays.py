"""Whole tensors as numpy bytes, read and converted without torch: what export streams.

A tensor's bytes are held as a uint8 array of its shape with the last dim counted in bytes
(``byte_shape``), so that any dtype, bfloat16 included, is sliced and copied the same way.
Conversions between float32, bfloat16 and float16 (numpy and ml_dtypes casts) round to
nearest even exactly as torch's ``Tensor.to`` does; a NaN stays a NaN.
"""

from __future__ import annotations

from concurrent.futures import Executor
from typing import Any

import ml_dtypes
import numpy as np

from .boxes import Box
from .catalog import Location
from .dtypes import itemsize
from .errors import LayoutError
from .manifest import Manifest
from .payload import Headers, header_entry, read_header
from .planner import Read
from .shards import iter_shards

PIECE = 16 << 20  # one read task; long shards are cut so that reads run on several threads
CHUNK = 1 << 20  # elements converted at a time (bounds the temporaries)
CONVERSIONS = {("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
               ("float16", "float32"), ("bfloat16", "float16"), ("float16", "bfloat16")}


FLOATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def output_dtype(saved: str, wanted: str | None) -> str:
    """The dtype a tensor saved as `saved` is exported as: `wanted` for floating point tensors
    (None keeps the saved dtype); integer and bool tensors always keep theirs."""
    return wanted if wanted is not None and saved in FLOATS else saved


def byte_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The shape of a tensor's bytes: its own, the last dim times the item size (0-d: one row)."""
    return (*shape[:-1], shape[-1] * size) if shape else (size,)


def byte_slices(box: Box, size: int) -> tuple[slice, ...]:
    """The slices of a box of a tensor inside the tensor's bytes (see `byte_shape`)."""
    if not box.ndim:
        return (slice(0, size),)
    *lead, last = [slice(o, o + n) for o, n in zip(box.offsets, box.lengths)]
    return (*lead, slice(last.start * size, last.stop * size))


def read_whole(loc: Location, manifest: Manifest, fqn: str, headers: Headers, pool: Executor) -> np.ndarray[Any, Any]:
    """Return tensor `fqn` whole as bytes (see `byte_shape`), read from whatever shards hold it.

    Each shard's bytes are read straight into place where they are contiguous there (row
    boxes), else into a buffer then copied; reads run on `pool` in pieces of PIECE bytes.
    `headers` caches the checked payload headers by file index.

    Raises:
        IntegrityError: a payload file is missing or its header disagrees with the manifest.
    """
    entry = manifest.tensors[fqn]
    size = itemsize(entry.dtype)
    out = np.empty(byte_shape(entry.shape, size), np.uint8)
    reads: list[tuple[str, int, memoryview]] = []
    copies = []
    for shard in iter_shards(entry):
        if shard.file not in headers:
            headers[shard.file] = read_header(loc, manifest, shard.file)
        begin = header_entry(loc, manifest, headers[shard.file][0], Read(shard.file, shard.key, shard.box, shard.box), entry.dtype).begin
        dest = out[byte_slices(shard.box, size)]
        buf = dest if dest.flags.c_contiguous else np.empty(dest.shape, np.uint8)
        if buf is not dest:
            copies.append((dest, buf))
        flat = buf.reshape(-1).data
        key = loc.key(manifest.files[shard.file].path)
        reads += [(key, begin + o, flat[o : o + PIECE]) for o in range(0, len(flat), PIECE)]
    for _ in pool.map(lambda r: loc.storage.readinto(*r), reads):
        pass
    for dest, buf in copies:
        np.copyto(dest, buf)
    return out


def convert(data: np.ndarray[Any, Any], src: str, dst: str) -> np.ndarray[Any, Any]:
    """Return the bytes (flat uint8) of the elements of `data` (bytes of dtype `src`) as `dst`.

    Rounds to nearest even (as torch does); a NaN stays a NaN.

    Raises:
        LayoutError: a conversion other than between float32, bfloat16 and float16.
    """
    flat = data.reshape(-1)
    if src == dst:
        return flat
    if (src, dst) not in CONVERSIONS:
        raise LayoutError(f"cannot convert {src} to {dst} (conversions: float32, bfloat16, float16)")
    n = flat.size // itemsize(src)
    out = np.empty(n * itemsize(dst), np.uint8)
    source, target = flat.view(_NUMPY[src]), out.view(_NUMPY[dst])
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, n, CHUNK):
            np.copyto(target[start : start + CHUNK], source[start : start + CHUNK], casting="unsafe")
    return out


_NUMPY: dict[str, Any] = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": ml_dtypes.bfloat16}
