"""A layout over a topology (pure): each rank's local parameters, the boxes it holds, and
which ranks hold each distinct box.

Ranks are numbered by the layout's mesh order (fastest axis first). A stage holds the
``first`` units (stage 0), its layers' units, and the ``last`` units (the last stage). ZeRO
cuts each buffer (per the layout's ``zero.flatten``) into equal DP ranges; context-parallel
ranks hold the same boxes as their DP peer. An expert unit's buffer holds the experts of the
rank's EP run (DP rank d holds run ``d % ep``) and is cut into equal ranges over the ``dp / ep``
ranks holding that run (d's range is ``d // ep``); an expert unit is always a buffer of its own.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Mapping
from operator import add

from ..boxes import Box, flat_range_to_boxes
from ..manifest import Topology
from .model import Layout, Param, StateGroup, Unit, expand
from .parts import ParamSpec, Part, partition, unit_offsets, vocab_rows

Holders = dict[str, dict[Box, list[int]]]


def topology_problems(layout: Layout, topology: Topology) -> list[str]:
    """Return every reason the layout cannot be laid out over `topology`; empty when it can."""
    t = topology
    problems = []
    if t.world_size != t.tp * t.pp * t.dp * t.cp:
        problems.append(f"world size {t.world_size} is not tp x pp x dp x cp ({t.tp * t.pp * t.dp * t.cp})")
    experts = layout.experts
    if t.ep != 1 and not experts:
        problems.append(f"the {layout.name} layout has no experts (ep must be 1)")
    if experts and t.dp % t.ep:
        problems.append(f"ep {t.ep} does not divide dp {t.dp} (expert-parallel ranks are carved out of the data-parallel ranks)")
    if experts and experts % t.ep:
        problems.append(f"{experts} experts are not divisible by ep {t.ep}")
    sizes = {"tp": t.tp, "pp": t.pp, "dp": t.dp, "cp": t.cp, "ep": t.ep}
    for c in layout.constraints:
        n = sizes[c.axis]
        if c.divides is not None and c.divides % n:
            problems.append(f"{c.divides} {c.what} are not divisible by {c.axis} {n}")
        if c.at_most is not None and n > c.at_most:
            problems.append(f"{c.axis} {n} is more than {c.at_most}: {c.what}")
    uneven = [p for unit in layout.units for param in unit.params for p in _tp_problems(param, t.tp)]
    if uneven:
        shown = ", ".join(uneven[:10]) + (f" and {len(uneven) - 10} more" if len(uneven) > 10 else "")
        problems.append(f"tp {t.tp} does not cut {len(uneven)} tensor(s) evenly: {shown}")
    stages = t.pp * layout.virtual_stages
    if layout.num_layers % stages:
        by = f"pp {t.pp}" if layout.virtual_stages == 1 else f"pp {t.pp} x {layout.virtual_stages} virtual stages"
        problems.append(f"{layout.num_layers} layers are not divisible by {by}")
    return problems


def placed_tensors(layout: Layout, shapes: Mapping[str, tuple[int, ...]]) -> tuple[set[str], list[str]]:
    """Return which of the tensors `shapes` (fqn -> global shape) the layout places, and every
    problem: a state group held only in part (a group held not at all is fine: a checkpoint
    without optimizer state), or a tensor whose shape is not the layout's."""
    placed: set[str] = set()
    problems = []
    wanted = layout.tensors()
    for group in layout.states:
        names = {group.fqn(n): want for n, want in wanted.items()}
        missing = [n for n in names if n not in shapes]
        if len(missing) == len(names):
            continue
        if missing:
            shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
            problems.append(f"only part of {group.label!r} is there: missing {shown}")
        for fqn, want in names.items():
            if fqn in shapes and tuple(shapes[fqn]) != want:
                problems.append(f"{fqn}: the layout says shape {list(want)}, the tensor is {list(shapes[fqn])}")
            elif fqn in shapes:
                placed.add(fqn)
    return placed, problems


def fit_problems(layout: Layout, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Every reason the layout does not describe the tensors `shapes` (fqn -> global shape): the
    problems of `placed_tensors`, or that it places none of them."""
    placed, problems = placed_tensors(layout, shapes)
    if not placed:
        problems.append(f"it places none of the tensors (its groups: {', '.join(layout.tensor_groups())})")
    return problems


def _tp_problems(param: Param, tp: int) -> list[str]:
    cut = param.tp
    if cut is None or cut.pad_multiple is not None or tp == 1:
        return []
    if cut.groups is not None:
        if cut.groups % tp:
            return [f"{param.parts[0].tensor} ({cut.groups} groups)"]
        return []
    out = []
    for part in param.parts:
        length = _length(part.shape, part.start, part.length, cut.dim)
        if length % tp:
            out.append(f"{part.tensor} ({length} along dim {cut.dim})")
    return out


def _length(shape: tuple[int, ...], start: int, length: int | None, dim: int) -> int:
    size = shape[dim] if shape else 1
    return size - start if length is None else length


def local_param(param: Param, layer: int | None, tp: int, tp_rank: int, expert: int | None = None) -> ParamSpec:
    """The parameter as TP rank `tp_rank` of `tp` holds it (of `expert`, in an expert unit):
    local shape and parts."""
    cut = param.tp
    dim = cut.dim if cut is not None else 0
    pieces: list[tuple[int, int, int]] = []  # (part index, start along dim, length); stacked in order
    pos = 0
    if cut is None:
        pieces = [(i, p.start, _length(p.shape, p.start, p.length, dim)) for i, p in enumerate(param.parts)]
    elif cut.pad_multiple is not None:
        p = param.parts[0]
        per, start, real = vocab_rows(_length(p.shape, p.start, p.length, dim), tp, tp_rank, cut.pad_multiple)
        pieces, pos = [(0, p.start + min(start, _length(p.shape, p.start, p.length, dim)), real)], per
    elif cut.groups is not None:
        per_rank = cut.groups // tp
        for g in range(tp_rank * per_rank, (tp_rank + 1) * per_rank):
            for i, p in enumerate(param.parts):
                n = _length(p.shape, p.start, p.length, dim) // cut.groups
                pieces.append((i, p.start + g * n, n))
    else:
        for i, p in enumerate(param.parts):
            n = _length(p.shape, p.start, p.length, dim) // tp
            pieces.append((i, p.start + tp_rank * n, n))
    parts = []
    row = 0
    for i, start, n in pieces:
        p = param.parts[i]
        if p.shape:
            offsets = tuple(start if d == dim else 0 for d in range(len(p.shape)))
            lengths = tuple(n if d == dim else s for d, s in enumerate(p.shape))
        else:
            offsets, lengths = (), ()
        parts.append(Part(expand(p.tensor, layer, expert), p.shape, offsets, lengths, row, row + n, cut is None, dim))
        row += n
    first = param.parts[0].shape
    shape = tuple(max(row, pos) if d == dim else s for d, s in enumerate(first))
    return ParamSpec(expand(param.name, None, expert), shape, tuple(parts))


def stage_layers(layout: Layout, pp: int, pp_rank: int) -> list[int]:
    """The layers stage `pp_rank` holds, in order (with virtual stages: its chunks, round robin)."""
    chunks = pp * layout.virtual_stages
    per = layout.num_layers // chunks if chunks else 0
    return [i for c in range(pp_rank, chunks, pp) for i in range(c * per, (c + 1) * per)]


Placed = list[tuple[bool, list[ParamSpec]]]  # (expert unit?, its local parameters), per unit in stage order


def stage_units(
    layout: Layout, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int = 1, ep_rank: int = 0
) -> list[list[ParamSpec]]:
    """The local parameters of each unit of a pipeline stage, in the order the stage runs them
    (an expert unit: the parameters of EP run `ep_rank`'s experts, expert by expert)."""
    return [specs for _, specs in _stage(layout, tp, tp_rank, pp, pp_rank, ep, ep_rank)]


def _stage(layout: Layout, tp: int, tp_rank: int, pp: int, pp_rank: int, ep: int, ep_rank: int,
           experts_only: bool = False) -> Placed:
    def unit(u: Unit, layer: int | None) -> tuple[bool, list[ParamSpec]]:
        if not u.experts:
            return False, [local_param(p, layer, tp, tp_rank) for p in u.params]
        per = u.experts // ep
        return True, [local_param(p, layer, tp, tp_rank, e) for e in range(ep_rank * per, (ep_rank + 1) * per) for p in u.params]

    def wanted(u: Unit) -> bool:
        return bool(u.experts) or not experts_only

    out = [unit(u, None) for u in layout.units if u.place == "first" and pp_rank == 0 and wanted(u)]
    layer_units = [(u, set(layout.unit_layers(u))) for u in layout.units if u.place == "layers" and wanted(u)]
    out += [unit(u, layer) for layer in stage_layers(layout, pp, pp_rank) for u, on in layer_units if layer in on]
    out += [unit(u, None) for u in layout.units if u.place == "last" and pp_rank == pp - 1 and wanted(u)]
    return out


def buffers(layout: Layout, units: Placed) -> Iterator[tuple[list[ParamSpec], int, bool]]:
    """Yield the flat buffers ZeRO cuts, with the quantum of their DP ranges (in elements) and
    whether they hold experts (cut over the expert-data-parallel ranks)."""
    align = layout.zero.align
    if layout.zero.flatten == "unit":
        yield from ((u, align, expert) for expert, u in units)
    elif layout.zero.flatten == "stage":
        dense = [p for expert, u in units if not expert for p in u]
        if dense:
            yield dense, align, False
        yield from ((u, align, True) for expert, u in units if expert)
    else:
        for expert, u in units:
            for spec in u:
                yield [spec], math.prod(spec.shape[1:]) if spec.shape else 1, expert


def coordinates(layout: Layout, topology: Topology, rank: int) -> dict[str, int]:
    """The (tp, cp, dp, pp) coordinates of `rank` in the layout's mesh order."""
    sizes = {"tp": topology.tp, "cp": topology.cp, "dp": topology.dp, "pp": topology.pp}
    out: dict[str, int] = {}
    for axis in layout.mesh:
        out[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return out


def rank_of(layout: Layout, topology: Topology, coords: dict[str, int]) -> int:
    sizes = {"tp": topology.tp, "cp": topology.cp, "dp": topology.dp, "pp": topology.pp}
    rank, stride = 0, 1
    for axis in layout.mesh:
        rank += coords[axis] * stride
        stride *= sizes[axis]
    return rank


def _sharded(role: str, zero: int) -> bool:
    return zero == 3 if role == "param" else zero >= 1


def rank_boxes(layout: Layout, topology: Topology, rank: int) -> dict[str, dict[str, list[Box]]]:
    """Return the boxes of every logical tensor that `rank` holds, by state group (its label:
    the prefix, or ``<prefix>/*/<suffix>``) then name."""
    t = topology
    c = coordinates(layout, t, rank)
    out: dict[str, dict[str, list[Box]]] = {g.label: {} for g in layout.states}
    placed = _stage(layout, t.tp, c["tp"], t.pp, c["pp"], t.ep, c["dp"] % t.ep)
    for params, quantum, expert in buffers(layout, placed):
        offsets, numel = unit_offsets(params)
        size, index = (t.dp // t.ep, c["dp"] // t.ep) if expert else (t.dp, c["dp"])
        _, lo, hi = partition(numel, size, index, quantum)
        for group in layout.states:
            a, b = (lo, hi) if _sharded(group.role, topology.zero_stage) else (0, numel)
            for part, boxes in range_boxes(params, offsets, a, b):
                out[group.label].setdefault(part.name, []).extend(boxes)
    return out


def holders(layout: Layout, topology: Topology) -> Holders:
    """Return, for every tensor (a state group's name of it, ``<prefix>/<name>``), each distinct non-empty box any rank of
    the topology holds, with the ranks holding it.

    The same boxes as `rank_boxes` over every rank, computed once per (tp, pp) coordinate: a
    replica held by a whole DP (and CP) group is one entry, not one per rank.
    """
    t = topology
    out: Holders = {}
    whole = [g for g in layout.states if not _sharded(g.role, t.zero_stage)]
    split = [g for g in layout.states if _sharded(g.role, t.zero_stage)]

    def add(groups: list[StateGroup], found: list[tuple[Part, list[Box]]], ranks: list[int]) -> None:
        for part, boxes in found:
            tables = [out.setdefault(group.fqn(part.name), {}) for group in groups]
            for box in boxes:
                for table in tables:
                    table.setdefault(box, []).extend(ranks)

    for pp_rank in range(t.pp):
        for tp_rank in range(t.tp):
            by_dp = [[rank_of(layout, t, {"tp": tp_rank, "cp": c, "dp": d, "pp": pp_rank}) for c in range(t.cp)]
                     for d in range(t.dp)]
            for ep_rank in range(t.ep):  # the dense buffers once, the experts of every EP run
                placed = _stage(layout, t.tp, tp_rank, t.pp, pp_rank, t.ep, ep_rank, experts_only=ep_rank > 0)
                for params, quantum, expert in buffers(layout, placed):
                    dps = list(range(ep_rank, t.dp, t.ep)) if expert else list(range(t.dp))
                    offsets, numel = unit_offsets(params)
                    if whole:
                        add(whole, range_boxes(params, offsets, 0, numel), [r for d in dps for r in by_dp[d]])
                    for i, d in enumerate(dps) if split else ():
                        _, lo, hi = partition(numel, len(dps), i, quantum)
                        add(split, range_boxes(params, offsets, lo, hi), by_dp[d])
    return out


def range_boxes(params: list[ParamSpec], offsets: list[int], lo: int, hi: int) -> list[tuple[Part, list[Box]]]:
    """Return, for every part the flat range [lo, hi) of a buffer touches, the boxes of its
    logical tensor the range holds (global coordinates). `offsets` are the parameters' flat
    offsets (``unit_offsets``); only the parameters the range meets are visited."""
    out: list[tuple[Part, list[Box]]] = []
    first = max(0, bisect.bisect_right(offsets, lo) - 1)
    for i in range(first, len(params)):
        spec, offset = params[i], offsets[i]
        if offset >= hi:
            break
        size = math.prod(spec.shape)
        x, y = max(offset, lo), min(offset + size, hi)
        if x >= y:
            continue
        local: list[Box] | None = None
        for part, span in zip(spec.parts, spec.spans):
            if span is not None:
                start = offset + span[0]
                px, py = max(start, x), min(start + span[1], y)
                if px < py:
                    origin = part.offsets
                    out.append((part, [Box(tuple(map(add, b.offsets, origin)), b.lengths)
                                       for b in flat_range_to_boxes(part.lengths, px - start, py - start)]))
                continue
            if local is None:
                local = flat_range_to_boxes(spec.shape, x - offset, y - offset)
            mine = part.local_box()
            boxes = [common.shifted(mine.offsets) for box in local if (common := box.intersect(mine)) is not None]
            if boxes:
                out.append((part, [Box(tuple(map(add, b.offsets, part.offsets)), b.lengths) for b in boxes]))
    return out
