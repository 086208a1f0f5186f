"""Snapshot kinds of the manager's saves: the choice (pure), the buffer pools, and what a save
with CPU tensors does whatever `snapshot` says."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import CkptkitError, ShardedTensor
from ckptkit.writer.manager import CheckpointManager
from ckptkit.writer.snapshot import DEVICE_MARGIN, BufferPool, DeviceMemory, choose_snapshot

GB = 10**9
ROOMY = DeviceMemory(free=100 * GB, total=140 * GB)


def test_a_state_without_cuda_tensors_is_always_a_host_snapshot() -> None:
    for requested in ("auto", "device", "host"):
        choice = choose_snapshot(requested, cuda_bytes=0, memory=None)
        assert choice.kind == "host" and "CPU tensors" in choice.reason and choice.device_bytes == 0


def test_host_is_chosen_when_asked_even_if_the_gpu_has_room() -> None:
    choice = choose_snapshot("host", cuda_bytes=8 * GB, memory=ROOMY)
    assert (choice.kind, choice.cuda_bytes, choice.device_bytes) == ("host", 8 * GB, 0)


@pytest.mark.parametrize("requested", ["auto", "device"])
def test_a_state_that_fits_takes_a_device_snapshot_of_its_size(requested: str) -> None:
    choice = choose_snapshot(requested, cuda_bytes=8 * GB, memory=ROOMY)
    assert (choice.kind, choice.device_bytes) == ("device", 8 * GB)
    assert "8.00 GB" in choice.reason


def test_auto_falls_back_to_host_over_max_device_bytes_and_device_refuses_in_one_line() -> None:
    choice = choose_snapshot("auto", cuda_bytes=8 * GB, memory=ROOMY, max_device_bytes=4 * GB)
    assert choice.kind == "host" and "max_device_bytes" in choice.reason and choice.device_bytes == 0
    with pytest.raises(CkptkitError, match="max_device_bytes") as caught:
        choose_snapshot("device", cuda_bytes=8 * GB, memory=ROOMY, max_device_bytes=4 * GB)
    assert "\n" not in str(caught.value) and "nothing was saved" in str(caught.value)


def test_the_free_memory_less_the_margin_bounds_the_new_buffers_and_reused_ones_count_as_room() -> None:
    memory = DeviceMemory(free=10 * GB, total=100 * GB)
    room = memory.free - int(memory.total * DEVICE_MARGIN)  # 5 GB
    assert choose_snapshot("auto", cuda_bytes=room, memory=memory).kind == "device"
    assert choose_snapshot("auto", cuda_bytes=room + 1, memory=memory).kind == "host"
    # A pool holding 3 GB of the right buffers needs only the rest.
    assert choose_snapshot("auto", cuda_bytes=room + 3 * GB, reusable_bytes=3 * GB, memory=memory).kind == "device"
    with pytest.raises(CkptkitError, match="GPU buffers need"):
        choose_snapshot("device", cuda_bytes=room + 1, memory=memory)


def test_a_state_on_several_devices_is_not_a_device_snapshot() -> None:
    assert choose_snapshot("auto", cuda_bytes=GB, memory=ROOMY, devices=2).kind == "host"
    with pytest.raises(CkptkitError, match="2 devices"):
        choose_snapshot("device", cuda_bytes=GB, memory=ROOMY, devices=2)


def test_buffer_pools_reuse_matching_buffers_and_count_what_they_hold() -> None:
    for pool in (BufferPool(), BufferPool(on_device=True)):
        a, b = torch.zeros(4, 8), torch.zeros(16, dtype=torch.bfloat16)
        first = pool.get(("a", 0), a)
        assert pool.get(("a", 0), a.clone()) is first and pool.allocations == 1
        pool.get(("b", 0), b)
        assert pool.held_bytes() == 4 * 8 * 4 + 16 * 2
        assert pool.reusable_bytes([(("a", 0), a), (("b", 0), b.float())]) == 4 * 8 * 4  # b changed dtype
        assert pool.get(("a", 0), torch.zeros(8, 4)) is not first and pool.allocations == 3
        pool.retain({("b", 0)})
        assert list(pool.tensors) == [("b", 0)] and pool.held_bytes() == 32


def test_unknown_snapshot_kinds_and_negative_limits_are_refused_before_anything_is_made(tmp_path: Path) -> None:
    with pytest.raises(CkptkitError, match="snapshot must be one of auto, device, host"):
        CheckpointManager(tmp_path / "a", snapshot="gpu")
    with pytest.raises(CkptkitError, match="max_device_bytes"):
        CheckpointManager(tmp_path / "b", snapshot="auto", max_device_bytes=-1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("snapshot", ["auto", "device", "host"])
def test_cpu_tensors_take_host_snapshots_and_later_changes_do_not_leak(
    tmp_path: Path, snapshot: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    state = {"model": {"w": w, "pieces": [ShardedTensor(w[:32].clone(), (64, 32), (0, 0)),
                                          ShardedTensor(w[32:].clone(), (64, 32), (32, 0))]}}
    want = w.clone()
    with caplog.at_level(logging.INFO, logger="ckptkit.writer.manager"):
        with CheckpointManager(tmp_path, snapshot=snapshot, max_device_bytes=0) as manager:
            handle = manager.save(1, state)
            w.fill_(float("nan"))  # changed in place right after save returns
            state["model"]["pieces"][1].local.zero_()
            handle.committed.result(timeout=60)
            assert handle.snapshot is not None and handle.snapshot.kind == "host"
            assert manager.snapshot_choice == handle.snapshot
            assert manager.device_buffer_bytes == 0 and manager.host_buffer_bytes == 2 * 64 * 32 * 4  # w and its two halves
    assert any("host snapshots" in r.getMessage() for r in caplog.records)
    loaded = ckptkit.load(str(tmp_path / "step_00000001"))
    assert torch.equal(loaded["model"]["w"], want) and torch.equal(loaded["model"]["pieces"], want)
