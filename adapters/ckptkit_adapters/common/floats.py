"""Derive a 16-bit parameter from its fp32 master as frameworks do (round to nearest even), without torch."""

from __future__ import annotations

from typing import Any

import numpy as np

from ckptkit.errors import IntegrityError


def cast_float32(values: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """float32 `values` as `dtype` (bfloat16 or float16 bits, or float32), rounded to nearest
    even as torch's ``Tensor.to`` rounds."""
    if dtype == "float32":
        return values
    if dtype == "float16":
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as torch gives
            return values.astype(np.float16)
    if dtype != "bfloat16":
        raise IntegrityError(f"cannot derive a {dtype} parameter from its fp32 master")
    bits = values.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded)


__all__ = ["cast_float32"]
