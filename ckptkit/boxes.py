"""Box math over global tensors: intersections, flat ranges, byte runs and tiling checks (pure)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned block of a global tensor: per-dim offsets and lengths."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def volume(self) -> int:
        return math.prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def intersect(self, other: Box) -> Box | None:
        """Return the common part of two boxes, or None when they share no element."""
        offsets = []
        lengths = []
        for a, la, b, lb in zip(self.offsets, self.lengths, other.offsets, other.lengths):
            lo = a if a > b else b  # plain comparisons: this runs millions of times in big plans
            hi = a + la
            if b + lb < hi:
                hi = b + lb
            if hi <= lo:
                return None
            offsets.append(lo)
            lengths.append(hi - lo)
        return Box(tuple(offsets), tuple(lengths))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + lb <= a + la
            for a, la, b, lb in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )

    def shifted(self, origin: Sequence[int]) -> Box:
        """Return this box in the coordinates of a box that starts at `origin`."""
        return Box(tuple(o - s for o, s in zip(self.offsets, origin)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))


def full_box(shape: Sequence[int]) -> Box:
    """Return the box that covers a whole tensor of `shape`."""
    return Box((0,) * len(shape), tuple(shape))


def in_bounds(box: Box, shape: Sequence[int]) -> bool:
    if not len(box.offsets) == len(shape) == len(box.lengths):
        return False
    for o, n, s in zip(box.offsets, box.lengths, shape):
        if o < 0 or n < 0 or o + n > s:
            return False
    return True


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Cut the row-major flat element range [start, stop) of a tensor into boxes.

    A ZeRO / FSDP partition owns a flat range of a tensor; this returns the at most
    2·ndim−1 boxes that range covers, in row-major order.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    return _flat_boxes(shape, start, stop)


def _flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    zeros = (0,) * len(rest)
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        return [_prepend(r0, b) for b in _flat_boxes(rest, c0, c1)]
    boxes: list[Box] = []
    if c0:
        boxes += [_prepend(r0, b) for b in _flat_boxes(rest, c0, inner)]
        r0 += 1
    if r1 > r0:
        boxes.append(Box((r0, *zeros), (r1 - r0, *rest)))
    if c1:
        boxes += [_prepend(r1, b) for b in _flat_boxes(rest, 0, c1)]
    return boxes


def _prepend(row: int, box: Box) -> Box:
    return Box((row, *box.offsets), (1, *box.lengths))


def chunk_cuts(size: int, count: int) -> list[int]:
    """Return the cut positions of `size` split into `count` chunks as torch.chunk does.

    Chunks have ceil(size / count) elements, the last ones may be shorter or empty;
    the result has count + 1 positions, from 0 to size.
    """
    step = chunk_step(size, count)
    return [min(i * step, size) for i in range(count + 1)]


def chunk_step(size: int, count: int) -> int:
    """The length of all but the last chunks of `size` cut in `count` as torch.chunk does (0: no chunks)."""
    return -(-size // count) if count else 0


@dataclass(frozen=True, slots=True)
class Runs:
    """The contiguous byte runs that hold an inner box inside a row-major outer box.

    Run i starts at ``start + sum(idx_d * strides[d])`` for the multi-index ``idx`` over
    ``counts`` (row-major), and is ``run_length`` bytes long. Concatenated in order, the
    runs are the inner box in row-major order.
    """

    start: int
    run_length: int
    counts: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def n_runs(self) -> int:
        return math.prod(self.counts)

    @property
    def nbytes(self) -> int:
        return self.n_runs * self.run_length

    @property
    def end(self) -> int:
        """One past the last byte of the last run."""
        last = sum((c - 1) * s for c, s in zip(self.counts, self.strides))
        return self.start + last + self.run_length

    def offsets(self) -> Iterator[int]:
        """Yield the start of every run in order."""
        yield from _run_offsets(self.start, self.counts, self.strides)


def _run_offsets(base: int, counts: tuple[int, ...], strides: tuple[int, ...]) -> Iterator[int]:
    if not counts:
        yield base
        return
    head, rest_counts, rest_strides = strides[0], counts[1:], strides[1:]
    for i in range(counts[0]):
        yield from _run_offsets(base + i * head, rest_counts, rest_strides)


def byte_runs(outer: Box, inner: Box, itemsize: int) -> Runs:
    """Return where the bytes of `inner` lie inside the row-major payload of `outer`.

    Args:
        outer: the box a payload holds, in global coordinates.
        inner: a non-empty box inside `outer`, in global coordinates.
        itemsize: bytes per element.
    """
    shape = outer.lengths
    rel = inner.shifted(outer.offsets)
    ndim = len(shape)
    strides = [itemsize] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    # The run spans every trailing dim that inner covers fully, plus the first one it does not.
    j = ndim - 1
    while j >= 0 and rel.offsets[j] == 0 and rel.lengths[j] == shape[j]:
        j -= 1
    start = sum(o * s for o, s in zip(rel.offsets, strides))
    if j < 0:
        return Runs(start, math.prod(shape) * itemsize, (), ())
    run_length = rel.lengths[j] * strides[j]
    return Runs(start, run_length, rel.lengths[:j], tuple(strides[:j]))


def tiling_problems(shape: Sequence[int], boxes: Sequence[Box], *, limit: int = 10) -> list[str]:
    """Say how `boxes` fail to tile a tensor of `shape` exactly once; empty when they do.

    Checks bounds, overlaps (a sweep along the dim with the most distinct offsets, so
    regular splits cost about n log n) and gaps (by volume, once there is no overlap).
    At most `limit` overlap findings are listed.
    """
    shape = tuple(shape)
    problems: list[str] = []
    live: list[Box] = []
    for box in boxes:
        if not in_bounds(box, shape):
            problems.append(f"box at {list(box.offsets)} of size {list(box.lengths)} is outside shape {list(shape)}")
        elif box.volume:
            live.append(box)
    if problems:
        return problems
    overlaps = _overlaps(live, limit)
    for a, b in overlaps:
        problems.append(
            f"boxes at {list(a.offsets)} (size {list(a.lengths)}) and {list(b.offsets)} "
            f"(size {list(b.lengths)}) overlap"
        )
    if not overlaps:
        covered = sum(b.volume for b in live)
        missing = math.prod(shape) - covered
        if missing:
            problems.append(f"gap: {missing} of {math.prod(shape)} elements are in no shard")
    return problems


def _overlaps(boxes: list[Box], limit: int) -> list[tuple[Box, Box]]:
    if len(boxes) < 2 or not boxes[0].ndim:
        return [(boxes[0], boxes[1])] if len(boxes) >= 2 else []
    ndim = boxes[0].ndim
    dim = max(range(ndim), key=lambda d: len({b.offsets[d] for b in boxes}))
    order = sorted(boxes, key=lambda b: b.offsets[dim])
    active: list[tuple[int, int, Box]] = []
    found: list[tuple[Box, Box]] = []
    for i, box in enumerate(order):
        start = box.offsets[dim]
        while active and active[0][0] <= start:
            heapq.heappop(active)
        for _, _, other in active:
            if box.intersect(other) is not None:
                found.append((other, box))
                if len(found) >= limit:
                    return found
        heapq.heappush(active, (box.offsets[dim] + box.lengths[dim], i, box))
    return found
