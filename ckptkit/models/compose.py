"""Conversion from one view of a canonical model to another (pure): where each of the target
tool's tensors comes from, as runs of rows of the source tool's tensors.

A view places every canonical tensor in one of its tool's tensors (`placed`): whole, as a
block of rows of a fused tensor (Phi-3's ``qkv_proj``, Megatron's ``[gate; up]``), or as one run
of rows per group of an interleaved one (Megatron's ``linear_qkv``, GPT-NeoX's
``query_key_value``), or row by row where a tool keeps a head's rows in another order
(torchtitan's q and k, in the original Llama's rotary order). `compose` joins two placements through the canonical names: each target
tensor's rows, in order, are runs of rows of source tensors (`Run`), rows no canonical tensor
fills being padding (Megatron's vocabulary, padded to a multiple of its TP); a tensor stacking
experts on a leading axis (transformers' in-memory ``experts.gate_up_proj``) counts its rows
across both axes. So converting any
view to any other is one function, and adding a tool is one view.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..errors import LayoutError, summarize
from .spec import Block, ModelSpec, Tensor
from .view import EXPERT, LAYER, Fuse, View


@dataclass(frozen=True, slots=True)
class Run:
    """Rows [row, row + count) of a target tensor are rows [src_row, src_row + count) of `fqn`."""

    row: int
    count: int
    fqn: str
    src_row: int


@dataclass(frozen=True, slots=True)
class Span:
    """Rows [row, row + count) of the tool's tensor `stored` are rows [at, at + count) of canonical tensor `canonical`."""

    stored: str
    row: int
    canonical: str
    at: int
    count: int


@dataclass(frozen=True)
class Placement:
    """A model under a view: each tool tensor's shape, and the spans that fill it, in row order."""

    shapes: dict[str, tuple[int, ...]]
    spans: dict[str, tuple[Span, ...]]
    stacked: frozenset[str] = frozenset()  # the tensors stacking experts on a leading axis

    def rows(self, name: str) -> int:
        """The rows of tool tensor `name` (of a stacked one, across its expert and row axes)."""
        shape = self.shapes[name]
        return math.prod(shape[:2]) if name in self.stacked else shape[0] if shape else 1

    def of_canonical(self) -> dict[str, list[Span]]:
        """The spans of each canonical tensor, in its row order."""
        out: dict[str, list[Span]] = {}
        for spans in self.spans.values():
            for s in spans:
                out.setdefault(s.canonical, []).append(s)
        return {name: sorted(spans, key=lambda s: s.at) for name, spans in out.items()}


def _rows(t: Tensor) -> int:
    return t.shape[0] if t.shape else 1


def _stored_shape(t: Tensor, view: View, top: bool, rows: int | None = None) -> tuple[int, ...]:
    shape = (rows if rows is not None else view.padded_rows(t), *t.shape[1:]) if t.shape else ()
    return shape[::-1] if view.transposed and not top and len(shape) == 2 else shape  # the layers' matrices only


def _group(prefix: str, canonical: str, tensors: tuple[Tensor, ...], names: str, fused: tuple[Fuse, ...],
           view: View) -> Iterator[tuple[str, tuple[int, ...], tuple[Span, ...]]]:
    """The tool tensors of one scope (a layer, an expert): `prefix` the tool's, `canonical` the
    canonical prefix of its tensors; `names` the view's table for the scope."""
    by_name = {t.name: t for t in tensors}
    fusing = {p: f for f in fused if all(q in by_name for q in f.parts) for p in f.parts}
    done: set[str] = set()
    for t in tensors:
        fuse = fusing.get(t.name)
        if fuse is None:
            stored = prefix + view.rename(names, t.name)
            head = view.rotary.get(t.name, 0) if names == "layer" else 0  # a tool's rows in rotary order: one span each
            yield stored, _stored_shape(t, view, names == "top"), _rows_of(stored, 0, canonical + t.name, 0, _rows(t), head)
            continue
        if fuse.name in done:
            continue
        done.add(fuse.name)
        parts = [by_name[p] for p in fuse.parts]
        stored, rows = prefix + fuse.name, [_rows(p) for p in parts]
        groups = fuse.groups or 1
        if any(r % groups for r in rows):
            raise LayoutError(f"{stored}: fuses {', '.join(fuse.parts)} in {groups} groups, which do not divide their rows {rows}")
        spans: list[Span] = []
        row = 0
        for g in range(groups):
            for p, r in zip(parts, rows):
                head = view.rotary.get(p.name, 0) if names == "layer" else 0
                spans += _rows_of(stored, row, canonical + p.name, g * r // groups, r // groups, head)
                row += r // groups
        yield stored, _stored_shape(parts[0], view, names == "top", sum(rows)), tuple(spans)


def _rows_of(stored: str, row: int, canonical: str, at: int, count: int, head: int = 0) -> tuple[Span, ...]:
    """Rows [row, row + count) of `stored` holding rows [at, at + count) of `canonical`: one span,
    or (`head` > 0: whole heads of that size stored in the original Llama's rotary order) one
    span per row, stored row h*head + 2i + j being canonical row h*head + j*head/2 + i (i < head/2, j in 0, 1).

    Raises:
        LayoutError: a head size that is odd or does not divide the rows.
    """
    if not head:
        return (Span(stored, row, canonical, at, count),)
    if head % 2 or count % head or at % head:
        raise LayoutError(f"{stored}: {count} rows in heads of {head} in rotary order, which needs an even head size dividing the rows")
    half = head // 2
    return tuple(Span(stored, row + h + 2 * i + j, canonical, at + h + j * half + i, 1)
                 for h in range(0, count, head) for i in range(half) for j in (0, 1))


def _stacks(prefix: str, canonical: str, block: Block, view: View) -> Iterator[tuple[str, tuple[int, ...], tuple[Span, ...]]]:
    """A layer's experts stacked as `view` stacks them: each tool tensor [experts, rows, ...]
    holds every expert's parts one after another; its rows are counted across the two axes."""
    by_name = {t.name: t for t in block.expert_tensors}
    for stack in view.expert_stacks:
        missing = [p for p in stack.parts if p not in by_name]
        if missing:
            raise LayoutError(f"{prefix}{stack.name}: stacks {', '.join(missing)}, which the model's experts do not have")
        parts = [by_name[p] for p in stack.parts]
        rows = sum(_rows(p) for p in parts)
        spans, row = [], 0
        for e in range(block.experts):
            for p in parts:
                spans.append(Span(prefix + stack.name, row, f"{canonical}{e}.{p.name}", 0, _rows(p)))
                row += _rows(p)
        yield prefix + stack.name, (block.experts, rows, *parts[0].shape[1:]), tuple(spans)


def placed(spec: ModelSpec, view: View) -> Placement:
    """Every tool tensor of `spec` under `view`, with its shape and the canonical rows it holds.

    Raises:
        LayoutError: the view has no name for a tensor of the model, or a fusion that does not
            divide its parts' rows.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    spans: dict[str, tuple[Span, ...]] = {}
    stacked: set[str] = set()

    def add(found: Iterator[tuple[str, tuple[int, ...], tuple[Span, ...]]]) -> None:
        for stored, shape, s in found:
            shapes[stored], spans[stored] = shape, s

    add(_group("", "", spec.first, "top", (), view))
    for i, block in enumerate(spec.layers):
        layer = view.layer.replace(LAYER, str(i)) + "."
        add(_group(layer, f"layers.{i}.", block.tensors, "layer", view.fused, view))
        if block.experts and view.expert_stacks:
            stacked.update(f"{layer}{stack.name}" for stack in view.expert_stacks)
            add(_stacks(layer, f"layers.{i}.mlp.experts.", block, view))
            continue
        for e in range(block.experts):
            add(_group(f"{layer}{view.experts}.{e}.", f"layers.{i}.mlp.experts.{e}.", block.expert_tensors, "expert",
                       view.expert_fused, view))
    add(_group("", "", spec.last, "top", (), view))
    return Placement(shapes, spans, frozenset(stacked))


def _names(view: View) -> View:
    """What of a view names and cuts the model's tensors (not what it is called, nor the tied
    names it holds beside them)."""
    return replace(view, name="", tied={})


def compose(spec: ModelSpec, source: View, target: View, prefix: str = "") -> dict[str, list[Run]]:
    """Where each of `target`'s tensors comes from in a checkpoint of `spec` saved under
    `source`'s names (each name prefixed with `prefix`, a state's: ``model/``): runs of rows of
    source tensors, in the target tensor's row order (rows no run covers are padding).

    Raises:
        LayoutError: either view lacks a name for a tensor of the model, or one of them stores
            matrices transposed (GPT-2's: a conversion not written yet, but to itself).
    """
    if _names(source) == _names(target):  # the same names: each tensor is itself
        same = placed(spec, source)
        return {name: [Run(0, same.rows(name), prefix + name, 0)] for name in same.shapes}
    if source.transposed or target.transposed:  # the rows of a matrix stored [in, out] are its columns
        raise LayoutError(f"converting {source.name} to {target.name} would cut matrices stored transposed, which is not written yet")
    src = placed(spec, source).of_canonical()
    starts = {name: [s.at for s in spans] for name, spans in src.items()}
    out: dict[str, list[Run]] = {}
    missing: list[str] = []
    for stored, spans in placed(spec, target).spans.items():
        runs = out.setdefault(stored, [])
        for s in spans:
            if s.canonical not in src:
                missing.append(s.canonical)
                continue
            have_all = src[s.canonical]  # the source's spans of the canonical tensor: in row order, not overlapping
            for have in have_all[max(0, bisect.bisect_right(starts[s.canonical], s.at) - 1):]:
                if have.at >= s.at + s.count:
                    break
                lo, hi = max(s.at, have.at), min(s.at + s.count, have.at + have.count)
                if lo < hi:
                    runs.append(Run(s.row + lo - s.at, hi - lo, prefix + have.stored, have.row + lo - have.at))
    if missing:
        raise LayoutError(f"the {source.name} view places no {summarize(missing)}")
    return {name: _merged(runs) for name, runs in out.items()}


def _merged(runs: list[Run]) -> list[Run]:
    """Adjacent runs of one source's consecutive rows as one."""
    out: list[Run] = []
    for r in runs:
        last = out[-1] if out else None
        if last and last.fqn == r.fqn and last.row + last.count == r.row and last.src_row + last.count == r.src_row:
            out[-1] = Run(last.row, last.count + r.count, r.fqn, last.src_row)
        else:
            out.append(r)
    return out


__all__ = ["Placement", "Run", "Span", "compose", "placed"]
