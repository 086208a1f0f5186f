"""The asynchronous checkpoint manager: staging, background commit, errors, retention, leases."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import CkptkitError, ShardedTensor, StorageError
from ckptkit.writer.manager import CheckpointManager
from ckptkit.writer.retention import Policy, plan_deletions
from ckptkit.storage import LocalStorage
from ckptkit.storage.base import Buffer


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    w = torch.randn(40, 30, generator=g)
    return {
        "model": {"w": w, "b": torch.full((30,), float(step))},
        "optimizer": {"exp_avg": {"w": [ShardedTensor(w[:20].clone(), (40, 30), (0, 0)),
                                        ShardedTensor(w[20:].clone(), (40, 30), (20, 0))]}},
        "meta": {"step": step, "note": ["a", step]},
    }


class FailingStorage(LocalStorage):
    """Local storage whose n-th write fails (ENOSPC, or another exception), after part of its data."""

    def __init__(self, root: str | os.PathLike[str], fail_write: int, exc: BaseException | None = None) -> None:
        super().__init__(root)
        self.fail_write = fail_write
        self.exc = exc or OSError(errno.ENOSPC, "No space left on device")
        self.writes = 0
        self.lock = threading.Lock()

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        with self.lock:
            self.writes += 1
            fail = self.writes == self.fail_write
        if fail:
            for _ in chunks:
                break
            raise self.exc
        return super().write(key, chunks)


def test_save_returns_after_staging_and_commits_in_the_background(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        state = _state(1)
        handle = manager.save(1, state)
        assert handle.staged.done() and handle.name == "step_00000001"
        want = {k: v.clone() for k, v in state["model"].items()}
        # Overwritten in place right after save returns: the checkpoint keeps the values at save time.
        state["model"]["w"].fill_(float("nan"))
        state["optimizer"]["exp_avg"]["w"][1].local.zero_()
        state["meta"]["note"].append("later")
        manifest = handle.committed.result(timeout=60)
        assert manifest.step == 1 and handle.background_s is not None
    loaded = ckptkit.load(str(tmp_path / "step_00000001"))
    assert torch.equal(loaded["model"]["w"], want["w"]) and torch.equal(loaded["model"]["b"], want["b"])
    assert torch.equal(loaded["optimizer"]["exp_avg"]["w"], _state(1)["model"]["w"])
    assert loaded["meta"] == {"step": 1, "note": ["a", 1]}
    assert (tmp_path / "latest").read_text().split()[0] == "step_00000001"
    assert ckptkit.verify(str(tmp_path)).ok


def test_the_buffer_pool_is_allocated_once_and_reused(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step))
        manager.wait()
        pool = manager._buffers
        assert pool.allocations == 4  # w, b and the two boxes: allocated by the first save only
        ptrs = {k: t.data_ptr() for k, t in pool.tensors.items()}
        manager.save(6, _state(6))
        assert {k: t.data_ptr() for k, t in pool.tensors.items()} == ptrs and pool.allocations == 4
        # A tensor that changes shape gets a new buffer; one that disappears is released.
        changed = _state(7)
        changed["model"]["b"] = torch.zeros(31)
        del changed["optimizer"]
        manager.save(7, changed)
    assert pool.allocations == 5 and len(pool.tensors) == 2
    for step in range(1, 8):
        got = ckptkit.load(str(tmp_path / f"step_{step:08d}"))["model"]["w"]
        assert torch.equal(got, _state(step)["model"]["w"]), step


@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("disk on fire")])
def test_a_failed_background_write_surfaces_and_commits_nothing(tmp_path: Path, exc: BaseException) -> None:
    storage = FailingStorage(tmp_path, fail_write=10**9, exc=exc)
    manager = CheckpointManager(tmp_path, storage=storage, keep_last=1)
    manager.save(1, _state(1))
    manager.wait()
    storage.fail_write = storage.writes + 2  # the second write of the next save
    handle = manager.save(2, _state(2))
    with pytest.raises(CkptkitError) as raised:
        manager.save(3, _state(3))  # the error of save 2 surfaces here; save 3 does not start
    assert "No space left" in str(raised.value) or "disk on fire" in str(raised.value)
    assert handle.committed.exception() is not None
    manager.wait()  # raised once: nothing left in flight
    # Nothing of save 2 looks committed; save 1 is intact and still latest (retention kept it).
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["latest", "step_00000001"]
    assert (tmp_path / "latest").read_text().split()[0] == "step_00000001"
    assert ckptkit.verify(str(tmp_path / "step_00000001")).ok
    manager.save(4, _state(4))
    manager.close()
    assert manager.committed_steps() == [4]
    with pytest.raises(CkptkitError, match="closed"):
        manager.save(5, _state(5))


def test_close_and_wait_raise_the_background_error(tmp_path: Path) -> None:
    storage = FailingStorage(tmp_path, fail_write=1)
    manager = CheckpointManager(tmp_path, storage=storage)
    manager.save(1, _state(1))
    with pytest.raises(StorageError, match="No space left"):
        manager.close()
    assert not (tmp_path / "latest").exists() and not list(tmp_path.glob("step_*"))


def test_one_save_in_flight_at_a_time(tmp_path: Path) -> None:
    gate = threading.Event()

    class SlowStorage(LocalStorage):
        def write(self, key: str, chunks: Iterable[Buffer]) -> int:
            gate.wait(30)
            return super().write(key, chunks)

    manager = CheckpointManager(tmp_path, storage=SlowStorage(tmp_path))
    first = manager.save(1, _state(1))
    second: list = []
    thread = threading.Thread(target=lambda: second.append(manager.save(2, _state(2))))
    thread.start()
    time.sleep(0.3)
    assert not first.committed.done() and not second  # save 2 waits for save 1
    gate.set()
    thread.join(30)
    assert first.committed.done() and second
    manager.close()
    assert manager.committed_steps() == [1, 2]


def test_bad_values_are_refused_before_anything_is_staged(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(ckptkit.LayoutError, match="tensors or JSON"):
            manager.save(1, {"model": {"w": torch.zeros(2)}, "opaque": object()})
        with pytest.raises(ckptkit.LayoutError, match="keep_last"):
            CheckpointManager(tmp_path, keep_last=0)
    assert manager.committed_steps() == []


def test_retention_policy_is_pure_and_never_deletes_latest_pinned_or_busy() -> None:
    committed = [(f"s{i}", i) for i in range(1, 11)]
    assert plan_deletions(committed, "s10", Policy()) == []  # keep everything by default
    assert plan_deletions(committed, "s10", Policy(keep_last=2)) == [f"s{i}" for i in range(1, 9)]
    assert plan_deletions(committed, "s10", Policy(keep_last=2, keep_every=4)) == ["s1", "s2", "s3", "s5", "s6", "s7"]
    assert "s3" not in plan_deletions(committed, "s10", Policy(keep_last=1, pinned=frozenset({3})))
    assert "s5" not in plan_deletions(committed, "s10", Policy(keep_last=1), busy={"s5"})
    # latest names an older checkpoint (a newer one was committed without moving it): both stay.
    kept = {name for name, _ in committed} - set(plan_deletions(committed, "s4", Policy(keep_last=1)))
    assert kept == {"s4", "s10"}
    assert plan_deletions([("only", 7)], "", Policy(keep_last=1)) == []


def test_retention_in_the_manager_with_pins_and_read_leases(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=2, keep_every=3) as manager:
        manager.pin(1)
        for step in range(1, 5):
            manager.save(step, _state(step))
        manager.wait()
        assert manager.committed_steps() == [1, 3, 4]  # 1 pinned, 3 every 3rd, 3-4 the last two
        with manager.reading(4):
            for step in range(5, 8):
                manager.save(step, _state(step))
            manager.wait()
            assert 4 in manager.committed_steps()  # being read: kept
            assert list((tmp_path / ".leases" / "step_00000004").iterdir())
        manager.unpin(1)
        loaded = manager.load(step=6)
        assert torch.equal(loaded["model"]["w"], _state(6)["model"]["w"])
        manager.save(8, _state(8))
    assert manager.committed_steps() == [3, 6, 7, 8]
    assert not list((tmp_path / ".leases").glob("*/*"))
    listing = ckptkit.list_checkpoints(str(tmp_path))
    assert not listing.leftovers and [e.step for e in listing.checkpoints] == [3, 6, 7, 8]


def test_a_lease_of_a_dead_process_does_not_hold_a_checkpoint(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    with CheckpointManager(tmp_path, keep_last=1) as manager:
        manager.save(1, _state(1))
        manager.wait()
        lease = tmp_path / ".leases" / "step_00000001" / "x"
        lease.parent.mkdir(parents=True)
        import json
        import socket

        lease.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid}))
        manager.save(2, _state(2))
    assert manager.committed_steps() == [2]


def test_sync_mode_saves_in_the_callers_thread(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, sync=True) as manager:
        handle = manager.save(1, _state(1))
        assert handle.committed.done() and handle.stall_s > 0
    storage = FailingStorage(tmp_path / "f", fail_write=1)
    (tmp_path / "f").mkdir()
    with pytest.raises(StorageError):
        CheckpointManager(tmp_path / "f", storage=storage, sync=True).save(1, _state(1))


# Imports torch and ckptkit once, then forks one saver per line of input (a root directory): each
# child prints "ready <pid>" and saves a changing state every step until it is killed.
ZYGOTE = textwrap.dedent(
    """
    import os, signal, sys
    import torch, ckptkit
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    for line in sys.stdin:
        if os.fork() == 0:
            root = line.strip()
            g = torch.Generator().manual_seed(0)
            state = {"model": {f"w{i}": torch.randn(128, 1024, generator=g) for i in range(6)}, "meta": {"step": 0}}
            with ckptkit.CheckpointManager(root, keep_last=2, max_file_bytes=700_000) as manager:
                print("ready", os.getpid(), flush=True)
                for step in range(1, 10_000):
                    for t in state["model"].values():
                        t.add_(1.0)
                    state["meta"]["step"] = step
                    manager.save(step, state)
            os._exit(0)
    """
)


@pytest.mark.slow
def test_sigkill_during_background_writes_leaves_latest_verifiable(tmp_path: Path) -> None:
    rng = random.Random(1234)
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert zygote.stdin is not None and zygote.stdout is not None
    committed = 0
    try:
        for trial in range(20):
            root = tmp_path / f"run{trial}"
            zygote.stdin.write(f"{root}\n")
            zygote.stdin.flush()
            word, pid = zygote.stdout.readline().split()
            assert word == "ready"
            time.sleep(rng.uniform(0.05, 1.2))
            os.kill(int(pid), signal.SIGKILL)
            latest = root / "latest"
            if not latest.exists():
                continue  # killed before the first commit: nothing claims to be committed
            committed += 1
            name = latest.read_text().split()[0]
            report = ckptkit.verify(str(root / name))
            assert report.ok, (trial, name, [str(f) for f in report.findings])
            step = ckptkit.read_manifest(str(root / name)).step
            want = torch.randn(128, 1024, generator=torch.Generator().manual_seed(0))
            for _ in range(step):
                want.add_(1.0)
            assert torch.equal(ckptkit.load(str(root / name))["model"]["w0"], want), trial  # the state of that step
    finally:
        zygote.kill()
        zygote.wait()
    assert committed >= 10  # most kills land after some commits, during later background writes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_tensors_are_staged_through_pinned_memory_on_a_side_stream(tmp_path: Path) -> None:
    w = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    want = w.cpu()
    with CheckpointManager(tmp_path) as manager:
        handle = manager.save(1, {"model": {"w": w}})
        w.mul_(0)  # on the current stream: ordered after the side stream's copy
        handle.staged.result(timeout=60)
        assert all(t.is_pinned() for t in manager._buffers.tensors.values())
    assert torch.equal(ckptkit.load(str(tmp_path / "step_00000001"))["model"]["w"], want)


def test_a_retention_failure_warns_and_does_not_fail_the_committed_save(tmp_path: Path) -> None:
    class NoListing(LocalStorage):
        def list(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
            raise StorageError("listing refused")

    with CheckpointManager(tmp_path, storage=NoListing(tmp_path), keep_last=1) as manager:
        with pytest.warns(UserWarning, match="retention after a commit failed"):  # from the background thread
            handle = manager.save(1, _state(1))
            manager.wait()
        assert handle.committed.result().step == 1
        with pytest.raises(ckptkit.CheckpointNotFoundError):
            with manager.reading(7):
                pass
    with pytest.raises(ckptkit.CheckpointNotFoundError, match="no latest"):
        with CheckpointManager(tmp_path / "empty").reading():
            pass
