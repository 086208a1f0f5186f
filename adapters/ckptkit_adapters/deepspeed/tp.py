"""Join the model-parallel ranks of a DeepSpeed save into whole tensors, through the model's layout.

With model (tensor) parallelism, as Megatron-DeepSpeed runs it, DeepSpeed saves each
model-parallel rank's own parameters (``mp_rank_XX_model_states.pt`` and that rank's optimizer
partitions) under the same names, each TP-local, and records nothing of how they were cut. The
model's layout says it: a layout parameter named as DeepSpeed names the parameter (alone, or
after its unit's name) gives each TP rank's local shape and the boxes of the logical tensors its
rows hold (`ckptkit.layouts.placement.local_param`). Each tensor of a state the layout lists
(``model/``, ``optimizer/fp32/``, ...) is put together from every rank's piece; a part the layout
replicates is taken from rank 0 and checked equal on every other rank; a tensor the layout does
not name (a buffer, a step count) must be the same on every rank. Anything else is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ckptkit.boxes import Box, tiling_problems
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout, StateGroup
from ckptkit.layouts.model import expand
from ckptkit.layouts.parts import ParamSpec, Part
from ckptkit.layouts.placement import local_param
from ckptkit.manifest.dtypes import itemsize
from ckptkit.ops.convert import TensorSpec
from ckptkit.state.tree import escape, unescape

ReadLocal = Callable[[int, TensorSpec], memoryview]  # (model-parallel rank, its tensor) -> bytes, C order
Joined = tuple[TensorSpec, Callable[[], memoryview], int]  # what is written, its bytes on demand, pieces read


def local_params(layout: Layout, tp: int, tp_rank: int) -> dict[str, ParamSpec]:
    """Each parameter of the layout as TP rank `tp_rank` holds it, by the names a framework may
    give it: the parameter's name and its unit's name before it (layers expanded)."""
    out: dict[str, ParamSpec] = {}
    for unit in layout.units:
        for layer in layout.unit_layers(unit):
            for param in unit.params:
                spec = local_param(param, layer, tp, tp_rank)
                out.setdefault(expand(param.name, layer), spec)
                out.setdefault(expand(f"{unit.name}.{param.name}", layer), spec)
    return out


def join_model_parallel(ranks: Sequence[Sequence[tuple[TensorSpec, int]]], layout: Layout, read: ReadLocal) -> list[Joined]:
    """Plan the whole tensors of a save whose model-parallel rank r holds the TP-local tensors
    `ranks[r]` (names ``<state prefix>/<framework name>``; each with the number of pieces it is
    read from).

    Raises:
        ManifestError: the ranks' tensors do not fit the layout (every problem named, at most 10).
    """
    tp = len(ranks)
    local = [{s.name: s for s, _ in specs} for specs in ranks]
    counts = [{s.name: n for s, n in specs} for specs in ranks]
    params = [local_params(layout, tp, r) for r in range(tp)]
    groups = sorted(layout.states, key=lambda g: len(g.prefix), reverse=True)  # the longest prefix first
    problems = [f"model-parallel rank {r} holds {n}, rank 0 does not" for r in range(1, tp) for n in local[r] if n not in local[0]]
    out: list[Joined] = []
    for name, spec in local[0].items():
        theirs = [local[r].get(name) for r in range(tp)]
        if any(t is None or t.dtype != spec.dtype or t.kind != spec.kind for t in theirs):
            problems.append(f"{name}: not held alike by every model-parallel rank")
            continue
        group = next((g for g in groups if g.tensor_of(name) is not None), None)
        key = unescape(group.tensor_of(name) or "") if group is not None else ""
        held = [params[r].get(key) for r in range(tp)] if group is not None else [None]
        if held[0] is None:
            if any(t is not None and t.shape != spec.shape for t in theirs):
                problems.append(f"{name}: of other shapes on other model-parallel ranks, and the layout does not cut it")
                continue
            out.append((spec, partial(_same_on_every_rank, read, spec, tp), counts[0][name]))
            continue
        shapes = [t.shape for t in theirs if t is not None]
        want = [h.shape if h is not None else () for h in held]
        if shapes != want:
            problems.append(f"{name}: the ranks hold shapes {[list(s) for s in shapes]}, the layout says {[list(s) for s in want]}")
            continue
        assert group is not None
        out += _joined_parts(group, spec, theirs, held, read, problems, [c[name] for c in counts])  # type: ignore[arg-type]
    if problems:
        raise ManifestError(f"the model-parallel ranks do not fit the layout {layout.name!r}: {len(problems)} problem(s): "
                            + "; ".join(problems[:10]))
    return out


def _joined_parts(group: StateGroup, spec: TensorSpec, theirs: list[TensorSpec], held: list[ParamSpec], read: ReadLocal,
                  problems: list[str], counts: list[int]) -> list[Joined]:
    """The logical tensors one local parameter holds parts of, each joined over the ranks."""
    out: list[Joined] = []
    for tensor in dict.fromkeys(p.name for p in held[0].parts):
        pieces = [(r, theirs[r], part) for r in range(len(held)) for part in held[r].parts if part.name == tensor]
        kept = [(r, s, p) for r, s, p in pieces if not (p.replicated and r)]
        shape = pieces[0][2].global_shape
        tiling = tiling_problems(shape, [Box(p.offsets, p.lengths) for _, _, p in kept])
        if tiling:
            problems.append(f"{group.fqn(tensor)}: {tiling[0]}")
            continue
        joined = TensorSpec(name=group.fqn(escape(tensor)), source=f"{spec.source} of {len(held)} model-parallel ranks",
                            dtype=spec.dtype, shape=shape, kind=spec.kind)
        replicas = [(r, s, p) for r, s, p in pieces if p.replicated and r]
        out.append((joined, partial(_join, read, joined, kept, replicas), sum(counts[r] for r in {r for r, _, _ in pieces})))
    return out


def _join(read: ReadLocal, spec: TensorSpec, pieces: list[tuple[int, TensorSpec, Part]],
          replicas: list[tuple[int, TensorSpec, Part]]) -> memoryview:
    """One logical tensor from its ranks' pieces; replicated parts checked against rank 0's."""
    width = itemsize(spec.dtype)
    buf = np.empty(math.prod(spec.shape) * width, dtype=np.uint8)
    view = buf.reshape(*spec.shape, width)
    for r, local, part in pieces:
        view[Box(part.offsets, part.lengths).slices()] = _local(read, r, local)[part.local_box().slices()]
    for r, local, part in replicas:
        if not np.array_equal(view[Box(part.offsets, part.lengths).slices()], _local(read, r, local)[part.local_box().slices()]):
            raise IntegrityError(f"{spec.name}: model-parallel rank {r} holds another value than rank 0 of a part the "
                                 f"layout replicates")
    return buf.data


def _local(read: ReadLocal, rank: int, spec: TensorSpec) -> np.ndarray[Any, Any]:
    return np.frombuffer(read(rank, spec), dtype=np.uint8).reshape(*spec.shape, itemsize(spec.dtype))


def _same_on_every_rank(read: ReadLocal, spec: TensorSpec, tp: int) -> memoryview:
    """A tensor the layout does not cut: rank 0's, checked equal on every rank."""
    mine = read(0, spec)
    for r in range(1, tp):
        if bytes(read(r, spec)) != bytes(mine):
            raise IntegrityError(f"{spec.name}: model-parallel rank {r} holds another value than rank 0, and the layout "
                                 f"does not say how it is cut")
    return mine


__all__ = ["Joined", "ReadLocal", "join_model_parallel", "local_params"]
