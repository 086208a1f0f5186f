"""Asynchronous checkpointing: a trainer pays only for copying its state out of the way.

``CheckpointManager(root).save(step, state)`` copies every tensor of `state` into a pool of
buffers allocated on the first save and reused by the next ones, then returns a `SaveHandle`:
plain preallocated host memory for CPU tensors; for CUDA tensors, pinned host memory filled on
a side CUDA stream (a host snapshot) or GPU buffers filled device to device and drained to
pinned memory in the background (a device snapshot: `snapshot=`, see `snapshot.py`). A background thread hashes, writes and commits the copy exactly as
``ckptkit.save`` does (temporary name, manifest last, rename, ``latest``), then applies the
retention policy. One save is in flight at a time: the next save, `wait` or `close` first
waits for it and re-raises its error, if it failed.

Under torch.distributed every rank builds the manager and calls save together; the background
saves coordinate over a gloo group of their own, so they never interleave with the training's
collectives, and rank 0 commits only once every rank's payload is durable.

The background work is done by threads: copying into the buffers, writing (``os.write``) and
hashing (xxhash) release the GIL, so the training thread keeps running while a save is written.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from . import retention
from ..io import leases
from .snapshot import (
    BufferPool, DeviceCopy, HostCopy, Key, SnapshotChoice, check_snapshot_options, choose_snapshot, copy_to_device,
    copy_to_host, device_memory,
)
from ..io.catalog import LATEST_NAME, read_latest, step_of
from ..io.run_record import RunRecord, record_run
from ..errors import CheckpointNotFoundError, CkptkitError, LayoutError
from ..manifest import MANIFEST_NAME, CheckpointInfo, Manifest, Topology
from ..state.device import SideStreams
from ..state.sharded import ShardedTensor
from ..ops.collective import SingleProcess, TorchDistributed
from ..storage import Storage, open_storage
from ..storage.memory import MemoryStorage
from .tier import FlushReport, MemoryTier, RestoreReport, clear_name, finish_snapshot
from ..state.torch_io import is_leaf
from ..state.tree import flatten, unflatten

log = logging.getLogger(__name__)

@dataclass
class SaveHandle:
    """One save: `staged` is done when the state may be changed again (at return for CPU
    tensors, once the side stream's copies finish for GPU tensors); `committed` gives the
    committed manifest, or raises the save's error; `snapshot` says how its CUDA tensors were
    copied (host or device, and why)."""

    step: int
    name: str
    staged: Future[None]
    committed: Future[Manifest]
    stall_s: float = 0.0  # how long save() blocked its caller
    background_s: float | None = None  # from the end of staging to the commit (set when committed)
    snapshot: SnapshotChoice | None = None
    tier: str = "storage"  # or "memory": a snapshot in the memory tier


class CheckpointManager:
    """Save checkpoints under a root asynchronously, and keep the right ones.

    Args:
        root: a directory (or storage URL) holding the checkpoints, named ``step_00000100``.
        keep_last: keep the newest N committed checkpoints (None: keep all).
        keep_every: also keep every step divisible by M.
        storage: write through this backend instead of opening `root`.
        process_group: the ranks that save together (default: the whole job when
            torch.distributed is initialized); a gloo group over the same ranks is made for the
            background saves, so every rank must construct the manager.
        name_format: checkpoint names, formatted with ``step``.
        sync: save in the caller's thread (for comparison); handles are done at return.
        run: the run these checkpoints belong to, recorded as the root's ``run.json`` after the
            first commit (``ckptkit.RunRecord``; None: record nothing).
        snapshot: how `save` copies CUDA tensors: "host" (into pinned host memory, on a side
            stream; the current stream waits for these device-to-host copies), "device" (into
            GPU buffers reused from save to save, device to device; the current stream waits
            only for that, and the background thread drains them to pinned host memory), or
            "auto" (device when the GPU's free memory and `max_device_bytes` allow, else host).
            CPU tensors are always copied into host memory, whatever it says. Each save's
            choice is its handle's `snapshot` (and `snapshot_choice` here, and logged).
        max_device_bytes: the most GPU memory a device snapshot's buffers may hold (None: what
            the GPU has free, less 5% of its memory). Over it, "auto" takes host snapshots and
            "device" refuses to save.
        memory: a memory tier (``ckptkit.MemoryTier``): ``save(..., tier="memory")`` then
            writes to node-local shared memory and replicates to peers, `restore` reads the
            newest step from the cheapest good copy, `flush` writes a snapshot to storage.
        compact_after: with ``incremental=True`` (a save option), once a committed save holds a
            box under this many patches, compact it (``ckptkit.compact``) in the background,
            before the next save starts: a restore of it then reads one full copy, and the next
            save compares with it (None: never). A failed compaction is a warning; the
            checkpoint stays as it was.
        save_options: passed to every ``ckptkit.save`` (max_file_bytes, io_threads, layout,
            incremental).

    Use as a context manager, or call `close`, so the last save is committed.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        storage: Storage | None = None,
        process_group: Any = None,
        name_format: str = "step_{step:08d}",
        sync: bool = False,
        run: RunRecord | None = None,
        snapshot: str = "host",
        max_device_bytes: int | None = None,
        compact_after: int | None = None,
        memory: MemoryTier | None = None,
        **save_options: Any,
    ) -> None:
        check_snapshot_options(snapshot, max_device_bytes)
        if keep_last is not None and keep_last < 1:
            raise LayoutError(f"keep_last must be at least 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise LayoutError(f"keep_every must be at least 1, got {keep_every}")
        if compact_after is not None and compact_after < 1:
            raise LayoutError(f"compact_after must be at least 1, got {compact_after}")
        self.compact_after = compact_after
        self.root = str(root)
        self.storage = storage if storage is not None else open_storage(root)
        self.policy = retention.Policy(keep_last, keep_every)
        self.name_format = name_format
        self.sync = sync
        self.save_options = save_options
        self.run = run
        self._run_recorded = run is None
        self._group, self._rank = _background_group(process_group)
        self.snapshot = snapshot
        self.max_device_bytes = max_device_bytes
        self.snapshot_choice: SnapshotChoice | None = None  # the last save's
        self._buffers = BufferPool()
        self._device_buffers = BufferPool(on_device=True)
        self._pinned: set[int] = set()
        self._reading: dict[str, int] = {}
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptkit-save")
        self._inflight: SaveHandle | None = None
        self._closed = False
        self._side_streams = SideStreams()  # one per CUDA device the saved tensors are on
        self.memory = memory
        self._coll = TorchDistributed(self._group) if self._group is not None else SingleProcess()
        # Every rank's node, in rank order (a collective: every rank constructs the manager).
        self._nodes = self._coll.all_gather(memory.node_name()) if memory is not None else ["local"] * self._coll.world_size
        self._node_storage = memory.storage() if memory is not None else MemoryStorage()

    # --- saving -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        topology: Topology | None = None,
        info: CheckpointInfo | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        kinds: Mapping[str, str] | None = None,
        tier: str = "storage",
    ) -> SaveHandle:
        """Stage `state` and save it in the background as checkpoint `step`; return its handle.

        Waits first for the save in flight, if any, and re-raises its error. The arguments
        are those of ``ckptkit.save``; a `tokenizer` path must stay until the save commits.
        With ``tier="memory"`` the save is a snapshot in the memory tier: each node's folder
        gets its ranks' files and the manifest, then each rank's files are sent to its peers;
        storage's retention, run record and compaction are not touched.

        Raises:
            LayoutError: a value of `state` is neither a tensor nor JSON (nothing staged).
            CkptkitError: the previous save failed (this one is not started); or
                ``snapshot="device"`` and the state's CUDA tensors do not fit (nothing staged).
        """
        started = time.perf_counter()
        self._check_open()
        if tier not in ("storage", "memory"):
            raise LayoutError(f"tier {tier!r}: choose 'storage' or 'memory'")
        if tier == "memory" and self.memory is None:
            raise LayoutError("tier='memory' needs a memory tier: CheckpointManager(..., memory=MemoryTier(...))")
        self.wait()
        name = self.name_format.format(step=step)
        staged_state, ready, choice = self._stage(state)
        staged: Future[None] = Future()
        committed: Future[Manifest] = Future()
        handle = SaveHandle(step, name, staged, committed, snapshot=choice, tier=tier)
        options = dict(self.save_options, topology=topology, info=info, tokenizer=tokenizer, kinds=kinds)
        if tier == "memory":  # a snapshot is whole, and never moves storage's latest
            options.update(incremental=False, update_latest=False, tier=True)
        if ready is None:
            staged.set_result(None)
        handle.stall_s = time.perf_counter() - started
        self._inflight = handle
        if self.sync:
            self._background(handle, staged_state, ready, options)
            handle.stall_s = time.perf_counter() - started
            self._inflight = None
            handle.committed.result()  # a failed synchronous save raises here
        else:
            self._worker.submit(self._background, handle, staged_state, ready, options)
        return handle

    def wait(self) -> None:
        """Wait for the save in flight to commit; re-raise its error if it failed (once)."""
        handle, self._inflight = self._inflight, None
        if handle is not None:
            handle.committed.result()

    def close(self) -> None:
        """Commit the save in flight (re-raising its error) and stop the background thread."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._worker.shutdown(wait=True)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: do not hide that error behind the save's
            self.close()
        except CkptkitError:
            pass

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory the buffer pool holds: CPU tensors' buffers, and the pinned arenas of the
        CUDA tensors' whole (powers of two, as torch's pinned allocator reserves them)."""
        return self._buffers.held_bytes()

    @property
    def device_buffer_bytes(self) -> int:
        """GPU memory the device snapshots' buffers hold (0 unless the last save was one)."""
        return self._device_buffers.held_bytes()

    # --- the memory tier ----------------------------------------------------------------------

    def restore(
        self, target: Mapping[str, Any] | Callable[[Manifest], Mapping[str, Any]] | None = None
    ) -> tuple[dict[str, Any], RestoreReport]:
        """Load the newest step that has a good copy of every file, in the memory tier (this
        node's, or a peer's) or in storage, into `target` (or whole, as ``ckptkit.load``; or
        the target a function makes of the chosen step's manifest); collective. Each file is read from the cheapest good copy; a copy that fails its
        checks is left out (and the choice made again); steps are never mixed. The report says
        the step, where this rank read each file, and what was skipped.

        Raises:
            CheckpointNotFoundError: no tier holds any snapshot or checkpoint (a new run).
            IntegrityError: some are held, but no step has a good copy of every file (the
                message names each step skipped and why); `target` may have been written.
        """
        self._check_open()
        self.wait()
        from .tier import restore

        return restore(self._coll, self._node_storage, self._nodes, self.storage, target, name_format=self.name_format)

    def flush(self, deadline_s: float = 60.0) -> FlushReport:
        """Write this node's newest memory snapshot that storage lacks to storage, as a committed
        checkpoint (``ckptkit.writer.tier.flush``); no collective, so it works when peers died.
        The save in flight is not waited for: only committed snapshots are flushed."""
        if self.memory is None:
            raise LayoutError("flush needs a memory tier: CheckpointManager(..., memory=MemoryTier(...))")
        from .tier import flush

        local = [r for r, n in enumerate(self._nodes) if n == self._nodes[self._coll.rank]].index(self._coll.rank)
        return flush(self._node_storage, self.storage, deadline_s=deadline_s, offset=local)

    def flush_on(self, signals: tuple[int, ...] = (signal.SIGTERM,), *, deadline_s: float = 60.0) -> None:
        """On any of `signals` (from the main thread; a launcher or watchdog sends them), flush
        (`flush`), then let the signal do what it did before (by default: end the process)."""
        previous = {sig: signal.getsignal(sig) for sig in signals}

        def handler(signum: int, frame: Any) -> None:
            try:
                report = self.flush(deadline_s)
                log.warning("ckptkit: flushed on signal %d: %s", signum, report.committed or "; ".join(report.notes) or "nothing to flush")
            finally:
                signal.signal(signum, previous[signum])
                signal.raise_signal(signum)

        for sig in signals:
            signal.signal(sig, handler)

    # --- retention and reading --------------------------------------------------------------

    def pin(self, step: int) -> None:
        """Never delete checkpoint `step` (retention skips it) until `unpin`."""
        self._pinned.add(step)

    def unpin(self, step: int) -> None:
        self._pinned.discard(step)

    def committed_steps(self) -> list[int]:
        """The steps of the committed checkpoints under the root, oldest first."""
        return sorted(step for _, step in self._committed())

    @contextmanager
    def reading(self, step: int | None = None) -> Iterator[str]:
        """Hold checkpoint `step` (default: the latest) against deletion while the block reads
        it; yields its name under the root (a lease file under ``.leases/`` marks it for other
        processes too).

        Raises:
            CheckpointNotFoundError: there is no such committed checkpoint, or retention (of
                this or another process) removed it, or is removing it, as the lease was taken.
        """
        name = self.name_format.format(step=step) if step is not None else read_latest(self.storage)
        if not name:
            raise CheckpointNotFoundError(f"{self.root}: no {LATEST_NAME} pointer, so no latest checkpoint")
        if not self.storage.exists(f"{name}/{MANIFEST_NAME}"):
            raise CheckpointNotFoundError(f"{self.root}/{name}: no committed checkpoint")
        with self._lock:
            self._reading[name] = self._reading.get(name, 0) + 1
        try:
            with leases.lease(self.storage, name):  # checks that retention is not deleting it
                yield name
        finally:
            with self._lock:
                self._reading[name] -= 1
                if not self._reading[name]:
                    del self._reading[name]

    def load(self, target: Mapping[str, Any] | None = None, *, step: int | None = None) -> dict[str, Any]:
        """``ckptkit.load`` of checkpoint `step` (default: the latest), held against deletion meanwhile."""
        from ..ops.load import load

        with self.reading(step) as name:
            return load(name, target, storage=self.storage)

    def apply_retention(self) -> list[str]:
        """Delete the checkpoints the policy does not keep and no reader holds; return their names.

        A reader's lease is honoured whenever it is taken: `retention.apply` marks each
        checkpoint before checking its leases again, and a reader checks for marks after
        taking its lease."""
        committed = self._committed()
        with self._lock:
            local = set(self._reading)
        doomed = retention.plan_deletions(
            committed, read_latest(self.storage), retention.Policy(self.policy.keep_last, self.policy.keep_every, frozenset(self._pinned)), local,
            retention.depends(self.storage),
        )
        held = retention.busy(self.storage, doomed)
        return retention.apply(self.storage, [n for n in doomed if n not in held])

    # --- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CkptkitError("the checkpoint manager is closed")

    def _stage(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], HostCopy | DeviceCopy | None, SnapshotChoice]:
        """Copy the tensors of `state` into the buffers; snapshot its JSON values. Returns the
        staged state, what the background thread waits on while GPU copies are in flight, and
        the snapshot kind chosen (before anything is copied)."""
        leaves, objects = flatten(state, is_leaf)
        try:
            objects = json.loads(json.dumps(objects))
        except (TypeError, ValueError) as exc:
            raise LayoutError(f"values must be tensors or JSON: {exc}") from None
        pieces = {fqn: [leaf] if isinstance(leaf, (torch.Tensor, ShardedTensor)) else list(leaf) for fqn, leaf in leaves.items()}
        locals_ = {(fqn, i): p.local if isinstance(p, ShardedTensor) else p for fqn, ps in pieces.items() for i, p in enumerate(ps)}
        cuda = [(key, t) for key, t in locals_.items() if t.device.type == "cuda"]
        choice = self._choose(cuda)
        self._buffers.arrange(cuda)  # the CUDA pieces' pinned buffers, packed into a few arenas
        staged: dict[str, Any] = {}
        for fqn, leaf in leaves.items():
            out = []
            for i, piece in enumerate(pieces[fqn]):
                buf = self._buffers.get((fqn, i), locals_[fqn, i])
                if locals_[fqn, i].device.type != "cuda":
                    buf.copy_(locals_[fqn, i].detach())
                out.append(ShardedTensor(buf, piece.global_shape, piece.global_offsets) if isinstance(piece, ShardedTensor) else buf)
            staged[fqn] = out[0] if isinstance(leaf, (torch.Tensor, ShardedTensor)) else out
        self._buffers.retain(set(locals_))
        self._device_buffers.retain({key for key, _ in cuda} if choice.kind == "device" else set())
        copies = [(key, self._buffers.tensors[key], t) for key, t in cuda]
        ready, choice = self._copy_cuda(copies, choice)
        return unflatten({**objects, **staged}), ready, choice

    def _choose(self, cuda: list[tuple[Key, torch.Tensor]]) -> SnapshotChoice:
        """The snapshot kind of a save whose CUDA pieces are `cuda`; logged when it changes."""
        nbytes = sum(t.numel() * t.element_size() for _, t in cuda)
        devices = {t.device for _, t in cuda}
        memory = device_memory(next(iter(devices))) if len(devices) == 1 and self.snapshot != "host" else None
        choice = choose_snapshot(
            self.snapshot, cuda_bytes=nbytes, reusable_bytes=self._device_buffers.reusable_bytes(cuda),
            memory=memory, max_device_bytes=self.max_device_bytes, devices=len(devices),
        )
        if self.snapshot_choice is None or self.snapshot_choice.kind != choice.kind:
            log.info("ckptkit: %s snapshots from now on: %s", choice.kind, choice.reason)
        self.snapshot_choice = choice
        return choice

    def _copy_cuda(
        self, copies: list[tuple[Key, torch.Tensor, torch.Tensor]], choice: SnapshotChoice
    ) -> tuple[HostCopy | DeviceCopy | None, SnapshotChoice]:
        """Enqueue the copies of the CUDA pieces (key, host buffer, source) the way `choice`
        says; return what to wait on, and the choice (host, if "auto" ran out of GPU memory)."""
        if not copies:
            return None, choice
        if choice.kind == "device":
            try:
                return copy_to_device(self._side_streams, self._device_buffers, copies), choice
            except torch.cuda.OutOfMemoryError:  # torch.OutOfMemoryError from torch 2.5 on
                self._device_buffers.clear()
                failed = f"the GPU ran out of memory allocating {choice.cuda_bytes / 1e9:.2f} GB of buffers"
                if self.snapshot == "device":
                    raise CkptkitError(f"snapshot='device': {failed}; nothing was saved (pass snapshot='auto' or 'host')") from None
                choice = SnapshotChoice("host", f"snapshot='auto' fell back to host: {failed}", choice.cuda_bytes)
                self.snapshot_choice = choice
                log.info("ckptkit: host snapshots: %s", choice.reason)
        return copy_to_host(self._side_streams, [(buf, src) for _, buf, src in copies]), choice

    def _background(self, handle: SaveHandle, state: dict[str, Any], ready: Any, options: dict[str, Any]) -> None:
        from ..ops.save import save

        try:
            if ready is not None:
                ready.wait_staged()
                handle.staged.set_result(None)
                ready.wait_on_host()
            start = time.perf_counter()
            if options.pop("tier", False):
                assert self.memory is not None
                clear_name(self._coll, self._node_storage, self._nodes, handle.name)
                manifest = save(state, handle.name, step=handle.step, storage=self._node_storage, process_group=self._group,
                                digests_in_manifest=True, **options)
                for problem in finish_snapshot(self._coll, self._node_storage, self._nodes, self.memory, manifest):
                    warnings.warn(f"ckptkit: memory snapshot {handle.name}: a replica was not written: {problem}", stacklevel=2)
                handle.background_s = time.perf_counter() - start
                handle.committed.set_result(manifest)
                return
            manifest = save(state, handle.name, step=handle.step, storage=self.storage, process_group=self._group, **options)
            if self._rank == 0:
                self._record_run()
                self._compact(handle.name, manifest)
                self._retain()
            handle.background_s = time.perf_counter() - start
            handle.committed.set_result(manifest)
        except BaseException as exc:  # delivered at the next save, wait or close
            if not handle.staged.done():
                handle.staged.set_exception(exc)
            handle.committed.set_exception(exc)

    def _compact(self, name: str, manifest: Manifest) -> None:
        """Compact a save whose patches reached `compact_after` (a failure is a warning)."""
        if self.compact_after is None:
            return
        depth: dict[tuple[str, tuple[int, ...]], int] = {}
        for fqn, entry in manifest.tensors.items():
            for p in entry.patches:
                depth[(fqn, p.offsets)] = depth.get((fqn, p.offsets), 0) + 1
        if max(depth.values(), default=0) < self.compact_after:
            return
        from ..ops.compact import compact

        try:
            compact(name, storage=self.storage)
        except CkptkitError as exc:
            warnings.warn(f"ckptkit: compaction of {name} failed (it stays as it was): {exc}", stacklevel=2)

    def _retain(self) -> None:
        """Apply retention after a commit. Its failure does not fail the save that committed (and
        only rank 0 runs it, so raising would leave the other ranks waiting): it is a warning."""
        try:
            self.apply_retention()
        except CkptkitError as exc:
            warnings.warn(f"ckptkit: retention after a commit failed (nothing was deleted after it): {exc}", stacklevel=2)

    def _record_run(self) -> None:
        """Record the run in the root after its first commit here (a failure is a warning: the
        checkpoint is committed all the same)."""
        if self._run_recorded or self.run is None:
            return
        try:
            record_run(self.storage, self.run)
            self._run_recorded = True
        except CkptkitError as exc:
            warnings.warn(f"ckptkit: {self.root}: the run record was not written: {exc}", stacklevel=2)

    def _committed(self) -> list[tuple[str, int]]:
        out = []
        for child in self.storage.list("", recursive=False):
            name = child.rstrip("/")
            if not child.endswith("/") or name.startswith(".") or name == LATEST_NAME:
                continue
            if self.storage.exists(f"{name}/{MANIFEST_NAME}"):
                step = step_of(self.storage, name)
                # Only this manager's checkpoints: not an export or a reshard kept under the same root.
                if step is not None and name == self.name_format.format(step=step):
                    out.append((name, step))
        return out


def _background_group(process_group: Any) -> tuple[Any, int]:
    """A gloo group over the saving ranks for the background saves, and this rank in it."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None, 0
    if process_group is None and dist.get_world_size() == 1:
        return None, 0
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    group = dist.new_group(ranks=ranks, backend="gloo")
    return group, dist.get_rank(group)


__all__ = ["CheckpointManager", "SaveHandle"]
