"""Compare two checkpoints as logical tensors, whatever topologies wrote them (one tensor at a time, no torch)."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..manifest.dtypes import itemsize
from ..io.read import Reader
from ..io.payload import open_checkpoint
from .convert import Progress


class TensorDiff(BaseModel):
    """How one logical tensor differs between A and B."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    problem: str
    mismatched: int = 0
    numel: int = 0
    max_abs: float | None = None
    max_rel: float | None = None


class DiffReport(BaseModel):
    """What ``ckptkit diff`` found; ``ok`` when no tensor and no JSON value differs (the exit code 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    a: str
    b: str
    ok: bool
    atol: float
    rtol: float
    kinds: list[str]
    tensors: int
    differences: list[TensorDiff]  # the largest first; ``ckptkit diff --json`` keeps the first --limit
    differences_total: int  # how many tensors differ (also those left out of `differences`)
    objects_equal: bool


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    kinds: tuple[str, ...] = ("param", "optimizer", "buffer", "other"),
    progress: Progress | None = None,
) -> DiffReport:
    """Compare the tensors of kinds `kinds` (and the JSON values) of checkpoints `a` and `b`.

    With atol = rtol = 0, tensors must be bitwise equal; otherwise ``|a - b| <= atol + rtol *
    |b|`` elementwise (NaNs equal NaNs). RNG states are left out by default: they legitimately
    differ between topologies. Memory: two tensors at a time. `progress` is called with (bytes
    of A compared, bytes of A to compare) after each tensor.

    Raises:
        CheckpointNotFoundError, ManifestError, IntegrityError: a checkpoint cannot be read.
    """
    loc_a, man_a = open_checkpoint(a)
    loc_b, man_b = open_checkpoint(b)
    names_a = {n for n, t in man_a.tensors.items() if t.kind in kinds}
    names_b = {n for n, t in man_b.tensors.items() if t.kind in kinds}
    diffs = [TensorDiff(name=n, problem="only in A") for n in sorted(names_a - names_b)]
    diffs += [TensorDiff(name=n, problem="only in B") for n in sorted(names_b - names_a)]
    reader_a, reader_b = Reader(loc_a, man_a), Reader(loc_b, man_b)
    sizes = {n: math.prod(man_a.tensors[n].shape) * itemsize(man_a.tensors[n].dtype) for n in names_a & names_b}
    done = 0
    for name in sorted(names_a & names_b):
        done += sizes[name]
        if progress is not None:
            progress(done, sum(sizes.values()))
        ta, tb = man_a.tensors[name], man_b.tensors[name]
        if (ta.shape, ta.dtype) != (tb.shape, tb.dtype):
            diffs.append(TensorDiff(name=name, problem=f"A is {ta.dtype}{list(ta.shape)}, B is {tb.dtype}{list(tb.shape)}"))
            continue
        x = reader_a.read_whole(name)
        y = reader_b.read_whole(name)
        found = compare(name, x, y, ta.dtype, atol, rtol)
        if found is not None:
            diffs.append(found)
    diffs.sort(key=lambda d: (d.max_abs is not None, -(d.max_abs or 0.0), d.name))  # missing first, then largest
    objects_equal = man_a.objects == man_b.objects
    return DiffReport(
        a=str(loc_a), b=str(loc_b), ok=not diffs and objects_equal, atol=atol, rtol=rtol, kinds=list(kinds),
        tensors=len(names_a & names_b), differences=diffs, differences_total=len(diffs),
        objects_equal=objects_equal,
    )


def compare(name: str, x: np.ndarray[Any, Any], y: np.ndarray[Any, Any], dtype: str, atol: float, rtol: float) -> TensorDiff | None:
    """Return how the tensors whose bytes are `x` and `y` (of `dtype`) differ, or None when they
    are equal (bitwise when atol = rtol = 0)."""
    size = itemsize(dtype)
    numel = x.size // size
    if numel == 0:
        return None
    xb, yb = x.reshape(numel, size), y.reshape(numel, size)
    with np.errstate(invalid="ignore", over="ignore"):
        if atol == 0.0 and rtol == 0.0:
            bad = (xb != yb).any(axis=1)
            if not bad.any():
                return None
            xd, yd = _float64(xb[bad], dtype), _float64(yb[bad], dtype)  # only the differing elements
            delta = np.abs(xd - yd)
        else:
            xd, yd = _float64(xb, dtype), _float64(yb, dtype)
            delta = np.abs(xd - yd)
            x_nan, y_nan = np.isnan(xd), np.isnan(yd)
            bad = ((delta > atol + rtol * np.abs(yd)) & ~(x_nan & y_nan)) | (x_nan ^ y_nan)
            if not bad.any():
                return None
            xd, yd, delta = xd[bad], yd[bad], delta[bad]
    mismatched = int(bad.sum())
    worst = np.nan_to_num(delta, nan=math.inf)  # a NaN against a number counts as infinitely far
    rel = worst / np.maximum(np.abs(yd), 1e-30)
    return TensorDiff(
        name=name, problem="values differ", mismatched=mismatched, numel=numel,
        max_abs=float(worst.max()), max_rel=float(rel.max()),
    )


def _float64(data: np.ndarray[Any, Any], dtype: str) -> np.ndarray[Any, Any]:
    """The values of tensor bytes (rows of `itemsize` bytes) as float64 (complex128 for a complex
    dtype: differences are then distances in the plane)."""
    wide: Any = np.complex128 if dtype == "complex64" else np.float64
    if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        kind: Any = getattr(ml_dtypes, dtype)
    else:
        kind = np.dtype(dtype)
    out: np.ndarray[Any, Any] = np.ascontiguousarray(data).view(kind).reshape(-1).astype(wide)
    return out
