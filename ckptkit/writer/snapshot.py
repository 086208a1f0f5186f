"""Snapshots of the manager's saves: which kind, the buffer pools, and the copies into them.

A save copies its state out of the training's way before returning. CPU tensors are always
copied into host buffers. CUDA tensors are copied one of two ways:

- a *host* snapshot copies them into pinned host buffers on a side stream; the current stream
  waits for those device-to-host copies (on the device, not the host);
- a *device* snapshot copies them into GPU buffers (device to device, on the side stream: the
  current stream waits only for that); the background thread then drains the GPU buffers into
  the pinned host buffers before writing. It costs GPU memory, the size of the state's CUDA
  tensors, held from save to save.

`choose_snapshot` decides between them from byte counts alone (pure, so it is tested without a
GPU); `BufferPool` holds the buffers, reused while the state keeps its shapes and dtypes (the
pinned ones packed into a few power-of-two arenas, `plan_arenas`); `copy_to_host` and
`copy_to_device` enqueue the copies and return what the background thread waits on
(`HostCopy`, `DeviceCopy`): call `wait_staged` (the state may change), then `wait_on_host` (the
host buffers hold the snapshot).

CUDA tensors need not be on the current device, nor all on one: the copies are issued by
`state.device.side_copy`, per source device on that device's side stream, after its current
stream, which then waits for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..errors import CkptkitError
from ..state.device import SideCopy, SideStreams, by_device, side_copy

SNAPSHOT_KINDS = ("auto", "device", "host")
# A device snapshot leaves this share of the GPU's memory free (for fragmentation and the
# training's own growth), on top of what the driver reports free.
DEVICE_MARGIN = 0.05

# Pinned buffers are packed into arenas of at least this size (or the power of two above the
# largest piece), 64-byte aligned: torch's pinned allocator rounds every allocation up to a power
# of two, so one buffer per piece would pin up to twice the state's bytes.
MIN_ARENA_BYTES = 64 << 20
ALIGN = 64

Key = tuple[str, int]  # (fqn, piece index)


@dataclass(frozen=True)
class DeviceMemory:
    """The GPU's memory at the time of a save, as ``torch.cuda.mem_get_info`` reports it."""

    free: int
    total: int


@dataclass(frozen=True)
class SnapshotChoice:
    """The kind a save's CUDA tensors are snapshotted with, and why.

    `cuda_bytes` is the bytes of the state's CUDA tensors; `device_bytes` the GPU memory the
    device pool holds for this save (0 for a host snapshot)."""

    kind: Literal["device", "host"]
    reason: str
    cuda_bytes: int = 0
    device_bytes: int = 0


def check_snapshot_options(snapshot: str, max_device_bytes: int | None) -> None:
    """Refuse a snapshot kind or memory limit the manager does not know.

    Raises:
        CkptkitError: `snapshot` is not one of SNAPSHOT_KINDS, or `max_device_bytes` is negative.
    """
    if snapshot not in SNAPSHOT_KINDS:
        raise CkptkitError(f"snapshot must be one of {', '.join(SNAPSHOT_KINDS)}, got {snapshot!r}")
    if max_device_bytes is not None and max_device_bytes < 0:
        raise CkptkitError(f"max_device_bytes must be at least 0, got {max_device_bytes}")


def choose_snapshot(
    requested: str,
    *,
    cuda_bytes: int,
    reusable_bytes: int = 0,
    memory: DeviceMemory | None = None,
    max_device_bytes: int | None = None,
    devices: int = 1,
) -> SnapshotChoice:
    """Choose how a save snapshots its CUDA tensors.

    A device snapshot fits when the state's CUDA tensors are on one device, their bytes are at
    most `max_device_bytes` (when given), and the GPU buffers still to allocate (`cuda_bytes`
    less the `reusable_bytes` the pool already holds in the right shapes) fit in the free
    memory less DEVICE_MARGIN of the total.

    Args:
        requested: "auto" (device if it fits, else host), "device" or "host".
        cuda_bytes: bytes of the state's CUDA tensors (0: the state has none, so "host").
        reusable_bytes: bytes of the device pool that this save reuses.
        memory: the GPU's free and total memory (needed unless the answer is host anyway).
        max_device_bytes: the most GPU memory the device pool may hold (None: no limit but
            the free memory).
        devices: the number of CUDA devices the state's tensors are on.

    Raises:
        CkptkitError: `requested` is "device" and the state does not fit (one line: what
            does not fit, and what to pass instead).
    """
    if cuda_bytes == 0:
        return SnapshotChoice("host", "no CUDA tensors in the state (CPU tensors are always copied to host memory)")
    if requested == "host":
        return SnapshotChoice("host", "snapshot='host'", cuda_bytes)
    misfit = _misfit(cuda_bytes, reusable_bytes, memory, max_device_bytes, devices)
    if misfit is None:
        how = f"{_gb(cuda_bytes)} copied into GPU buffers ({_gb(cuda_bytes - reusable_bytes)} newly allocated)"
        return SnapshotChoice("device", f"snapshot={requested!r}: {how}", cuda_bytes, cuda_bytes)
    if requested == "device":
        raise CkptkitError(
            f"snapshot='device': {misfit}; nothing was saved (pass snapshot='auto' or 'host', or a larger max_device_bytes)"
        )
    return SnapshotChoice("host", f"snapshot='auto' fell back to host: {misfit}", cuda_bytes)


def _misfit(
    cuda_bytes: int, reusable_bytes: int, memory: DeviceMemory | None, max_device_bytes: int | None, devices: int
) -> str | None:
    """Why a device snapshot does not fit, or None when it does."""
    if devices > 1:
        return f"the state's CUDA tensors are on {devices} devices, a device snapshot copies from one"
    if max_device_bytes is not None and cuda_bytes > max_device_bytes:
        return f"the state's CUDA tensors take {_gb(cuda_bytes)}, over max_device_bytes ({_gb(max_device_bytes)})"
    if memory is None:
        return "the GPU's free memory is unknown"
    needed = cuda_bytes - reusable_bytes
    margin = int(memory.total * DEVICE_MARGIN)
    if needed > memory.free - margin:
        return (
            f"the GPU buffers need {_gb(needed)} more, the GPU has {_gb(memory.free)} free "
            f"of which {_gb(margin)} stays free"
        )
    return None


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pow2_ceil(n: int) -> int:
    """The smallest power of two at least `n` (1 for 0): what torch's pinned allocator reserves."""
    return 1 << max(0, (n - 1).bit_length())


def plan_arenas(sizes: Sequence[int], min_arena: int = MIN_ARENA_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """Pack pieces of `sizes` bytes into power-of-two arenas; return the arenas' sizes and each
    piece's (arena, byte offset), (-1, 0) for an empty piece.

    First fit, largest piece first, at 64-byte offsets, into arenas of the larger of `min_arena`
    and the power of two at or above the largest piece; each arena is then cut down to the power
    of two its pieces need (so a small state takes one small arena)."""
    spans = [-(-n // ALIGN) * ALIGN for n in sizes]
    where = [(-1, 0)] * len(spans)
    order = sorted((i for i, n in enumerate(spans) if n), key=lambda i: (-spans[i], i))
    if not order:
        return [], where
    cap = max(min_arena, pow2_ceil(spans[order[0]]))
    used: list[int] = []
    for i in order:
        arena = next((a for a, u in enumerate(used) if u + spans[i] <= cap), len(used))
        if arena == len(used):
            used.append(0)
        where[i] = (arena, used[arena])
        used[arena] += spans[i]
    return [pow2_ceil(u) for u in used], where


@dataclass
class BufferPool:
    """Buffers by (fqn, piece index), reused while the state keeps its shapes and dtypes.

    A host pool (`on_device` False) holds CPU buffers: plain ones for CPU sources, and, for CUDA
    sources, views of a few pinned arenas laid out by `arrange` (`plan_arenas`). A device pool
    holds buffers on each source's own device. `allocations` and `allocated_bytes` count every
    allocation made (a reused buffer is not counted again; an arena is one allocation);
    `held_bytes` is what it holds now, the arenas' whole (pinned) sizes included.
    """

    on_device: bool = False
    tensors: dict[Key, torch.Tensor] = field(default_factory=dict)
    allocations: int = 0
    allocated_bytes: int = 0
    arenas: list[torch.Tensor] = field(default_factory=list)
    arena_keys: frozenset[Key] = frozenset()

    def fits(self, buf: torch.Tensor | None, like: torch.Tensor) -> bool:
        """Whether `buf` can hold a copy of `like` in this pool."""
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            return False
        if self.on_device:
            return buf.device == like.device
        if buf.device.type != "cpu":
            return False
        # An empty buffer holds no bytes to pin (and a 0-byte pinned tensor reports is_pinned False).
        return buf.numel() == 0 or buf.is_pinned() == (like.device.type == "cuda")

    def arrange(self, pieces: Sequence[tuple[Key, torch.Tensor]]) -> None:
        """Lay out the pinned host buffers of the CUDA `pieces` in arenas (`plan_arenas`): kept
        while the pieces keep their keys, shapes and dtypes, else rebuilt whole (the old arenas
        are let go before the new ones are pinned)."""
        keys = frozenset(key for key, _ in pieces)
        if keys == self.arena_keys and all(self.fits(self.tensors.get(key), t) for key, t in pieces):
            return
        for key in self.arena_keys:
            self.tensors.pop(key, None)
        self.arenas, self.arena_keys = [], frozenset()
        sizes, where = plan_arenas([_nbytes(t) for _, t in pieces])
        self.arenas = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
        for (key, like), (arena, offset) in zip(pieces, where):
            if arena < 0:
                buf = torch.empty(like.shape, dtype=like.dtype)
            else:
                buf = self.arenas[arena][offset : offset + _nbytes(like)].view(like.dtype).view(like.shape)
            self.tensors[key] = buf
        self.allocations += len(sizes)
        self.allocated_bytes += sum(sizes)
        self.arena_keys = keys

    def get(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """The buffer for `key`, allocated (or replaced) unless the one held fits `like`."""
        buf = self.tensors.get(key)
        if buf is None or not self.fits(buf, like):
            pinned = not self.on_device and like.device.type == "cuda" and like.numel() > 0
            if self.on_device:
                buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            else:
                buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
            self.tensors[key] = buf
            self.allocations += 1
            self.allocated_bytes += pow2_ceil(_nbytes(buf)) if pinned else _nbytes(buf)
        return buf

    def reusable_bytes(self, pieces: list[tuple[Key, torch.Tensor]]) -> int:
        """The bytes of the buffers held that copies of `pieces` would reuse."""
        return sum(_nbytes(t) for key, t in pieces if self.fits(self.tensors.get(key), t))

    def held_bytes(self) -> int:
        """The bytes held: the buffers outside the arenas (a pinned one as the power of two the
        pinned allocator reserves for it) and the arenas' whole sizes."""
        held = sum(_nbytes(a) for a in self.arenas)
        for key, t in self.tensors.items():
            if key not in self.arena_keys:
                held += pow2_ceil(_nbytes(t)) if not self.on_device and t.numel() and t.is_pinned() else _nbytes(t)
        return held

    def retain(self, keys: set[Key]) -> None:
        """Drop the buffers of keys no longer in the state (an arena goes at the next `arrange`)."""
        for key in set(self.tensors) - keys:
            del self.tensors[key]

    def clear(self) -> None:
        self.tensors.clear()
        self.arenas, self.arena_keys = [], frozenset()


@dataclass(frozen=True)
class HostCopy:
    """A host snapshot in flight: one `SideCopy` per source device, whose event marks the end
    of its device-to-host copies."""

    copied: tuple[SideCopy, ...]

    def wait_staged(self) -> None:
        for issued in self.copied:
            issued.done.synchronize()

    def wait_on_host(self) -> None:
        self.wait_staged()


@dataclass(frozen=True)
class DeviceCopy:
    """A device snapshot in flight: one `SideCopy` per source device for its device-to-device
    copies, and the (host buffer, GPU buffer) pairs to drain after them."""

    streams: SideStreams
    copied: tuple[SideCopy, ...]
    drains: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    def wait_staged(self) -> None:
        for issued in self.copied:
            issued.done.synchronize()

    def wait_on_host(self) -> None:
        """Copy the GPU buffers into the host buffers, each device's on its side stream (after
        its device-to-device copies), and wait for them all; no current stream waits."""
        for issued in side_copy(self.streams, self.drains):
            issued.done.synchronize()


def copy_to_host(streams: SideStreams, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> HostCopy:
    """Enqueue device-to-host copies (host buffer, CUDA source) on each source device's side
    stream (`side_copy`), after that device's current stream; later work on each current stream
    waits for them (on the device, not the host), so tensors overwritten after save returns
    cannot leak into the checkpoint."""
    return HostCopy(tuple(side_copy(streams, copies, follow=True, hold=True, keep_sources=True)))


def copy_to_device(streams: SideStreams, pool: BufferPool, copies: list[tuple[Key, torch.Tensor, torch.Tensor]]) -> DeviceCopy:
    """Enqueue device-to-device copies of the CUDA sources of (key, host buffer, source) into
    `pool`'s buffers, on each source device's side stream (`side_copy`), after that device's
    current stream; each current stream then waits for these copies alone (the drain to the
    host buffers comes later, from `DeviceCopy.wait_on_host`).

    Every GPU buffer is allocated first, with its device's side stream current, so that the
    caching allocator ties it to that stream, and before any copy is enqueued.

    Raises:
        torch.cuda.OutOfMemoryError: a GPU buffer could not be allocated (no copy was enqueued).
    """
    buffers: dict[Key, torch.Tensor] = {}
    for device, group in by_device(copies, lambda c: c[2].device).items():
        with torch.cuda.device(device), torch.cuda.stream(streams.get(device)):
            for key, _, src in group:
                buffers[key] = pool.get(key, src)
    copied = side_copy(streams, [(buffers[key], src) for key, _, src in copies], follow=True, hold=True, keep_sources=True)
    return DeviceCopy(streams, tuple(copied), tuple((host, buffers[key]) for key, host, _ in copies))


def device_memory(device: torch.device) -> DeviceMemory:
    """The free and total memory of a CUDA device, as the driver reports them."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(free), int(total))


__all__ = [
    "SNAPSHOT_KINDS", "BufferPool", "DeviceCopy", "DeviceMemory", "HostCopy", "SnapshotChoice", "check_snapshot_options",
    "choose_snapshot", "copy_to_device", "copy_to_host", "device_memory", "plan_arenas", "pow2_ceil",
]
