"""Asynchronous checkpointing: a trainer pays only for copying its state out of the way.

``CheckpointManager(root).save(step, state)`` copies every tensor of `state` into a pool of
host buffers allocated on the first save and reused by the next ones (pinned memory filled on
a side CUDA stream for GPU tensors, plain preallocated memory for CPU tensors), then returns
a `SaveHandle`. A background thread hashes, writes and commits the copy exactly as
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
import os
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from . import retention
from ..io.catalog import LATEST_NAME, read_latest, step_of
from ..io.run_record import RunRecord, record_run
from ..errors import CheckpointNotFoundError, CkptkitError, LayoutError
from ..manifest import MANIFEST_NAME, CheckpointInfo, Manifest, Topology
from ..state.sharded import ShardedTensor
from ..storage import Storage, open_storage
from ..state.torch_io import is_leaf
from ..state.tree import flatten, unflatten


@dataclass
class SaveHandle:
    """One save: `staged` is done when the state may be changed again (at return for CPU
    tensors, once the side stream's copies finish for GPU tensors); `committed` gives the
    committed manifest, or raises the save's error."""

    step: int
    name: str
    staged: Future[None]
    committed: Future[Manifest]
    stall_s: float = 0.0  # how long save() blocked its caller
    background_s: float | None = None  # from the end of staging to the commit (set when committed)


@dataclass
class _Buffers:
    """Host buffers by (fqn, piece index), reused while the state keeps its shapes and dtypes."""

    tensors: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    allocations: int = 0
    allocated_bytes: int = 0

    def get(self, key: tuple[str, int], like: torch.Tensor) -> torch.Tensor:
        buf = self.tensors.get(key)
        pinned = like.device.type == "cuda"
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.is_pinned() != pinned:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
            self.tensors[key] = buf
            self.allocations += 1
            self.allocated_bytes += buf.numel() * buf.element_size()
        return buf


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
        save_options: passed to every ``ckptkit.save`` (max_file_bytes, io_threads, layout).

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
        **save_options: Any,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise LayoutError(f"keep_last must be at least 1, got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise LayoutError(f"keep_every must be at least 1, got {keep_every}")
        self.root = str(root)
        self.storage = storage if storage is not None else open_storage(root)
        self.policy = retention.Policy(keep_last, keep_every)
        self.name_format = name_format
        self.sync = sync
        self.save_options = save_options
        self.run = run
        self._run_recorded = run is None
        self._group, self._rank = _background_group(process_group)
        self._buffers = _Buffers()
        self._pinned: set[int] = set()
        self._reading: dict[str, int] = {}
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptkit-save")
        self._inflight: SaveHandle | None = None
        self._closed = False
        self._side_stream: Any = None

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
    ) -> SaveHandle:
        """Stage `state` and save it in the background as checkpoint `step`; return its handle.

        Waits first for the save in flight, if any, and re-raises its error. The arguments
        are those of ``ckptkit.save``; a `tokenizer` path must stay until the save commits.

        Raises:
            LayoutError: a value of `state` is neither a tensor nor JSON (nothing staged).
            CkptkitError: the previous save failed (this one is not started).
        """
        started = time.perf_counter()
        self._check_open()
        self.wait()
        name = self.name_format.format(step=step)
        staged_state, ready = self._stage(state)
        staged: Future[None] = Future()
        committed: Future[Manifest] = Future()
        handle = SaveHandle(step, name, staged, committed)
        options = dict(self.save_options, topology=topology, info=info, tokenizer=tokenizer, kinds=kinds)
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
            with retention.lease(self.storage, name):  # checks that retention is not deleting it
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
            committed, read_latest(self.storage), retention.Policy(self.policy.keep_last, self.policy.keep_every, frozenset(self._pinned)), local
        )
        held = retention.busy(self.storage, doomed)
        return retention.apply(self.storage, [n for n in doomed if n not in held])

    # --- internals --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CkptkitError("the checkpoint manager is closed")

    def _stage(self, state: Mapping[str, Any]) -> tuple[dict[str, Any], torch.cuda.Event | None]:
        """Copy the tensors of `state` into the buffers; snapshot its JSON values. Returns the
        staged state and, when GPU copies are in flight, the event that marks their end."""
        leaves, objects = flatten(state, is_leaf)
        try:
            objects = json.loads(json.dumps(objects))
        except (TypeError, ValueError) as exc:
            raise LayoutError(f"values must be tensors or JSON: {exc}") from None
        staged: dict[str, Any] = {}
        keep: set[tuple[str, int]] = set()
        cuda_copies = []
        for fqn, leaf in leaves.items():
            pieces = [leaf] if isinstance(leaf, (torch.Tensor, ShardedTensor)) else list(leaf)
            out = []
            for i, piece in enumerate(pieces):
                local = piece.local if isinstance(piece, ShardedTensor) else piece
                buf = self._buffers.get((fqn, i), local)
                keep.add((fqn, i))
                if local.device.type == "cuda":
                    cuda_copies.append((buf, local))
                else:
                    buf.copy_(local.detach())
                out.append(ShardedTensor(buf, piece.global_shape, piece.global_offsets) if isinstance(piece, ShardedTensor) else buf)
            staged[fqn] = out[0] if isinstance(leaf, (torch.Tensor, ShardedTensor)) else out
        for key in set(self._buffers.tensors) - keep:  # tensors no longer in the state
            del self._buffers.tensors[key]
        event = self._copy_from_gpu(cuda_copies) if cuda_copies else None
        return unflatten({**objects, **staged}), event

    def _copy_from_gpu(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.Event:
        """Enqueue device-to-host copies on a side stream that first waits for the current
        stream; later work on the current stream waits for the copies (on the device, not the
        host), so tensors overwritten after save returns cannot leak into the checkpoint."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        side = self._side_stream
        current = torch.cuda.current_stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for buf, src in copies:
                buf.copy_(src.detach(), non_blocking=True)
                src.record_stream(side)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(side)
        current.wait_stream(side)
        return event

    def _background(self, handle: SaveHandle, state: dict[str, Any], ready: Any, options: dict[str, Any]) -> None:
        from ..ops.save import save

        try:
            if ready is not None:
                ready.synchronize()
                handle.staged.set_result(None)
            start = time.perf_counter()
            manifest = save(state, handle.name, step=handle.step, storage=self.storage, process_group=self._group, **options)
            if self._rank == 0:
                self._record_run()
                self._retain()
            handle.background_s = time.perf_counter() - start
            handle.committed.set_result(manifest)
        except BaseException as exc:  # delivered at the next save, wait or close
            if not handle.staged.done():
                handle.staged.set_exception(exc)
            handle.committed.set_exception(exc)

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
