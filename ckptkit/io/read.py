"""The one byte engine: fill byte buffers with planned boxes of a checkpoint's tensors, checking
every byte it returns (no torch).

A destination is the bytes of one box of a tensor, as a uint8 array of the box's shape with the
last dim counted in bytes (``byte_shape``), so every dtype is sliced and copied the same way. For
each planned read the engine picks how to fetch the source bytes:

- runs of at least ``small_run`` bytes (and of a block, when the file has block checksums) are
  read straight into the destination where it is contiguous, else into a buffer then copied;
  long ranges are cut into pieces of ``piece`` bytes that threads read in parallel;
- many short runs are read as their whole span (one large read beats many small ones) and
  gathered in memory; a span longer than ``piece`` is split along a dim first.

Checks: a file with block checksums (schema 1.2) has every block a read touches checked, the
blocks at the ends of a range read whole (at most one extra block each end), and its header's
blocks checked when it is first read. A file without them (older checkpoints) is checked against
its whole-file checksum when one call reads all of its tensor bytes, as ``load`` always did.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..boxes import Box, byte_runs
from ..manifest.dtypes import itemsize
from ..errors import IntegrityError
from ..manifest import BlockChecksums, Manifest
from .payload import Headers, header_entry, read_header
from ..plan.load import Read, TargetPlan
from .catalog import Location
from .checksum import block_digest, hasher_for

PIECE = 16 << 20
SMALL_RUN = 64 << 10
# Blocks read whole for the ends of ranges (and headers) are kept, checked, up to this many bytes:
# neighbouring ranges and the first tensor after a header then read a shared block once.
BLOCK_CACHE = 64 << 20
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def byte_shape(shape: tuple[int, ...], size: int) -> tuple[int, ...]:
    """The shape of a tensor's bytes: its own, the last dim times the item size (0-d: one row)."""
    return (*shape[:-1], shape[-1] * size) if shape else (size,)


def byte_slices(box: Box, size: int) -> tuple[slice, ...]:
    """The slices of a box of a tensor inside the tensor's bytes (see `byte_shape`)."""
    if not box.ndim:
        return (slice(0, size),)
    *lead, last = [slice(o, o + n) for o, n in zip(box.offsets, box.lengths)]
    return (*lead, slice(last.start * size, last.stop * size))


@dataclass
class _Fetch:
    """One storage read of [offset, offset + len(view)) of a file into `view`, and the blocks of it to check."""

    file: int
    offset: int
    view: memoryview
    check: list[tuple[int, memoryview]] = field(default_factory=list)  # (block index, its bytes in view)
    then: Callable[[], None] | None = None  # copy the needed part out of a whole block, once read and checked


class _Arena:
    """Scratch memory of one thread's `fill` calls, reused from call to call (fresh buffers would
    fault every page again): slices handed out in order, all given back when the next call starts."""

    def __init__(self) -> None:
        self.memory = np.empty(0, np.uint8)
        self.used = 0
        self.wanted = 0

    def reset(self) -> None:
        if self.wanted > len(self.memory):
            self.memory = np.empty(self.wanted, np.uint8)
        self.used = self.wanted = 0

    def take(self, n: int) -> np.ndarray[Any, Any]:
        self.wanted += n
        if self.used + n > len(self.memory):
            return np.empty(n, np.uint8)  # this call needs more: next time the arena is large enough
        out = self.memory[self.used : self.used + n]
        self.used += n
        return out


class Reader:
    """Reads boxes of one committed checkpoint into byte buffers, checking what it returns.

    Holds the checked headers of the payload files (read once) and the count of bytes read.
    Thread-safe: several threads may call `fill` at once.
    """

    def __init__(self, loc: Location, manifest: Manifest, *, piece: int = PIECE, small_run: int = SMALL_RUN) -> None:
        self.loc = loc
        self.manifest = manifest
        self.piece = piece
        self.small_run = small_run
        self.headers: Headers = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()  # checked blocks, least recent first
        self._cached = 0

    def _arena(self) -> _Arena:
        arena: _Arena | None = getattr(self._local, "arena", None)
        if arena is None:
            arena = self._local.arena = _Arena()
        return arena

    # --- headers ---------------------------------------------------------------------------------

    def header_of(self, file: int) -> tuple[Any, bytes]:
        """The checked header of payload file `file` (and its raw bytes), read once.

        Raises:
            IntegrityError: the file is missing, of another size, its header is malformed, or the
                blocks holding the header do not match their checksums.
        """
        found = self.headers.get(file)
        if found is None:
            found = read_header(self.loc, self.manifest, file)
            blocks = self.manifest.files[file].blocks
            if blocks is not None and found[1]:
                self._check_prefix(file, blocks, found[1])
            with self._lock:
                self.headers[file] = found
        return found

    def _check_prefix(self, file: int, blocks: BlockChecksums, prefix: bytes) -> None:
        end = min(self.manifest.files[file].size, -(-len(prefix) // blocks.size) * blocks.size)
        data = bytearray(end)
        count = -(-end // blocks.size)
        self._read(_Fetch(file, 0, memoryview(data), [(i, memoryview(data)[i * blocks.size : (i + 1) * blocks.size])
                                                       for i in range(count)]))
        with self._lock:
            self.bytes_read += end
        if bytes(data[: len(prefix)]) != prefix:
            raise IntegrityError(f"{self._where(file)}: the header changed while being read")
        self._keep(file, count - 1, bytes(data[(count - 1) * blocks.size :]))

    def _keep(self, file: int, index: int, data: bytes) -> None:
        """Keep a checked block for later partial reads (least recently used ones go first)."""
        with self._lock:
            if (file, index) in self._blocks:
                return
            self._blocks[(file, index)] = data
            self._cached += len(data)
            while self._cached > BLOCK_CACHE and self._blocks:
                _, dropped = self._blocks.popitem(last=False)
                self._cached -= len(dropped)

    def _kept(self, file: int, index: int) -> bytes | None:
        with self._lock:
            data = self._blocks.get((file, index))
            if data is not None:
                self._blocks.move_to_end((file, index))
            return data

    def begin(self, read: Read, dtype: str) -> int:
        """The file offset where the shard `read` reads begins (its header entry checked)."""
        return header_entry(self.loc, self.manifest, self.header_of(read.file)[0], read, dtype).begin

    # --- filling ---------------------------------------------------------------------------------

    def fill(self, plans: Sequence[TargetPlan], dests: Sequence[np.ndarray[Any, Any]], *, pool: Executor | None = None) -> int:
        """Fill ``dests[i]`` (the bytes of ``plans[i].box``, see `byte_shape`) from the plan's reads;
        return the bytes read from storage. With `pool`, reads run on its threads.

        Raises:
            IntegrityError: a payload file is missing or malformed, or a byte read does not match
                its checksum.
            StorageError: a read failed.
        """
        for file in sorted({r.file for p in plans for r in p.reads}):
            self.header_of(file)
        self._arena().reset()
        self._local.partial = {}
        fetches: list[_Fetch] = []
        finish: list[Callable[[], None]] = []  # copies out of buffers, once every fetch is done
        for plan, dest in zip(plans, dests):
            dtype = self.manifest.tensors[plan.fqn].dtype
            size = itemsize(dtype)
            for read in plan.reads:
                region = dest[byte_slices(read.overlap.shifted(plan.box.offsets), size)] if read.overlap.ndim else dest
                self._plan_read(read, self.begin(read, dtype), region, size, fetches, finish)
        fetches += self._partial_fetches()
        fetches.sort(key=lambda f: (f.file, f.offset))
        whole = self._whole_file_checks(fetches)
        if pool is None:
            for f in fetches:
                self._read(f)
        else:
            for _ in pool.map(self._read, fetches):
                pass
        for f in fetches:
            if f.then is not None:
                f.then()
        for copy in finish:
            copy()
        for check in whole.values():
            check()
        total = sum(len(f.view) for f in fetches)
        with self._lock:
            self.bytes_read += total
        return total

    def _read(self, fetch: _Fetch) -> None:
        self.loc.storage.readinto(self.loc.key(self.manifest.files[fetch.file].path), fetch.offset, fetch.view)
        blocks = self.manifest.files[fetch.file].blocks
        for index, data in fetch.check:
            assert blocks is not None
            if block_digest(data) != blocks.digest(index):
                raise IntegrityError(
                    f"{self._where(fetch.file)}: block {index} (bytes {index * blocks.size} to "
                    f"{index * blocks.size + len(data)}) does not match its checksum"
                )

    def _where(self, file: int) -> str:
        return f"{self.loc}/{self.manifest.files[file].path}"

    def _plan_read(self, read: Read, begin: int, region: np.ndarray[Any, Any], size: int, fetches: list[_Fetch],
                   finish: list[Callable[[], None]]) -> None:
        """Add the fetches (and the copies after them) that fill `region` (the read's bytes inside
        the destination) with `read`."""
        runs = byte_runs(read.src_box, read.overlap, size)
        if not runs.nbytes:
            return
        blocks = self.manifest.files[read.file].blocks
        short = max(self.small_run, blocks.size if blocks is not None else 0)
        if runs.n_runs > 1 and runs.run_length < short:
            self._gather(read, begin, read.overlap, region, size, fetches, finish)
            return
        contiguous = region.flags.c_contiguous
        buffer = region.reshape(-1) if contiguous else self._arena().take(runs.nbytes)
        pos = 0
        for offset in runs.offsets():
            fetches += self._ranges(read.file, begin + offset, buffer[pos : pos + runs.run_length].data)
            pos += runs.run_length
        if not contiguous:
            finish.append(lambda: np.copyto(region, buffer.reshape(region.shape)))

    def _gather(self, read: Read, begin: int, overlap: Box, region: np.ndarray[Any, Any], size: int,
                fetches: list[_Fetch], finish: list[Callable[[], None]]) -> None:
        """Read the whole span of many short runs once, then copy the runs out of it; a span
        longer than a piece is split in two along its first dim of more than one element."""
        runs = byte_runs(read.src_box, overlap, size)
        span = runs.end - runs.start
        ndim = len(overlap.lengths)
        if span > self.piece and any(n > 1 for n in overlap.lengths):
            dim = next(d for d, n in enumerate(overlap.lengths) if n > 1)
            half = overlap.lengths[dim] // 2
            scale = size if dim == ndim - 1 else 1  # the destination's last dim counts bytes
            for lo, n in ((0, half), (half, overlap.lengths[dim] - half)):
                part = Box(tuple(o + lo if d == dim else o for d, o in enumerate(overlap.offsets)),
                           tuple(n if d == dim else m for d, m in enumerate(overlap.lengths)))
                index = tuple(slice(lo * scale, (lo + n) * scale) if d == dim else slice(None) for d in range(ndim))
                self._gather(read, begin, part, region[index], size, fetches, finish)
            return
        scratch = self._arena().take(span)
        fetches += self._ranges(read.file, begin + runs.start, scratch.data)
        strides = [size] * len(read.src_box.lengths)
        for d in range(len(strides) - 2, -1, -1):
            strides[d] = strides[d + 1] * read.src_box.lengths[d + 1]

        def scatter() -> None:
            typed = as_strided(scratch.view(_UINT[size]), shape=overlap.lengths, strides=tuple(strides))
            region.view(_UINT[size]).reshape(overlap.lengths)[...] = typed

        finish.append(scatter)

    def _ranges(self, file: int, offset: int, view: memoryview) -> list[_Fetch]:
        """Fetches of the byte range [offset, offset + len(view)) of `file` into `view`, in pieces;
        with block checksums, every block the range touches is read whole and checked."""
        blocks = self.manifest.files[file].blocks
        n = len(view)
        if blocks is None:
            return [_Fetch(file, offset + o, view[o : o + self.piece]) for o in range(0, n, self.piece)]
        b = blocks.size
        file_size = self.manifest.files[file].size
        out: list[_Fetch] = []
        first, last = offset // b, (offset + n - 1) // b
        inner: list[int] = []
        for k in range(first, last + 1):
            lo, hi = k * b, min((k + 1) * b, file_size)
            if lo >= offset and hi <= offset + n:
                inner.append(k)
                continue
            self._partial_block(file, k, lo, hi, offset, view)
        per_piece = max(1, self.piece // b)
        for i in range(0, len(inner), per_piece):
            ks = inner[i : i + per_piece]
            lo, hi = ks[0] * b, min((ks[-1] + 1) * b, file_size)
            part = view[lo - offset : hi - offset]
            out.append(_Fetch(file, lo, part, [(k, part[(k - ks[0]) * b : (k - ks[0] + 1) * b]) for k in ks]))
        return out

    def _partial_block(self, file: int, k: int, lo: int, hi: int, offset: int, view: memoryview) -> None:
        """Want the part of block k (file bytes [lo, hi)) that the range at `offset` (into `view`)
        needs: the block is read whole once per call (or taken from the kept blocks) and checked."""
        a, z = max(lo, offset), min(hi, offset + len(view))
        wanted: dict[tuple[int, int], tuple[int, int, list[Any]]] = self._local.partial
        wanted.setdefault((file, k), (lo, hi, []))[2].append((view[a - offset : z - offset], a - lo))

    def _partial_fetches(self) -> list[_Fetch]:
        """The fetches of this call's wanted blocks that are not kept already (those are copied now)."""
        out = []
        wanted: dict[tuple[int, int], tuple[int, int, list[Any]]] = self._local.partial
        for (file, k), (lo, hi, targets) in wanted.items():
            kept = self._kept(file, k)
            if kept is not None:
                for dest, start in targets:
                    dest[:] = kept[start : start + len(dest)]
                continue
            buffer = self._arena().take(hi - lo).data

            def copy(file: int = file, k: int = k, buffer: memoryview = buffer, targets: list[Any] = targets) -> None:
                for dest, start in targets:
                    dest[:] = buffer[start : start + len(dest)]
                self._keep(file, k, bytes(buffer))

            out.append(_Fetch(file, lo, buffer, [(k, buffer)], copy))
        return out

    def _whole_file_checks(self, fetches: list[_Fetch]) -> dict[int, Callable[[], None]]:
        """For files without block checksums: a check of the whole-file checksum for every file
        whose tensor bytes the fetches read exactly once, all of them (fetches sorted by offset)."""
        spans: dict[int, list[_Fetch]] = {}
        for f in fetches:
            if self.manifest.files[f.file].blocks is None:
                spans.setdefault(f.file, []).append(f)
        checks: dict[int, Callable[[], None]] = {}
        for file, mine in spans.items():
            header, prefix = self.headers[file]
            position = header.data_start
            for f in mine:
                if f.offset != position:
                    break
                position += len(f.view)
            else:
                if position == self.manifest.files[file].size:
                    checks[file] = _whole_check(self, file, prefix, mine)
        return checks

    def read_whole(self, fqn: str, *, pool: Executor | None = None) -> np.ndarray[Any, Any]:
        """Return tensor `fqn` whole as bytes (see `byte_shape`), from whatever shards hold it."""
        from ..plan.load import plan_load

        entry = self.manifest.tensors[fqn]
        out = np.empty(byte_shape(entry.shape, itemsize(entry.dtype)), np.uint8)
        box = Box((0,) * len(entry.shape), entry.shape)
        self.fill(plan_load(self.manifest, [(fqn, box)]).targets, [out], pool=pool)
        return out


def _whole_check(reader: Reader, file: int, prefix: bytes, mine: list[_Fetch]) -> Callable[[], None]:
    entry = reader.manifest.files[file]

    def check() -> None:
        hasher = hasher_for(entry.checksum)
        hasher.update(prefix)
        for f in mine:
            hasher.update(f.view)
        if hasher.digest() != entry.checksum:
            raise IntegrityError(f"{reader._where(file)}: checksum mismatch: content hashes to {hasher.digest()}, "
                                 f"manifest says {entry.checksum}")

    return check
