"""Tensors on a device: which devices ckptkit reads and writes, and the moves of their bytes
through a small pool of reused pinned host buffers (`BouncePool`).

A tensor (or a load target's box) is cut into chunks that fit one buffer, along its leading dim
(`chunk_box`), and the chunks are packed in order into batches of one buffer each (`pack`).

- Load (`load_through`): read a batch's boxes into a buffer, copy them to the device on a side
  stream, and read the next batch into another buffer while that copy runs; a buffer is reused
  once its copy has finished. Every copy has finished when the call returns.
- Save (`staged_bytes`): copy batches of a file's device tensors into buffers on a side stream,
  a few batches ahead, and hand each buffer's bytes to the writer (which hashes and writes them)
  once its copy has finished.

The host memory either adds is the pool's: at most ``total_bytes``, whatever the state's size.
Side streams first wait for the caller's current stream (`BouncePool.follow`), so the copies
see every kernel the caller queued before the call.

Every CUDA copy ckptkit issues between buffers and the state, here and in the manager's
snapshots (`writer.snapshot`), goes through `side_copy`: grouped by device, each group on that
device's copy stream (`SideStreams`, one per device), marked by an event.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..boxes import Box, full_box
from ..errors import LayoutError
from ..io.read import Reader, byte_shape
from ..plan.load import ShardLookup, plan_load
from .sharded import ShardedTensor
from .torch_io import byte_view, host_contiguous

DEFAULT_PINNED_BYTES = 1 << 30  # host memory a load or save of device tensors may add
BUFFERS = 4  # buffers in a pool: one being filled (or written), the others' copies in flight
ALIGN = 64  # chunks start at multiples of this in a buffer (any dtype's view is aligned)
MIN_BUFFER = 256
DEVICES = ("cpu", "cuda")
T = TypeVar("T")


def device_problems(tensors: Iterable[tuple[str, torch.device]]) -> list[str]:
    """Return one problem per tensor (fqn, device) that ckptkit cannot read into or write from:
    a device other than cpu and cuda, or cuda where this torch has no CUDA."""
    found: dict[str, str] = {}
    for fqn, device in tensors:
        if fqn in found or device.type == "cpu":
            continue
        if device.type == "cuda" and not torch.cuda.is_available():
            found[fqn] = f"{fqn}: on device {device}, but CUDA is not available to this torch {torch.__version__}"
        elif device.type not in DEVICES:
            found[fqn] = (f"{fqn}: on device {device}; ckptkit reads and writes cpu and cuda tensors "
                          f"(allocate it on one of them, e.g. with module.to_empty(device=...))")
    return list(found.values())


def chunk_box(box: Box, itemsize: int, limit: int) -> list[Box]:
    """Cut `box` into sub-boxes of at most `limit` bytes, in row-major order: runs of whole rows
    along its leading dim; a row larger than `limit` is cut the same way along the next dim.

    Raises:
        LayoutError: `limit` is smaller than one element.
    """
    if limit < itemsize:
        raise LayoutError(f"a chunk of {limit} bytes cannot hold one element of {itemsize} bytes")
    if not box.ndim or box.volume * itemsize <= limit:
        return [box]
    first, rest = box.offsets[0], Box(box.offsets[1:], box.lengths[1:])
    row = rest.volume * itemsize
    if row <= limit:
        step = limit // row
        return [Box((first + i, *rest.offsets), (min(step, box.lengths[0] - i), *rest.lengths))
                for i in range(0, box.lengths[0], step)]
    inner = chunk_box(rest, itemsize, limit)
    return [Box((first + i, *b.offsets), (1, *b.lengths)) for i in range(box.lengths[0]) for b in inner]


@dataclass(frozen=True, slots=True)
class Chunk:
    """A sub-box of item `item` (in that item's coordinates) whose bytes lie at `offset` in a buffer."""

    item: int
    box: Box
    offset: int
    nbytes: int


def pack(items: Sequence[tuple[Box, int]], limit: int) -> list[list[Chunk]]:
    """Cut each item (box, itemsize) into chunks of at most `limit` bytes (`chunk_box`) and pack
    them, in order, into batches that each fit one buffer of `limit` bytes. Empty boxes have no
    chunk."""
    batches: list[list[Chunk]] = []
    batch: list[Chunk] = []
    used = 0
    for i, (box, size) in enumerate(items):
        if not box.volume:
            continue
        for part in chunk_box(box, size, limit):
            n = part.volume * size
            start = -(-used // ALIGN) * ALIGN
            if batch and start + n > limit:
                batches.append(batch)
                batch, start = [], 0
            batch.append(Chunk(i, part, start, n))
            used = start + n
    if batch:
        batches.append(batch)
    return batches


def batch_bytes(batch: Sequence[Chunk]) -> int:
    """The bytes of buffer a batch uses."""
    return batch[-1].offset + batch[-1].nbytes


@dataclass(eq=False)
class Buffer:
    """One host buffer of a pool, and the device copies still reading or writing it."""

    memory: torch.Tensor
    events: list[Any] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return int(self.memory.numel())

    def raw(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's bytes in the buffer (uint8, 1-D)."""
        return self.memory[chunk.offset : chunk.offset + chunk.nbytes]

    def view(self, chunk: Chunk, dtype: torch.dtype) -> torch.Tensor:
        """The chunk's bytes in the buffer, as a tensor of `dtype` and the chunk's shape."""
        return self.raw(chunk).view(dtype).view(chunk.box.lengths)

    def idle(self) -> bool:
        """Whether every device copy recorded on the buffer has finished."""
        return all(event.query() for event in self.events)

    def settle(self) -> None:
        """Wait for the device copies recorded on the buffer."""
        for event in self.events:
            event.synchronize()
        self.events = []


def cuda_device(device: torch.device) -> torch.device:
    """`device` with its index (the current device's when it has none)."""
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


class SideStreams:
    """One copy stream per CUDA device, created on first use; thread-safe. The bounce pool's
    copies and the manager's snapshots each run on a set of these."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> Any:
        key = cuda_device(device)
        with self._lock:
            if key not in self.streams:
                self.streams[key] = torch.cuda.Stream(device=key)  # type: ignore[no-untyped-call]
            return self.streams[key]

    def follow(self, devices: Iterable[torch.device]) -> None:
        """Make the side stream of each CUDA device in `devices` wait for the calling thread's
        current stream there (current streams are per thread: call it in the caller's)."""
        for device in {cuda_device(d) for d in devices if d.type == "cuda"}:
            self.get(device).wait_stream(torch.cuda.current_stream(device))


def by_device(items: Iterable[T], device_of: Callable[[T], torch.device]) -> dict[torch.device, list[T]]:
    """`items` grouped by their CUDA device (`device_of`, given its index), devices in first-seen
    order and each group in the items' order."""
    groups: dict[torch.device, list[T]] = {}
    for item in items:
        groups.setdefault(cuda_device(device_of(item)), []).append(item)
    return groups


@dataclass(frozen=True)
class SideCopy:
    """The copies `side_copy` issued for one CUDA device: its side stream, and the event recorded
    on it after them."""

    device: torch.device
    stream: Any  # torch.cuda.Stream
    done: Any  # torch.cuda.Event


def side_copy(
    streams: SideStreams, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], *, follow: bool = False, hold: bool = False,
    keep_sources: bool = False,
) -> list[SideCopy]:
    """Copy each (dest, src), outside autograd; return one `SideCopy` per CUDA device involved.

    A pair of host tensors is copied at once. The other pairs are grouped by their CUDA device
    (the dest's, else the src's; `by_device`) and each group is issued, without blocking, under
    ``torch.cuda.device(d)`` on d's side stream, then marked by an event. Per device:

    - `follow`: the side stream first waits for d's current stream (the copies see every kernel
      queued before; pass False when the caller's thread did it already, `SideStreams.follow`);
    - `keep_sources`: each CUDA source is recorded on the side stream, so that one freed after
      the call is not reused before its copy ends;
    - `hold`: d's current stream then waits for the side stream (later work there, such as an
      in-place update of a source, runs after the copies, on the device, not the host).
    """
    groups: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():  # a dest may be (a view of) a parameter
        for dest, src in pairs:
            if dest.device.type == "cuda" or src.device.type == "cuda":
                groups.append((dest, src))
            else:
                dest.copy_(src)
        issued = []
        for device, group in by_device(groups, lambda pair: pair[0].device if pair[0].device.type == "cuda" else pair[1].device).items():
            with torch.cuda.device(device):
                stream = streams.get(device)
                current = torch.cuda.current_stream(device)
                if follow:
                    stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    for dest, src in group:
                        dest.copy_(src, non_blocking=True)
                        if keep_sources and src.device.type == "cuda":
                            src.record_stream(stream)
                    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    done.record(stream)
                if hold:
                    current.wait_stream(stream)
            issued.append(SideCopy(device, stream, done))
    return issued


class BouncePool:
    """Host buffers reused across copies between host and devices: at most `buffers` of them,
    allocated when first needed (pinned, by default, when CUDA is available), each of
    `buffer_bytes`: the largest power of two within ``total_bytes // buffers`` (torch's pinned
    allocator rounds up to one), no larger than needed when `moving` (the bytes the pool will
    move) is given. The pool's accounting (`allocated_bytes`, `peak_bytes`) is all the host
    memory a load or save through it adds. Thread-safe.

    Call order: `follow` (in the caller's thread) for the devices to be copied to or from, then
    `acquire` / `release` per batch, `drain` at the end.

    Raises:
        LayoutError: `total_bytes` cannot hold `buffers` buffers of at least 256 bytes.
    """

    def __init__(
        self, total_bytes: int = DEFAULT_PINNED_BYTES, *, buffers: int = BUFFERS, pinned: bool | None = None,
        moving: int | None = None,
    ) -> None:
        if buffers < 1 or total_bytes // buffers < MIN_BUFFER:
            raise LayoutError(f"pinned_bytes={total_bytes} cannot hold {buffers} buffer(s) of at least {MIN_BUFFER} bytes")
        self.total_bytes = total_bytes
        self.buffers = buffers
        self.buffer_bytes = 1 << ((total_bytes // buffers).bit_length() - 1)
        if moving is not None:  # a small state gets small buffers, still `buffers` of them to overlap
            self.buffer_bytes = min(self.buffer_bytes, max(MIN_BUFFER, 1 << (max(1, -(-moving // buffers)) - 1).bit_length()))
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.handed_out = 0  # buffers handed out so far (batches moved)
        self._free: deque[Buffer] = deque()  # least recently released first
        self._cond = threading.Condition()
        self.streams = SideStreams()

    def acquire(self, nbytes: int, *, wait: bool = True) -> Buffer | None:
        """Return a free buffer (for `nbytes`) whose earlier copies have finished: an idle one, else
        a new one while fewer than `buffers` exist, else the one released longest ago once its
        copies end; with all in use, wait for one (or, without `wait`, return None)."""
        assert 0 < nbytes <= self.buffer_bytes, (nbytes, self.buffer_bytes)
        with self._cond:
            while (buf := self._take()) is None and wait:
                self._cond.wait()
            if buf is not None:
                self.handed_out += 1
        if buf is not None:
            buf.settle()
        return buf

    def _take(self) -> Buffer | None:
        idle = next((b for b in self._free if b.idle()), None)
        if idle is not None:
            self._free.remove(idle)
            return idle
        if self.allocated_bytes + self.buffer_bytes <= self.buffers * self.buffer_bytes:
            self.allocated_bytes += self.buffer_bytes
            self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
            return Buffer(torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=self.pinned))
        return self._free.popleft() if self._free else None

    def release(self, buf: Buffer, events: list[Any] | None = None) -> None:
        """Give `buf` back; `events` mark the device copies still using it."""
        with self._cond:
            buf.events = list(events or [])
            self._free.append(buf)
            self._cond.notify()

    def drain(self) -> None:
        """Wait for every device copy of the released buffers."""
        with self._cond:
            free = list(self._free)
        for buf in free:
            buf.settle()

    def follow(self, devices: Iterable[torch.device]) -> None:
        """Make the side stream of each CUDA device wait for the caller's current stream there."""
        self.streams.follow(devices)

    def copy(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[Any]:
        """Copy each (dest, src) between a buffer and a tensor, those on CUDA on the device's side
        stream (`side_copy`, after `follow`); return the events that mark the ends of the CUDA copies."""
        return [issued.done for issued in side_copy(self.streams, pairs)]


def load_through(
    reader: Reader, targets: Sequence[tuple[str, ShardedTensor]], pool: BouncePool, *, threads: Executor | None = None
) -> None:
    """Fill each target (fqn, ShardedTensor on any device, dtype checked by the caller) in place
    with its box of the checkpoint, batch by batch through `pool`'s buffers: a batch is read
    into a buffer (on `threads`) while the copies of the batches before it run.

    Raises:
        LayoutError: the checkpoint does not cover a target's box.
        IntegrityError: a byte read does not match the manifest.
    """
    batches = pack([(p.box, p.local.element_size()) for _, p in targets], pool.buffer_bytes)
    requests = [(targets[c.item][0], c.box) for batch in batches for c in batch]
    plans = plan_load(reader.manifest, requests, lookup=ShardLookup(reader.manifest)).targets
    pool.follow(p.local.device for _, p in targets)
    at = 0
    try:
        for batch in batches:
            buf = pool.acquire(batch_bytes(batch))
            assert buf is not None
            events: list[Any] = []
            try:
                pieces = [targets[c.item][1].local for c in batch]
                dests = [buf.raw(c).numpy().reshape(byte_shape(c.box.lengths, t.element_size())) for c, t in zip(batch, pieces)]
                reader.fill(plans[at : at + len(batch)], dests, pool=threads)
                events = pool.copy(((_region(targets[c.item][1], c.box), buf.view(c, t.dtype)) for c, t in zip(batch, pieces)))
            finally:
                pool.release(buf, events)
            at += len(batch)
    finally:
        pool.drain()


def _region(piece: ShardedTensor, box: Box) -> torch.Tensor:
    """The part of a piece's local tensor that holds `box` (global coordinates)."""
    return piece.local[box.shifted(piece.global_offsets).slices()]  # type: ignore[no-any-return]


def staged_bytes(
    tensors: Sequence[torch.Tensor], pool: BouncePool, *, staged: Callable[[torch.Tensor], bool] | None = None
) -> Iterator[memoryview]:
    """Yield the bytes of each tensor, in order: those `staged` picks (default: those not on the
    CPU) through `pool`'s buffers, copied a few batches ahead; the others as `host_contiguous`.
    The consumer is done with a chunk when it asks for the next (the `Storage.write` contract).
    Call `pool.follow` for the tensors' devices in the caller's thread first.
    """
    picked = staged or (lambda t: t.device.type != "cpu")
    moved = [i for i, t in enumerate(tensors) if picked(t)]
    batches = deque(pack([(full_box(tensors[i].shape), tensors[i].element_size()) for i in moved], pool.buffer_bytes))
    ready: deque[tuple[deque[Chunk], Buffer]] = deque()

    def stage(block: bool) -> None:
        while batches and len(ready) < pool.buffers:
            buf = pool.acquire(batch_bytes(batches[0]), wait=block and not ready)  # never wait holding one
            if buf is None:
                return
            batch = batches.popleft()
            buf.events = pool.copy(((buf.view(c, tensors[moved[c.item]].dtype),
                                       tensors[moved[c.item]].detach()[c.box.slices()]) for c in batch))
            ready.append((deque(batch), buf))

    try:
        index = {i: k for k, i in enumerate(moved)}
        for i, tensor in enumerate(tensors):
            if i not in index:
                yield byte_view(host_contiguous(tensor))
                continue
            while True:
                if not ready:
                    stage(block=True)
                if not ready or ready[0][0][0].item != index[i]:
                    break  # this tensor's chunks are all out (or it has none: it is empty)
                chunks, buf = ready[0]
                chunk = chunks.popleft()
                buf.settle()
                stage(block=False)  # the copies of the next batches run while this one is written
                yield byte_view(buf.raw(chunk))
                if not chunks:
                    ready.popleft()
                    pool.release(buf)
    finally:
        for _, buf in ready:
            buf.settle()
            pool.release(buf)
