"""How one rank's local parameters hold boxes of logical tensors, and how ZeRO cuts them (pure).

A local parameter (what a module holds on one TP rank) is made of parts: each part is a box
of a logical (unfused, unpadded) global tensor, lying at [row0, row1) along dim ``dim`` of
the local parameter (fused tensors stack their parts along that dim; padding rows belong to
no part). ZeRO and FSDP flatten the local parameters of a buffer in order and give each DP
rank an equal range (``partition``); ``part_ranges`` says which parts such a range touches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..boxes import Box


@dataclass(frozen=True)
class Part:
    """Rows [row0, row1) along `dim` of a local parameter hold the box (`offsets`, `lengths`) of
    logical tensor `name`.

    ``replicated``: every TP rank holds the same box.
    """

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    row0: int
    row1: int
    replicated: bool = False
    dim: int = 0

    def local_box(self) -> Box:
        """The part's box inside its local parameter."""
        offsets = tuple(self.row0 if d == self.dim else 0 for d in range(len(self.lengths)))
        return Box(offsets, self.lengths)


@dataclass(frozen=True)
class ParamSpec:
    """One local parameter of a module: its name in the module, local shape and logical parts.

    ``spans[i]`` is (flat start, size) of part i inside the parameter when the part is one flat
    range of it (see `is_contiguous`), else None; computed once.
    """

    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    spans: tuple[tuple[int, int] | None, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        spans = tuple((p.row0 * math.prod(self.shape[p.dim + 1 :]), math.prod(p.lengths)) if is_contiguous(self, p) else None
                      for p in self.parts)
        object.__setattr__(self, "spans", spans)


def column_parts(names: list[str], outs: list[int], in_features: int, tp: int, tp_rank: int) -> list[Part]:
    """Parts of a column-parallel weight fusing logical weights [out_i, in] row-wise, each split over TP."""
    parts, row = [], 0
    for name, out in zip(names, outs):
        local = out // tp
        parts.append(Part(name, (out, in_features), (tp_rank * local, 0), (local, in_features), row, row + local))
        row += local
    return parts


def row_parts(name: str, in_features: int, out_features: int, tp: int, tp_rank: int) -> list[Part]:
    """Parts of a row-parallel weight [out, in] whose input columns are split over TP."""
    local = in_features // tp
    return [Part(name, (out_features, in_features), (0, tp_rank * local), (out_features, local), 0, out_features)]


def padded(size: int, tp: int, multiple: int = 1) -> int:
    """Return `size` padded to a multiple of tp x `multiple` (padding is not part of the logical shape)."""
    step = tp * multiple
    return math.ceil(size / step) * step


def vocab_rows(vocab: int, tp: int, tp_rank: int, multiple: int = 1) -> tuple[int, int, int]:
    """Return (rows per rank, first vocab id, real rows) of a vocab-parallel weight on `tp_rank`."""
    per_rank = padded(vocab, tp, multiple) // tp
    start = tp_rank * per_rank
    return per_rank, start, max(0, min(start + per_rank, vocab) - start)


def vocab_parts(name: str, vocab: int, hidden: int, tp: int, tp_rank: int) -> list[Part]:
    _, start, real = vocab_rows(vocab, tp, tp_rank)
    return [Part(name, (vocab, hidden), (min(start, vocab), 0), (real, hidden), 0, real)]


def norm_parts(name: str, hidden: int) -> list[Part]:
    return replicated_parts(name, (hidden,))


def replicated_parts(name: str, shape: tuple[int, ...]) -> list[Part]:
    """The part of a parameter every TP rank holds whole (a norm, a router)."""
    return [Part(name, shape, (0,) * len(shape), shape, 0, shape[0], replicated=True)]


def unit_offsets(params: list[ParamSpec]) -> tuple[list[int], int]:
    """Return each parameter's offset in its buffer's flat order, and the buffer's size."""
    offsets, total = [], 0
    for spec in params:
        offsets.append(total)
        total += math.prod(spec.shape)
    return offsets, total


def partition(numel: int, dp: int, dp_rank: int, quantum: int = 1) -> tuple[int, int, int]:
    """Return (range size, lo, hi): the DP ranges are equal multiples of `quantum`, padded at
    the end, cut without regard to tensors."""
    chunk = -(-numel // (dp * quantum)) * quantum
    return chunk, min(dp_rank * chunk, numel), min((dp_rank + 1) * chunk, numel)


def is_contiguous(spec: ParamSpec, part: Part) -> bool:
    """Whether the part is one flat range of its parameter (the whole of it, or fused along the leading dim)."""
    return part.dim == 0 or math.prod(spec.shape[: part.dim]) == 1 or part.lengths == spec.shape


def part_ranges(params: list[ParamSpec], lo: int, hi: int) -> list[tuple[Part, int, int, int]]:
    """For the flat range [lo, hi) of a buffer: (part, part start, x, y) for every part it touches,
    where [x, y) is the overlap in flat coordinates and the part starts at flat `part start`.

    Only for parts that are flat ranges of their parameter (see `is_contiguous`).
    """
    offsets, _ = unit_offsets(params)
    out = []
    for spec, offset in zip(params, offsets):
        inner = math.prod(spec.shape[1:]) if spec.shape else 1
        for part in spec.parts:
            assert is_contiguous(spec, part), part.name
            a, b = offset + part.row0 * inner, offset + part.row1 * inner
            x, y = max(a, lo), min(b, hi)
            if x < y:
                out.append((part, a, x, y))
    return out
