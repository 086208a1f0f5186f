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
GPU); `BufferPool` holds the buffers, reused while the state keeps its shapes and dtypes;
`copy_to_host` and `copy_to_device` enqueue the copies and return what the background thread
waits on (`HostCopy`, `DeviceCopy`): call `wait_staged` (the state may change), then
`wait_on_host` (the host buffers hold the snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..errors import CkptkitError

SNAPSHOT_KINDS = ("auto", "device", "host")
# A device snapshot leaves this share of the GPU's memory free (for fragmentation and the
# training's own growth), on top of what the driver reports free.
DEVICE_MARGIN = 0.05

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


@dataclass
class BufferPool:
    """Buffers by (fqn, piece index), reused while the state keeps its shapes and dtypes.

    A host pool (`device` None) holds CPU buffers, pinned for CUDA sources; a device pool holds
    buffers on each source's own device. `allocations` and `allocated_bytes` count every
    allocation made (a reused buffer is not counted again); `held_bytes` is what it holds now.
    """

    on_device: bool = False
    tensors: dict[Key, torch.Tensor] = field(default_factory=dict)
    allocations: int = 0
    allocated_bytes: int = 0

    def fits(self, buf: torch.Tensor | None, like: torch.Tensor) -> bool:
        """Whether `buf` can hold a copy of `like` in this pool."""
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            return False
        if self.on_device:
            return buf.device == like.device
        return buf.device.type == "cpu" and buf.is_pinned() == (like.device.type == "cuda")

    def get(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """The buffer for `key`, allocated (or replaced) unless the one held fits `like`."""
        buf = self.tensors.get(key)
        if buf is None or not self.fits(buf, like):
            if self.on_device:
                buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
            else:
                buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")
            self.tensors[key] = buf
            self.allocations += 1
            self.allocated_bytes += _nbytes(buf)
        return buf

    def reusable_bytes(self, pieces: list[tuple[Key, torch.Tensor]]) -> int:
        """The bytes of the buffers held that copies of `pieces` would reuse."""
        return sum(_nbytes(t) for key, t in pieces if self.fits(self.tensors.get(key), t))

    def held_bytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    def retain(self, keys: set[Key]) -> None:
        """Drop the buffers of keys no longer in the state."""
        for key in set(self.tensors) - keys:
            del self.tensors[key]

    def clear(self) -> None:
        self.tensors.clear()


@dataclass(frozen=True)
class HostCopy:
    """A host snapshot in flight: `done` marks the end of its device-to-host copies."""

    done: Any  # torch.cuda.Event

    def wait_staged(self) -> None:
        self.done.synchronize()

    def wait_on_host(self) -> None:
        self.done.synchronize()


@dataclass(frozen=True)
class DeviceCopy:
    """A device snapshot in flight: its side stream, the event that ends its device-to-device
    copies, and the (host buffer, GPU buffer) pairs to drain."""

    stream: Any  # torch.cuda.Stream
    copied: Any  # torch.cuda.Event
    pairs: list[tuple[torch.Tensor, torch.Tensor]]

    def wait_staged(self) -> None:
        self.copied.synchronize()

    def wait_on_host(self) -> None:
        """Copy the GPU buffers into the host buffers on the side stream (after its
        device-to-device copies) and wait for that; the current stream does not wait."""
        with torch.cuda.stream(self.stream):
            for host, dev in self.pairs:
                host.copy_(dev, non_blocking=True)
            drained = torch.cuda.Event()  # type: ignore[no-untyped-call]
            drained.record(self.stream)
        drained.synchronize()


def copy_to_host(stream: Any, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> HostCopy:
    """Enqueue device-to-host copies (host buffer, CUDA source) on `stream`, which first waits
    for the current stream; later work on the current stream waits for the copies (on the
    device, not the host), so tensors overwritten after save returns cannot leak into the
    checkpoint."""
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for buf, src in copies:
            buf.copy_(src.detach(), non_blocking=True)
            src.record_stream(stream)  # a source freed after save returns is not reused before the copy
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(stream)
    current.wait_stream(stream)
    return HostCopy(done)


def copy_to_device(stream: Any, pool: BufferPool, copies: list[tuple[Key, torch.Tensor, torch.Tensor]]) -> DeviceCopy:
    """Enqueue device-to-device copies of the CUDA sources of (key, host buffer, source) into
    `pool`'s buffers on `stream`, which first waits for the current stream; the current stream
    then waits for these copies alone (the drain to the host buffers comes later, from
    `DeviceCopy.wait_on_host`).

    The GPU buffers are allocated first, with `stream` current, so that the caching allocator
    ties them to the side stream, and before any copy is enqueued.

    Raises:
        torch.OutOfMemoryError: a GPU buffer could not be allocated (no copy was enqueued).
    """
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        pairs = [(host, pool.get(key, src)) for key, host, src in copies]
        for (host, dev), (_, _, src) in zip(pairs, copies):
            dev.copy_(src.detach(), non_blocking=True)
            src.record_stream(stream)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(stream)
    current.wait_stream(stream)
    return DeviceCopy(stream, copied, pairs)


def device_memory(device: torch.device) -> DeviceMemory:
    """The free and total memory of a CUDA device, as the driver reports them."""
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(int(free), int(total))


__all__ = [
    "SNAPSHOT_KINDS", "BufferPool", "DeviceCopy", "DeviceMemory", "HostCopy", "SnapshotChoice",
    "check_snapshot_options", "choose_snapshot", "copy_to_device", "copy_to_host", "device_memory",
]
