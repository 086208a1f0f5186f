"""From the byte segments a read wants to the storage reads that fill them, with the blocks each
read checks (pure: no I/O).

A segment is (file offset, destination bytes). Segments of one file that touch, or whose end
blocks are the same or neighbours, are merged into a range, so that the reads of one call share
their boundary blocks. A range is cut
into pieces of about `piece` bytes at block boundaries; each piece lists its storage reads and
the blocks it checks, each block as the views holding its bytes in order (the destination, and
at the two ends of a range the bytes outside it: from a kept block, or read into scratch).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from ..manifest import BlockChecksums

Segment = tuple[int, memoryview]  # (file offset, destination bytes)


@dataclass
class Piece:
    """Storage reads of one file, and the blocks to check once they are done."""

    file: int
    reads: list[Segment] = field(default_factory=list)
    blocks: list[tuple[int, list[memoryview]]] = field(default_factory=list)  # (index, its bytes in order)
    keep: list[int] = field(default_factory=list)  # indices of checked blocks worth keeping (range ends)
    copies: list[tuple[memoryview, memoryview]] = field(default_factory=list)  # (destination, checked bytes kept)

    @property
    def nbytes(self) -> int:
        return sum(len(view) for _, view in self.reads)


@dataclass(frozen=True)
class Range:
    """Touching segments of one file: the bytes [start, end), in order."""

    start: int
    end: int
    segments: tuple[Segment, ...]

    @functools.cached_property
    def starts(self) -> list[int]:
        """The file offsets of the segments, in order (for bisection)."""
        return [offset for offset, _ in self.segments]

    def slices(self, lo: int, hi: int) -> list[Segment]:
        """The parts of the segments that hold the bytes [lo, hi) of the file."""
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        out = []
        while i < len(self.segments) and lo < hi:
            offset, view = self.segments[i]
            if offset >= hi:  # segments are in order: none further holds a byte of [lo, hi)
                break
            a, z = max(lo, offset), min(hi, offset + len(view))
            if a < z:
                out.append((a, view[a - offset : z - offset]))
            i += 1
        return out


def merge(segments: list[Segment], block: int = 0, scratch: Callable[[int], memoryview] | None = None) -> list[Range]:
    """Sort a file's segments by offset and merge those that touch (overlapping ones stay apart).

    With `block` (the file's block size) and `scratch`, segments whose end blocks are the same
    or neighbours are merged too, the bytes between them read into scratch: exactly the bytes
    their end blocks would read outside them anyway, but read and checked once.
    """
    out: list[Range] = []
    current: list[Segment] = []
    end = -1
    for offset, view in sorted(segments, key=lambda s: s[0]):
        if current and offset > end and block and scratch is not None and offset // block <= (end - 1) // block + 1:
            current.append((end, scratch(offset - end)))
            end = offset
        if current and offset != end:
            out.append(Range(current[0][0], end, tuple(current)))
            current = []
        current.append((offset, view))
        end = offset + len(view)
    if current:
        out.append(Range(current[0][0], end, tuple(current)))
    return out


def pieces(
    file: int,
    span: Range,
    file_size: int,
    blocks: BlockChecksums | None,
    piece: int,
    kept: Callable[[int], bytes | None],
    scratch: Callable[[int], memoryview],
) -> list[Piece]:
    """Cut a range into pieces of about `piece` bytes, each with the blocks it checks.

    Args:
        kept: a checked copy of block k, if one is kept.
        scratch: a buffer of n bytes for the part of an end block outside the range.
    """
    if blocks is None:
        return [Piece(file, span.slices(lo, min(lo + piece, span.end))) for lo in range(span.start, span.end, piece)]
    b = blocks.size
    # An end block kept already (checked) gives its bytes inside the range too: nothing of it is read again.
    copies: list[tuple[memoryview, memoryview]] = []
    start, end = span.start, span.end
    for k, lo, hi in ((start // b, start, min((start // b + 1) * b, end)), ((end - 1) // b, None, end)):
        lo = max(k * b, start) if lo is None else lo
        kept_copy = kept(k) if (lo % b or hi % b and hi != file_size) and lo < hi else None
        if kept_copy is not None:
            copies += [(view, memoryview(kept_copy)[a - k * b : a - k * b + len(view)]) for a, view in span.slices(lo, hi)]
            start, end = (hi, end) if lo == start else (start, lo)
    if start >= end:
        return [Piece(file, copies=copies)]
    span = Range(start, end, tuple(span.slices(start, end)))
    k0, k1 = span.start // b, (span.end - 1) // b
    outside: dict[int, tuple[memoryview, memoryview]] = {}  # block -> (bytes before, bytes after) the range
    extra: dict[int, list[Segment]] = {}  # reads of those outside bytes, by block
    for k, lo, hi in ((k0, k0 * b, span.start), (k1, span.end, min((k1 + 1) * b, file_size))):
        if hi <= lo:
            continue
        part = scratch(hi - lo)  # not kept (a kept end block was taken whole above): read it
        extra.setdefault(k, []).append((lo, part))
        before, after = outside.get(k, (memoryview(b""), memoryview(b"")))
        outside[k] = (part, after) if lo < span.start else (before, part)
    per = max(1, piece // b)
    out = []
    for g0 in range(k0, k1 + 1, per):
        g1 = min(g0 + per, k1 + 1)
        p = Piece(file, span.slices(max(g0 * b, span.start), min(g1 * b, span.end)))
        for k in range(g0, g1):
            p.reads += extra.get(k, [])
            before, after = outside.get(k, (memoryview(b""), memoryview(b"")))
            inside = [view for _, view in span.slices(max(k * b, span.start), min((k + 1) * b, span.end))]
            p.blocks.append((k, [v for v in (before, *inside, after) if len(v)]))
            if k in extra:
                p.keep.append(k)
        out.append(p)
    out[0].copies = copies
    return out
