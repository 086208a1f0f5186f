"""Compare two checkpoints as logical tensors, whatever topologies wrote them (one tensor at a time)."""

from __future__ import annotations

import math
import os

import torch
from pydantic import BaseModel, ConfigDict

from .loader import read_tensor
from .payload import Headers, open_checkpoint


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
    """What ``ckptkit diff`` found; ``equal`` when no tensor and no JSON value differs."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    a: str
    b: str
    equal: bool
    atol: float
    rtol: float
    kinds: list[str]
    tensors_compared: int
    differences: list[TensorDiff]
    objects_equal: bool


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    kinds: tuple[str, ...] = ("param", "optimizer", "buffer", "other"),
) -> DiffReport:
    """Compare the tensors of kinds `kinds` (and the JSON values) of checkpoints `a` and `b`.

    With atol = rtol = 0, tensors must be bitwise equal; otherwise ``|a - b| <= atol + rtol *
    |b|`` elementwise (NaNs equal NaNs). RNG states are left out by default: they legitimately
    differ between topologies. Memory: two tensors at a time.

    Raises:
        CheckpointNotFoundError, ManifestError, IntegrityError: a checkpoint cannot be read.
    """
    loc_a, man_a = open_checkpoint(a)
    loc_b, man_b = open_checkpoint(b)
    names_a = {n for n, t in man_a.tensors.items() if t.kind in kinds}
    names_b = {n for n, t in man_b.tensors.items() if t.kind in kinds}
    diffs = [TensorDiff(name=n, problem="only in A") for n in sorted(names_a - names_b)]
    diffs += [TensorDiff(name=n, problem="only in B") for n in sorted(names_b - names_a)]
    headers_a: Headers = {}
    headers_b: Headers = {}
    for name in sorted(names_a & names_b):
        ta, tb = man_a.tensors[name], man_b.tensors[name]
        if (ta.shape, ta.dtype) != (tb.shape, tb.dtype):
            diffs.append(TensorDiff(name=name, problem=f"A is {ta.dtype}{list(ta.shape)}, B is {tb.dtype}{list(tb.shape)}"))
            continue
        x = read_tensor(loc_a, man_a, name, headers_a)
        y = read_tensor(loc_b, man_b, name, headers_b)
        found = compare(name, x, y, atol, rtol)
        if found is not None:
            diffs.append(found)
    diffs.sort(key=lambda d: (d.max_abs is not None, -(d.max_abs or 0.0), d.name))  # missing first, then largest
    objects_equal = man_a.objects == man_b.objects
    return DiffReport(
        a=str(loc_a), b=str(loc_b), equal=not diffs and objects_equal, atol=atol, rtol=rtol, kinds=list(kinds),
        tensors_compared=len(names_a & names_b), differences=diffs, objects_equal=objects_equal,
    )


def compare(name: str, x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> TensorDiff | None:
    """Return how `x` and `y` differ, or None when they are equal (bitwise when atol = rtol = 0)."""
    if x.numel() == 0:
        return None
    xd, yd = x.double().reshape(-1), y.double().reshape(-1)
    delta = (xd - yd).abs()
    if atol == 0.0 and rtol == 0.0:
        bad = (_bytes(x) != _bytes(y)).any(dim=1)
    else:
        both_nan = xd.isnan() & yd.isnan()
        bad = ((delta > atol + rtol * yd.abs()) & ~both_nan) | (xd.isnan() ^ yd.isnan())
    mismatched = int(bad.sum())
    if not mismatched:
        return None
    worst = delta[bad].nan_to_num(nan=math.inf)  # a NaN against a number counts as infinitely far
    rel = worst / yd[bad].abs().clamp_min(1e-30)
    return TensorDiff(
        name=name, problem="values differ", mismatched=mismatched, numel=x.numel(),
        max_abs=float(worst.max()), max_rel=float(rel.max()),
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(t.numel(), -1)
