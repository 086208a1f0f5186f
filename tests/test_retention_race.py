"""Readers and retention agree whatever the interleaving, and a full disk at ``latest`` leaves a
committed checkpoint committed.

The races are forced, not timed: a storage fake runs a hook once, exactly before or after the
first write or delete of a chosen key, so the other side acts at that point of the protocol.
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit import CheckpointNotFoundError, StorageError
from ckptkit.storage import LocalStorage, Storage
from ckptkit.storage.base import Buffer
from ckptkit.io import leases
from ckptkit.writer import retention
from ckptkit.writer.manager import CheckpointManager

OLD, NEW = "step_00000001", "step_00000002"


class HookedStorage(LocalStorage):
    """Local storage that runs `hook` once, before (or after) the first `op` ("write" or
    "delete") of a key that `match` accepts."""

    def __init__(
        self, root: Path, op: str, match: Callable[[str], bool], hook: Callable[[], object], *, after: bool = False
    ) -> None:
        super().__init__(root)
        self.op, self.match, self.hook, self.after = op, match, hook, after
        self.fired = False

    def _fire(self, op: str, key: str, when_after: bool) -> None:
        if not self.fired and op == self.op and when_after == self.after and self.match(key):
            self.fired = True
            self.hook()

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        self._fire("write", key, False)
        size = super().write(key, chunks)
        self._fire("write", key, True)
        return size

    def delete(self, prefix: str) -> None:
        self._fire("delete", prefix, False)
        super().delete(prefix)
        self._fire("delete", prefix, True)


class FullAtLatest(LocalStorage):
    """Local storage whose writes of the root's ``latest`` fail with ENOSPC once `full` is set."""

    full = False

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        if self.full and key == "latest":
            raise StorageError(errno.ENOSPC, "No space left on device")
        return super().write(key, chunks)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.full((8,), float(step))}, "meta": {"step": step}}


def _two_checkpoints(root: Path) -> None:
    storage = LocalStorage(root)
    for step, name in ((1, OLD), (2, NEW)):
        ckptkit.save(_state(step), name, step=step, storage=storage)


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _is_mark(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(leases.MARK_PREFIX)


def _is_lease(key: str) -> bool:
    return key.startswith(f".leases/{OLD}/") and not _is_mark(key)


def _assert_loads(storage: Storage, name: str, step: int) -> None:
    loaded = ckptkit.load(name, storage=storage)
    want = _state(step)
    assert torch.equal(loaded["model"]["w"], want["model"]["w"])
    assert torch.equal(loaded["model"]["b"], want["model"]["b"])


def test_a_lease_taken_after_the_busy_check_but_before_the_mark_keeps_the_checkpoint(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    before = _files(tmp_path / OLD)
    reader = CheckpointManager(tmp_path)
    held = contextlib.ExitStack()
    # The reader leases after the deleter's first look at the leases, just before it marks.
    storage = HookedStorage(tmp_path, "write", _is_mark, lambda: held.enter_context(reader.reading(1)))
    with held:
        assert CheckpointManager(tmp_path, keep_last=1, storage=storage).apply_retention() == []
        assert storage.fired
        assert _files(tmp_path / OLD) == before
        _assert_loads(reader.storage, OLD, 1)
    assert not [p for p in (tmp_path / ".leases").rglob("*") if p.is_file()]  # no lease, no mark left
    assert CheckpointManager(tmp_path, keep_last=1).apply_retention() == [OLD]  # released: it may go


def test_a_lease_written_before_the_deleter_rechecks_keeps_the_checkpoint(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    before = _files(tmp_path / OLD)
    deleted: list[list[str]] = []
    # The whole deletion runs after the reader wrote its lease and before it checks for a mark.
    hook = lambda: deleted.append(retention.apply(LocalStorage(tmp_path), [OLD]))  # noqa: E731
    reader = CheckpointManager(tmp_path, storage=HookedStorage(tmp_path, "write", _is_lease, hook, after=True))
    with reader.reading(1) as name:
        assert deleted == [[]]
        assert _files(tmp_path / OLD) == before
        _assert_loads(reader.storage, name, 1)
    assert _files(tmp_path / OLD) == before


def test_a_reader_between_the_deleters_check_and_its_delete_is_told_it_was_removed(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    reader = CheckpointManager(tmp_path)
    refused: list[CheckpointNotFoundError] = []

    def read() -> None:
        with pytest.raises(CheckpointNotFoundError, match="removed by retention") as info:
            with reader.reading(1):
                pass
        refused.append(info.value)

    storage = HookedStorage(tmp_path, "delete", lambda key: key == f"{OLD}/manifest.json", read)
    assert CheckpointManager(tmp_path, keep_last=1, storage=storage).apply_retention() == [OLD]
    assert len(refused) == 1
    assert not (tmp_path / OLD).exists() and not (tmp_path / ".leases" / OLD).exists()
    _assert_loads(LocalStorage(tmp_path), NEW, 2)


def test_a_reader_whose_lease_follows_a_finished_deletion_is_told_it_was_removed(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    deleted: list[list[str]] = []
    # The reader saw the manifest; the whole deletion runs just before it writes its lease.
    hook = lambda: deleted.append(retention.apply(LocalStorage(tmp_path), [OLD]))  # noqa: E731
    reader = CheckpointManager(tmp_path, storage=HookedStorage(tmp_path, "write", _is_lease, hook))
    with pytest.raises(CheckpointNotFoundError, match="removed by retention"):
        with reader.reading(1):
            pass
    assert deleted == [[OLD]] and not (tmp_path / OLD).exists()
    assert not [p for p in (tmp_path / ".leases").rglob("*") if p.is_file()]  # its lease released


def test_a_mark_of_a_dead_deleter_does_not_refuse_readers(tmp_path: Path) -> None:
    _two_checkpoints(tmp_path)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mark = tmp_path / ".leases" / OLD / f"{leases.MARK_PREFIX}dead"
    mark.parent.mkdir(parents=True)
    mark.write_text(json.dumps({"host": socket.gethostname(), "pid": int(done.stdout)}))
    reader = CheckpointManager(tmp_path)
    assert torch.equal(reader.load(step=1)["model"]["w"], _state(1)["model"]["w"])


def test_a_full_disk_at_latest_leaves_the_checkpoint_committed(tmp_path: Path) -> None:
    storage = FullAtLatest(tmp_path)
    ckptkit.save(_state(1), OLD, step=1, storage=storage)
    storage.full = True
    with pytest.raises(StorageError) as info:
        ckptkit.save(_state(2), NEW, step=2, storage=storage)
    message = str(info.value)
    assert "is committed" in message and "pointer was not moved" in message and NEW in message
    assert "nothing" not in message
    listing = ckptkit.list_checkpoints(str(tmp_path))
    assert listing.latest == OLD  # the previous pointer, whole
    assert not listing.leftovers and [e.name for e in listing.checkpoints] == [OLD, NEW]
    _assert_loads(LocalStorage(tmp_path), NEW, 2)
    _assert_loads(LocalStorage(tmp_path), OLD, 1)


def test_a_full_disk_at_latest_in_the_manager_reports_the_commit(tmp_path: Path) -> None:
    storage = FullAtLatest(tmp_path)
    with CheckpointManager(tmp_path, storage=storage, sync=True) as manager:
        manager.save(1, _state(1))
        storage.full = True
        with pytest.raises(StorageError, match="is committed, but the latest pointer was not moved"):
            manager.save(2, _state(2))
        assert manager.committed_steps() == [1, 2]
        _assert_loads(storage, NEW, 2)
    assert ckptkit.list_checkpoints(str(tmp_path)).latest == OLD
