"""What the ranks of a topology save of a layout, and where each box then lies, derived rather
than listed (pure).

A checkpoint saved this way needs no list of boxes: its manifest names the layout, the
topology and each state group's dtype, and every box, its file and its key follow from them.
The rule (``ranges``, manifest schema 1.6):

- Rank r writes file r. Only context-parallel rank 0 of each group writes (the others hold
  replicas); tensor-parallel replicas (a norm every TP rank holds) are written by TP rank 0.
- A state group ZeRO shards (optimizer state from stage 1, parameters at stage 3) is written
  as it is held: each data-parallel rank writes the boxes of its range of each buffer
  (``placement.rank_boxes``); an expert buffer's range i by the rank of DP index
  ``run + i * ep``.
- A state group held whole (parameters below stage 3, everything at stage 0) is written once:
  the distinct boxes of one pipeline stage and TP rank (its dense buffers, or one EP run's
  experts), largest first (ties in placement order), each go to the replica that has been
  dealt the fewest elements so far (ties: the lowest DP index), every group its copy of the
  box to the same replica.
- Within a file a tensor's boxes are keyed by its name, then ``<name>#1``, ``<name>#2``, ...
  in the order the rank writes them.

Everything a rank needs (its writes, the boxes overlapping a box it loads) costs time in
proportion to the stage it touches, never to the number of ranks.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from ..boxes import Box
from ..errors import LayoutError
from ..manifest import Manifest, Topology
from ..manifest.model import Shard
from .model import EXPERT, LAYER, Layout, StateGroup, Unit, parse_layout
from .parts import ParamSpec, Part, partition, unit_offsets
from .placement import _sharded, _stage, buffers, coordinates, range_boxes, rank_of, stage_layers, topology_problems

RULE: Literal["ranges"] = "ranges"


@dataclass(frozen=True, slots=True)
class Write:
    """One box a rank writes: the tensor (a state group's name of it), the box, its key in the file."""

    fqn: str
    box: Box
    key: str


@dataclass(frozen=True)
class _Buffer:
    params: list[ParamSpec]
    offsets: list[int]
    numel: int
    quantum: int
    expert: bool


@dataclass(frozen=True)
class _Slice:
    """The buffers of one pipeline stage on one TP rank (the dense ones, and one EP run's
    experts), and where each logical tensor's parts are in them."""

    buffers: list[_Buffer]
    where: dict[str, list[tuple[int, int, int]]]  # logical tensor -> (buffer, param, part)


def _key(fqn: str, k: int) -> str:
    return fqn if k == 0 else f"{fqn}#{k}"


class Saved:
    """The boxes `topology`'s ranks save of `layout`'s state groups `groups` (labels; default:
    all of them) by the ``ranges`` rule, computed per stage on demand and cached."""

    def __init__(self, layout: Layout, topology: Topology, groups: list[str] | None = None) -> None:
        self.layout, self.topology = layout, topology
        wanted = [g.label for g in layout.states] if groups is None else groups
        self.groups: list[StateGroup] = [g for g in layout.states if g.label in wanted]
        self._sharded = {g.label: _sharded(g.role, topology.zero_stage) for g in self.groups}
        self._templates = _templates(layout)
        self._slices: dict[tuple[int, int, int], _Slice] = {}
        self._deals: dict[tuple[int, int, int | None], dict[tuple[str, Box], tuple[int, int]]] = {}
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._site_memo: dict[str, list[tuple[int, int, tuple[int, ...]]]] = {}
        self._strides = {axis: rank_of(layout, topology, {a: int(a == axis) for a in ("tp", "cp", "dp", "pp")}) for axis in ("tp", "dp", "pp")}

    # -- names ------------------------------------------------------------------------------

    def sharded(self, group: StateGroup) -> bool:
        """Whether ZeRO cuts `group` into ranges (else each box of it is held, and written, whole)."""
        return self._sharded[group.label]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor saved (fqn) with its global shape, group by group."""
        if self._shapes is None:
            logical = self.layout.tensors()
            self._shapes = {g.fqn(n): shape for g in self.groups for n, shape in logical.items()}
        return self._shapes

    def find(self, fqn: str) -> tuple[StateGroup, str, tuple[int, ...]] | None:
        """The state group, logical tensor and global shape of `fqn`, or None when the layout
        does not place it (found from the layout's name templates, without listing every tensor)."""
        for group in self.groups:
            name = group.tensor_of(fqn)
            if name is None:
                continue
            sites = self._sites(name)
            if sites:
                return group, name, sites[0][2]
        return None

    def _sites(self, name: str) -> list[tuple[int, int, tuple[int, ...]]]:
        """(pipeline stage, EP run, shape) of every unit instance holding logical tensor `name`
        (matched against every name template once per name)."""
        found = self._site_memo.get(name)
        if found is None:
            found = self._site_memo[name] = self._match_sites(name)
        return found

    def _match_sites(self, name: str) -> list[tuple[int, int, tuple[int, ...]]]:
        out = []
        t = self.topology
        for pattern, unit, shape in self._templates:
            found = pattern.fullmatch(name)
            if found is None:
                continue
            layer = int(found["layer"]) if "layer" in pattern.groupindex else None
            expert = int(found["expert"]) if "expert" in pattern.groupindex else None
            if layer is not None and (str(layer) != found["layer"] or layer not in self.layout.unit_layers(unit)):
                continue
            if expert is not None and (str(expert) != found["expert"] or not 0 <= expert < (unit.experts or 0)):
                continue
            if unit.place == "first":
                stage = 0
            elif unit.place == "last":
                stage = t.pp - 1
            else:
                stage = _stage_of(self.layout, t.pp, layer)
            run = 0 if expert is None else expert // ((unit.experts or 1) // t.ep)
            out.append((stage, run, shape))
        return out

    # -- one rank ---------------------------------------------------------------------------

    def writes(self, rank: int) -> list[Write]:
        """The boxes rank `rank` writes, in file order, with their keys."""
        t = self.topology
        c = coordinates(self.layout, t, rank)
        if c["cp"]:
            return []
        run = c["dp"] % t.ep
        out: list[Write] = []
        counts: dict[str, int] = {}

        def add(fqn: str, box: Box) -> None:
            k = counts.get(fqn, 0)
            counts[fqn] = k + 1
            out.append(Write(fqn, box, _key(fqn, k)))

        sharded = [g for g in self.groups if self.sharded(g)]
        whole = [g for g in self.groups if not self.sharded(g)]
        for buffer in self._slice(c["pp"], c["tp"], run).buffers if sharded else ():
            size, index = (t.dp // t.ep, c["dp"] // t.ep) if buffer.expert else (t.dp, c["dp"])
            _, lo, hi = partition(buffer.numel, size, index, buffer.quantum)
            found = [(p, b) for p, b in range_boxes(buffer.params, buffer.offsets, lo, hi) if c["tp"] == 0 or not p.replicated]
            for group in sharded:
                for part, boxes in found:
                    for box in boxes:
                        add(group.fqn(part.name), box)
        if whole:
            mine = [(c["pp"], c["tp"], None, c["dp"]), (c["pp"], c["tp"], run, c["dp"] // t.ep)]
            for pp_rank, tp_rank, expert_run, replica in mine:
                for (name, box), (who, _) in self._deal(pp_rank, tp_rank, expert_run).items():
                    if who == replica:
                        for group in whole:
                            add(group.fqn(name), box)
        return out

    # -- one tensor -------------------------------------------------------------------------

    def boxes_key(self, fqn: str) -> tuple[str, bool] | None:
        """(logical tensor, sharded?) of `fqn`, the same for every state group cut alike: the
        tensors of equal keys are cut into the same boxes (None: the layout does not place `fqn`)."""
        found = self.find(fqn)
        return None if found is None else (found[1], self.sharded(found[0]))

    def overlapping(self, fqn: str, box: Box) -> list[Shard]:
        """Where the boxes of `fqn` that share an element with `box` lie (all of them for its
        whole box); empty when the layout does not place `fqn`."""
        found = self.find(fqn)
        if found is None:
            return []
        group, name, _ = found
        t = self.topology
        out: list[Shard] = []
        for stage, run, _ in self._sites(name):
            for tp_rank in range(t.tp):
                piece = self._slice(stage, tp_rank, run)
                where = piece.where.get(name, [])
                for b, s, q in where:
                    buffer = piece.buffers[b]
                    part = buffer.params[s].parts[q]
                    if tp_rank and part.replicated:
                        continue
                    whole = Box(part.offsets, part.lengths)
                    common = whole.intersect(box) if box.ndim else whole
                    if common is None or (not common.volume and common.ndim):
                        continue
                    if self.sharded(group):
                        named = sorted({s2 for b2, s2, _ in where if b2 == b})  # the params of the buffer holding `name`
                        out += self._ranged(group, name, stage, tp_rank, run, buffer, s, q, common, named)
                    else:
                        who, k = self._deal(stage, tp_rank, run if buffer.expert else None)[(name, whole)]
                        dp = run + who * t.ep if buffer.expert else who
                        out.append(Shard(whole, self._rank(tp_rank, dp, stage), _key(fqn, k)))
        return out

    def _ranged(self, group: StateGroup, name: str, stage: int, tp_rank: int, run: int, buffer: _Buffer,
                s: int, q: int, common: Box, named: list[int]) -> list[Shard]:
        """The range boxes of part q of param s of `buffer` that meet `common` (a box inside the
        part). `named`: the params of the buffer with a part of `name`, the only ones whose boxes
        count in its key numbers (so the only ones split into boxes)."""
        t = self.topology
        spec, part = buffer.params[s], buffer.params[s].parts[q]
        first, last = _flat_extent(spec, part, common)
        start = buffer.offsets[s]
        size = t.dp // t.ep if buffer.expert else t.dp
        chunk, _, _ = partition(buffer.numel, size, 0, buffer.quantum)
        fqn = group.fqn(name)
        params, offsets = [buffer.params[j] for j in named], [buffer.offsets[j] for j in named]
        out = []
        for i in range((start + first) // chunk, (start + last - 1) // chunk + 1):
            lo, hi = i * chunk, min((i + 1) * chunk, buffer.numel)
            k = 0
            for p, boxes in range_boxes(params, offsets, lo, hi):
                if p.name != name or (tp_rank and p.replicated):
                    continue
                for b in boxes:
                    if p is part and (b.intersect(common) is not None or not b.ndim):
                        out.append(Shard(b, self._rank(tp_rank, run + i * t.ep if buffer.expert else i, stage), _key(fqn, k)))
                    k += 1
        return out

    def _rank(self, tp_rank: int, dp: int, stage: int) -> int:
        """The rank at (tp_rank, context-parallel rank 0, dp, stage): `rank_of` without a dict per box."""
        return tp_rank * self._strides["tp"] + dp * self._strides["dp"] + stage * self._strides["pp"]

    # -- per stage --------------------------------------------------------------------------

    def _slice(self, stage: int, tp_rank: int, run: int) -> _Slice:
        key = (stage, tp_rank, run)
        found = self._slices.get(key)
        if found is None:
            t = self.topology
            placed = _stage(self.layout, t.tp, tp_rank, t.pp, stage, t.ep, run)
            out: list[_Buffer] = []
            where: dict[str, list[tuple[int, int, int]]] = {}
            for params, quantum, expert in buffers(self.layout, placed):
                offsets, numel = unit_offsets(params)
                for s, spec in enumerate(params):
                    for q, part in enumerate(spec.parts):
                        where.setdefault(part.name, []).append((len(out), s, q))
                out.append(_Buffer(params, offsets, numel, quantum, expert))
            found = self._slices[key] = _Slice(out, where)
        return found

    def _deal(self, stage: int, tp_rank: int, run: int | None) -> dict[tuple[str, Box], tuple[int, int]]:
        """The replica (index in the DP or expert-DP group) each whole box of a stage's dense
        buffers (`run` None) or of one EP run's expert buffers goes to, with its key number."""
        key = (stage, tp_rank, run)
        found = self._deals.get(key)
        if found is not None:
            return found
        t = self.topology
        items: list[tuple[str, Box]] = []
        for buffer in self._slice(stage, tp_rank, run or 0).buffers:
            if buffer.expert != (run is not None):
                continue
            for part, boxes in range_boxes(buffer.params, buffer.offsets, 0, buffer.numel):
                if tp_rank == 0 or not part.replicated:
                    items += [(part.name, b) for b in boxes if b.volume or not b.ndim]
        replicas = t.dp // t.ep if run is not None else t.dp
        heap = [(0, r) for r in range(replicas)]
        dealt: dict[tuple[str, Box], int] = {}
        for i in sorted(range(len(items)), key=lambda i: (-items[i][1].volume, i)):
            load, r = heapq.heappop(heap)
            dealt[items[i]] = r
            heapq.heappush(heap, (load + max(items[i][1].volume, 1), r))
        numbered: dict[tuple[str, Box], tuple[int, int]] = {}
        counts: dict[tuple[int, str], int] = {}
        for item in items:  # key numbers in the order the replica writes its boxes
            r = dealt[item]
            k = counts.get((r, item[0]), 0)
            counts[(r, item[0])] = k + 1
            numbered[item] = (r, k)
        self._deals[key] = numbered
        return numbered


def _stage_of(layout: Layout, pp: int, layer: int | None) -> int:
    """The pipeline stage holding `layer`."""
    for stage in range(pp):
        if layer in stage_layers(layout, pp, stage):
            return stage
    raise ValueError(f"layer {layer} is on no stage")


def _templates(layout: Layout) -> list[tuple[re.Pattern[str], Unit, tuple[int, ...]]]:
    """A pattern per (unit, logical tensor template): ``{layer}`` and ``{expert}`` match numbers."""
    out: list[tuple[re.Pattern[str], Unit, tuple[int, ...]]] = []
    seen = set()
    for u, unit in enumerate(layout.units):
        for param in unit.params:
            for part in param.parts:
                if (u, part.tensor) in seen:
                    continue
                seen.add((u, part.tensor))
                text = re.escape(part.tensor)
                text = text.replace(re.escape(LAYER), r"(?P<layer>\d+)").replace(re.escape(EXPERT), r"(?P<expert>\d+)")
                out.append((re.compile(text), unit, part.shape))
    return out


def _flat_extent(spec: ParamSpec, part: Part, common: Box) -> tuple[int, int]:
    """The flat positions [first, last) within local parameter `spec` spanned by `common` (a
    box of the part's logical tensor, in global coordinates)."""
    if not spec.shape:
        return 0, 1
    local = part.local_box()
    lo = [l + c - o for l, c, o in zip(local.offsets, common.offsets, part.offsets)]
    hi = [x + n - 1 for x, n in zip(lo, common.lengths)]
    return _ravel(lo, spec.shape), _ravel(hi, spec.shape) + 1


def _ravel(index: list[int], shape: tuple[int, ...]) -> int:
    flat = 0
    for i, n in zip(index, shape):
        flat = flat * n + i
    return flat


class RangesView:
    """The ``ranges`` rule over one manifest (``Manifest.derived``): what `Saved` derives, in the
    manifest's terms (file r is rank r's)."""

    def __init__(self, manifest: Manifest) -> None:
        assert manifest.derived is not None
        if manifest.layout is None:
            raise ValueError("derived: the tensors are derived from the layout, and the manifest has none")
        try:
            layout = parse_layout(dict(manifest.layout), source="the manifest's layout")
        except LayoutError as exc:
            raise ValueError(str(exc)) from None
        problems = topology_problems(layout, manifest.topology)
        if problems:
            raise ValueError(f"derived: the layout does not fit the topology: {'; '.join(problems)}")
        self.groups = manifest.derived.groups
        self.saved = Saved(layout, manifest.topology, list(self.groups))
        unknown = sorted(set(self.groups) - {g.label for g in self.saved.groups})
        if unknown:
            raise ValueError(f"derived: groups {unknown} are not state groups of the layout")
        self._by_file: dict[int, list[tuple[str, Box, str, str]]] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.saved.shapes()

    def find(self, fqn: str) -> tuple[str, str, tuple[int, ...]] | None:
        found = self.saved.find(fqn)
        if found is None:
            return None
        group = self.groups[found[0].label]
        return group.dtype, group.kind, found[2]

    def overlapping(self, fqn: str, box: Box) -> list[Shard]:
        return self.saved.overlapping(fqn, box)

    def boxes_key(self, fqn: str) -> Hashable:
        return self.saved.boxes_key(fqn)

    def files(self) -> int:
        return self.saved.topology.world_size

    def file_keys(self, file: int) -> list[tuple[str, Box, str, str]]:
        found = self._by_file.get(file)
        if found is None:
            writes = self.saved.writes(file) if 0 <= file < self.files() else []
            found = self._by_file[file] = [(w.fqn, w.box, w.key, self._dtype(w.fqn)) for w in writes]
        return found

    def _dtype(self, fqn: str) -> str:
        found = self.find(fqn)
        assert found is not None, fqn
        return found[0]
