"""Conversions of tensor bytes between dtypes, without torch: what export applies.

A tensor's bytes are held as a uint8 array of its shape with the last dim counted in bytes
(``ckptkit.io.read.byte_shape``), so that any dtype, bfloat16 included, is handled the same way.
Conversions between float32, bfloat16 and float16 (numpy and ml_dtypes casts) round to
nearest even exactly as torch's ``Tensor.to`` does; a NaN stays a NaN.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from ..manifest.dtypes import itemsize
from ..errors import LayoutError

CHUNK = 1 << 20  # elements converted at a time (bounds the temporaries)
CONVERSIONS = {("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32"),
               ("float16", "float32"), ("bfloat16", "float16"), ("float16", "bfloat16")}


FLOATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def output_dtype(saved: str, wanted: str | None) -> str:
    """The dtype a tensor saved as `saved` is exported as: `wanted` for floating point tensors
    (None keeps the saved dtype); integer and bool tensors always keep theirs."""
    return wanted if wanted is not None and saved in FLOATS else saved


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
