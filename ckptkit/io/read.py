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

The bytes a call wants from a file are merged into ranges and cut into checked pieces
(``ckptkit.io.fetch``). A file with block checksums (schema 1.2; since 1.5 its digests are read
once from its sidecar and checked against the file checksum first) has every block a read touches
checked: inside a range from the destination itself, at its two ends with the bytes outside the
range read too (at most one extra block each end, fewer where a checked copy of the block is
kept); its header's blocks are checked when it is first read. A file without them (older
checkpoints) is checked against its whole-file checksum when one call reads all of its tensor
bytes, as ``load`` always did.

A tensor with patches (an incremental save's, schema 1.4) has the patches that meet a box read
with the box's own bytes, checked the same way, and applied over it in order once every read is
done: whatever reads bytes through the engine sees the patched box.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np
import xxhash
from numpy.lib.stride_tricks import as_strided

from ..boxes import Box, byte_runs
from ..manifest.dtypes import itemsize
from ..errors import IntegrityError
from ..manifest import BlockChecksums, Manifest, Patch
from .payload import Headers, block_digests, header_entry, header_problems, read_header
from ..manifest.shards import KeyIndex, patch_index_dtype, spec_files
from ..plan.load import Read, TargetPlan
from .catalog import Location
from .checksum import hasher_for
from .fetch import Piece, Range, Segment, merge, pieces

PIECE = 16 << 20
SMALL_RUN = 64 << 10
# Blocks read whole for the ends of ranges (and headers) are kept, checked, up to this many bytes:
# neighbouring ranges and the first tensor after a header then read a shared block once.
BLOCK_CACHE = 16 << 20
KEEP_SCRATCH = 4 << 20  # scratch memory a thread keeps between calls, by default
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


class _Arena:
    """Scratch memory of one thread's `fill` calls, reused from call to call (fresh buffers would
    fault every page again): slices handed out in order, all given back when the next call starts."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.memory = np.empty(0, np.uint8)
        self.used = 0
        self.wanted = 0

    def reset(self) -> None:
        if self.wanted > len(self.memory) and len(self.memory) < self.keep:  # grow, up to `keep`: larger
            self.memory = np.empty(min(self.wanted, self.keep), np.uint8)  # needs get fresh buffers, freed after
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

    def __init__(
        self, loc: Location, manifest: Manifest, *, piece: int = PIECE, small_run: int = SMALL_RUN,
        keep_scratch: int = KEEP_SCRATCH,
    ) -> None:
        self.loc = loc
        self.manifest = manifest
        self.piece = piece
        self.small_run = small_run
        self.keep_scratch = keep_scratch  # per thread, for callers making many calls of similar needs
        self.headers: Headers = {}
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._header_locks: dict[int, threading.Lock] = {}
        self._blocks: OrderedDict[tuple[int, int], bytes] = OrderedDict()  # checked blocks, least recent first
        self._cached = 0
        self._keys: KeyIndex | None = None
        self._digests: dict[int, bytes] = {}  # each file's block digests, checked (a sidecar is read once)

    def _arena(self) -> _Arena:
        arena: _Arena | None = getattr(self._local, "arena", None)
        if arena is None:
            arena = self._local.arena = _Arena(self.keep_scratch)
        return arena

    # --- headers ---------------------------------------------------------------------------------

    def header_of(self, file: int) -> tuple[Any, bytes]:
        """The checked header of payload file `file` (and its raw bytes), read once.

        Raises:
            IntegrityError: the file is missing, of another size, its header is malformed or holds
                other keys than the manifest puts in the file, or the blocks holding the header do
                not match their checksums.
        """
        found = self.headers.get(file)
        if found is not None:
            return found
        with self._lock:
            lock = self._header_locks.setdefault(file, threading.Lock())
        with lock:  # one thread reads it; the others wait for it
            found = self.headers.get(file)
            if found is None:
                found = read_header(self.loc, self.manifest, file)
                if self.manifest.files[file].encoding != "raw":  # a raw file's shard is checked by the manifest
                    problems = header_problems(found[0], file, self._key_index(), borrowed=self.manifest.files[file].base is not None)
                    if problems:
                        raise IntegrityError(f"{self._where(file)}: " + "; ".join(problems[:5]) +
                                             (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
                blocks = self.manifest.files[file].blocks
                if blocks is not None:
                    self._digests_of(file)
                    if found[1]:
                        self._check_prefix(file, blocks, found[1])
                self.headers[file] = found
        return found

    def _digests_of(self, file: int) -> bytes:
        """The checked block digests of payload file `file` (from the manifest or, read once, its sidecar)."""
        found = self._digests.get(file)
        if found is None:
            entry = self.manifest.files[file]
            found = self._digests[file] = block_digests(self.loc.storage, self.loc.file_key(entry), entry, self._where(file))
        return found

    def _key_index(self) -> KeyIndex:
        """Where the manifest puts each key (indexed once, on the first header read)."""
        with self._lock:
            if self._keys is None:
                self._keys = KeyIndex(self.manifest.tensors)
            return self._keys

    def open_files_of(self, fqns: Iterable[str]) -> None:
        """Read and check the header of every file the shard specs of `fqns` name, even a file
        holding only empty shards (which no read opens): a whole read then checks every file that
        holds a part of the tensors, whatever the manifest says of their shapes."""
        for file in sorted({f for fqn in fqns for f in spec_files(self.manifest.tensors[fqn])}):
            self.header_of(file)

    def _check_prefix(self, file: int, blocks: BlockChecksums, prefix: bytes) -> None:
        end = min(self.manifest.files[file].size, -(-len(prefix) // blocks.size) * blocks.size)
        data = memoryview(bytearray(end))
        count = -(-end // blocks.size)
        self._run(Piece(file, [(0, data)], [(i, [data[i * blocks.size : (i + 1) * blocks.size]]) for i in range(count)]))
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
        patched = [(plan, dest, patch) for plan, dest in zip(plans, dests) for patch in self.manifest.tensors[plan.fqn].patches
                   if not plan.box.ndim or plan.box.intersect(Box(patch.offsets, patch.lengths)) is not None]
        for file in sorted({r.file for p in plans for r in p.reads} | {patch.file for _, _, patch in patched}):
            self.header_of(file)
        arena = self._arena()
        arena.reset()
        segments: dict[int, list[Segment]] = {}
        finish: list[Callable[[], None]] = []  # copies out of buffers, once every read is done
        for plan, dest in zip(plans, dests):
            dtype = self.manifest.tensors[plan.fqn].dtype
            size = itemsize(dtype)
            for read in plan.reads:
                region = dest[byte_slices(read.overlap.shifted(plan.box.offsets), size)] if read.overlap.ndim else dest
                self._plan_read(read, self.begin(read, dtype), region, size, segments, finish)
        # (plan, dest, patch, its indices, its values as bytes): read with the rest, applied after it
        patches: list[tuple[TargetPlan, np.ndarray[Any, Any], Patch, np.ndarray[Any, Any], np.ndarray[Any, Any]]] = []
        for plan, dest, patch in patched:
            arrays = []
            for key, dtype in ((patch.indices, patch_index_dtype(patch)), (patch.values, self.manifest.tensors[plan.fqn].dtype)):
                array = np.empty(patch.count * itemsize(dtype), np.uint8)
                whole = Read(patch.file, key, Box((0,), (patch.count,)), Box((0,), (patch.count,)))
                self._plan_read(whole, self.begin(whole, dtype), array, itemsize(dtype), segments, finish)
                arrays.append(array)
            patches.append((plan, dest, patch, arrays[0], arrays[1]))
        work: list[Piece] = []
        checks: list[Callable[[], None]] = []
        for file, segs in sorted(segments.items()):
            entry = self.manifest.files[file]
            for span in merge(segs, entry.blocks.size if entry.blocks is not None else 0, lambda n: arena.take(n).data):
                work += pieces(file, span, entry.size, entry.blocks, self.piece, functools.partial(self._kept, file),
                               lambda n: arena.take(n).data)
                if entry.blocks is None:
                    if span.start == self.headers[file][0].data_start and span.end == entry.size:
                        checks.append(_whole_check(self, file, span))
                    else:
                        _unchecked_once(self.loc, self.manifest)
        if pool is None:
            for p in work:
                self._run(p)
        else:
            for _ in pool.map(self._run, work):
                pass
        for copy in finish:
            copy()
        for check in checks:
            check()
        self._apply_patches(patches, pool)
        total = sum(p.nbytes for p in work)
        with self._lock:
            self.bytes_read += total
        return total

    def _apply_patches(self, patches: Sequence[tuple[TargetPlan, np.ndarray[Any, Any], Patch, np.ndarray[Any, Any],
                                                     np.ndarray[Any, Any]]], pool: Executor | None) -> None:
        """Apply each destination's patches in the manifest's order (a later one wins), the
        destinations side by side on `pool`."""
        by_dest: dict[int, list[Callable[[], None]]] = {}
        for plan, dest, patch, indices, values in patches:
            by_dest.setdefault(id(dest), []).append(functools.partial(
                apply_patch, dest, plan.box, patch, indices, values, itemsize(self.manifest.tensors[plan.fqn].dtype)))
        if pool is None or len(by_dest) < 2:
            for group in by_dest.values():
                _run_all(group)
        else:
            for _ in pool.map(_run_all, by_dest.values()):
                pass

    def _run(self, piece: Piece) -> None:
        """Do a piece's reads, check its blocks, keep the checked end blocks."""
        for dest, kept in piece.copies:
            dest[:] = kept
        key = self.loc.file_key(self.manifest.files[piece.file])
        for offset, views in _consecutive(piece.reads):  # a range and the end-block bytes around it: one request
            self.loc.storage.readv(key, offset, views)
        for index, parts in piece.blocks:
            self._check_block(piece.file, index, parts)
            if index in piece.keep:
                self._keep(piece.file, index, b"".join(parts))

    def check_blocks(self, file: int, data: memoryview, offset: int) -> None:
        """Check the blocks of payload file `file` that `data`, its bytes from `offset` on, holds
        (whole blocks: `offset` a block boundary, the end one or the file's end; a mapped load's
        check, ``ckptkit.state.mapped``).

        Raises:
            IntegrityError: a block does not match its checksum.
        """
        blocks = self.manifest.files[file].blocks
        end = offset + len(data)
        assert blocks is not None and offset % blocks.size == 0
        assert end % blocks.size == 0 or end == self.manifest.files[file].size
        for start in range(0, len(data), blocks.size):
            self._check_block(file, (offset + start) // blocks.size, [data[start : start + blocks.size]])
        with self._lock:
            self.bytes_read += len(data)

    def _check_block(self, file: int, index: int, parts: Sequence[memoryview]) -> None:
        """Check block `index` of payload file `file`, its bytes the concatenation of `parts`.

        Raises:
            IntegrityError: the block does not match its checksum.
        """
        hasher = xxhash.xxh3_64()
        for part in parts:
            hasher.update(part)
        if hasher.digest() != self._digests_of(file)[8 * index : 8 * index + 8]:
            blocks = self.manifest.files[file].blocks
            assert blocks is not None
            begin = index * blocks.size
            raise IntegrityError(f"{self._where(file)}: block {index} (bytes {begin} to "
                                 f"{begin + sum(len(p) for p in parts)}) does not match its checksum")

    def _where(self, file: int) -> str:
        return self.loc.file_str(self.manifest.files[file])

    def _plan_read(self, read: Read, begin: int, region: np.ndarray[Any, Any], size: int,
                   segments: dict[int, list[Segment]], finish: list[Callable[[], None]]) -> None:
        """Add the segments (and the copies after them) that fill `region` (the read's bytes
        inside the destination) with `read`."""
        runs = byte_runs(read.src_box, read.overlap, size)
        if not runs.nbytes:
            return
        blocks = self.manifest.files[read.file].blocks
        short = max(self.small_run, blocks.size if blocks is not None else 0)
        if runs.n_runs > 1 and runs.run_length < short:
            self._gather(read, begin, read.overlap, region, size, segments, finish)
            return
        contiguous = region.flags.c_contiguous
        buffer = region.reshape(-1) if contiguous else self._arena().take(runs.nbytes)
        pos = 0
        mine = segments.setdefault(read.file, [])
        for offset in runs.offsets():
            mine.append((begin + offset, buffer[pos : pos + runs.run_length].data))
            pos += runs.run_length
        if not contiguous:
            finish.append(lambda: np.copyto(region, buffer.reshape(region.shape)))

    def _gather(self, read: Read, begin: int, overlap: Box, region: np.ndarray[Any, Any], size: int,
                segments: dict[int, list[Segment]], finish: list[Callable[[], None]]) -> None:
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
                self._gather(read, begin, part, region[index], size, segments, finish)
            return
        scratch = self._arena().take(span)
        segments.setdefault(read.file, []).append((begin + runs.start, scratch.data))
        strides = [size] * len(read.src_box.lengths)
        for d in range(len(strides) - 2, -1, -1):
            strides[d] = strides[d + 1] * read.src_box.lengths[d + 1]

        def scatter() -> None:
            typed = as_strided(scratch.view(_UINT[size]), shape=overlap.lengths, strides=tuple(strides))
            region.view(_UINT[size]).reshape(overlap.lengths)[...] = typed

        finish.append(scatter)

    def read_whole(self, fqn: str, *, pool: Executor | None = None, into: np.ndarray[Any, Any] | None = None) -> np.ndarray[Any, Any]:
        """Return tensor `fqn` whole as bytes (see `byte_shape`), from whatever shards hold it:
        in the front of `into` (a flat uint8 array at least that long), or in new memory."""
        from ..plan.load import plan_load

        entry = self.manifest.tensors[fqn]
        self.open_files_of([fqn])
        shape = byte_shape(entry.shape, itemsize(entry.dtype))
        out = np.empty(shape, np.uint8) if into is None else into[: math.prod(shape)].reshape(shape)
        self.fill(plan_load(self.manifest, [(fqn, Box((0,) * len(entry.shape), entry.shape))]).targets, [out], pool=pool)
        return out


def apply_patch(dest: np.ndarray[Any, Any], box: Box, patch: Patch, indices: np.ndarray[Any, Any],
                values: np.ndarray[Any, Any], size: int) -> None:
    """Write the elements of `patch` that fall inside `box` into `dest` (the bytes of `box`, see
    `byte_shape`); `indices` and `values` are the patch's arrays as bytes."""
    if not patch.count:
        return
    flat = indices.view(np.dtype(patch_index_dtype(patch)).newbyteorder("<"))
    if len(flat) > 1 and not bool((flat[1:] > flat[:-1]).all()) or int(flat[-1]) >= math.prod(patch.lengths):
        raise IntegrityError(f"a patch of {len(flat)} elements at {list(patch.offsets)} holds indices that are not rising "
                             f"positions inside its box")
    typed = dest.view(_UINT[size])
    new = values.view(_UINT[size])
    if not box.ndim:
        typed[0] = new[-1]
        return
    if tuple(patch.offsets) == box.offsets and tuple(patch.lengths) == box.lengths and typed.flags.c_contiguous:
        # the whole box: positions are the destination's own (widened to intp: 3x faster than uint32)
        typed.reshape(-1)[flat.astype(np.intp)] = new
        return
    coords = np.unravel_index(flat, patch.lengths)
    inside = np.ones(len(flat), dtype=bool)
    at = []
    for c, po, bo, n in zip(coords, patch.offsets, box.offsets, box.lengths):
        g = c.astype(np.int64) + (po - bo)
        inside &= (g >= 0) & (g < n)
        at.append(g)
    typed[tuple(g[inside] for g in at)] = new[inside]


def _run_all(calls: list[Callable[[], None]]) -> None:
    """Call each of `calls`, in order."""
    for call in calls:
        call()


def _consecutive(reads: list[Segment]) -> list[tuple[int, list[memoryview]]]:
    """Group reads whose bytes follow one another in the file: (offset, their views in order)."""
    out: list[tuple[int, list[memoryview]]] = []
    end = -1
    for offset, view in sorted(reads, key=lambda r: r[0]):
        if out and offset == end:
            out[-1][1].append(view)
        else:
            out.append((offset, [view]))
        end = offset + len(view)
    return out


_WARNED: set[str] = set()


def _unchecked_once(loc: Location, manifest: Manifest) -> None:
    """Say once per checkpoint and process that a partial read of it cannot be checked."""
    if manifest.checkpoint_id in _WARNED:
        return
    _WARNED.add(manifest.checkpoint_id)
    warnings.warn(f"ckptkit: {loc} was written before block checksums (schema {manifest.schema_version}); partial reads "
                  f"of its files are not checked (whole-file reads and `ckptkit verify` are)", stacklevel=4)


def _whole_check(reader: Reader, file: int, span: Range) -> Callable[[], None]:
    """The check of a file without block checksums whose tensor bytes `span` holds, all of them."""
    entry = reader.manifest.files[file]
    prefix = reader.headers[file][1]

    def check() -> None:
        hasher = hasher_for(entry.checksum)
        hasher.update(prefix)
        for _, view in span.segments:
            hasher.update(view)
        if hasher.digest() != entry.checksum:
            raise IntegrityError(f"{reader._where(file)}: checksum mismatch: content hashes to {hasher.digest()}, "
                                 f"manifest says {entry.checksum}")

    return check
