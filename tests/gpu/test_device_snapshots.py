"""CheckpointManager's device and host snapshots of CUDA tensors (need a CUDA device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import CkptkitError, ShardedTensor
from ckptkit.writer.manager import CheckpointManager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

N = 1 << 22  # 16 MiB of fp32 per tensor


def _state() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(N, device="cuda", generator=gen)
    return {
        "model": {"w": w.to(torch.bfloat16), "b": torch.arange(1000, dtype=torch.float32, device="cuda")},
        "optimizer": {"m": [ShardedTensor(w[: N // 2].clone(), (N,), (0,)), ShardedTensor(w[N // 2 :].clone(), (N,), (N // 2,))]},
        "cpu": torch.ones(10),
    }


def _busy() -> None:
    """Queue a few hundred milliseconds of work on the current stream, so that a copy ordered
    wrongly against it would see the values changed after it."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        a = a @ a
        a /= a.norm()


def _saved_then_changed(tmp_path: Path, snapshot: str) -> tuple[dict, CheckpointManager, object]:
    state = _state()
    want = {"w": state["model"]["w"].cpu(), "m": torch.cat([p.local for p in state["optimizer"]["m"]]).cpu()}
    manager = CheckpointManager(tmp_path, snapshot=snapshot)
    _busy()
    handle = manager.save(1, state)
    # Changed in place on the current stream right after save returns, and a source freed and
    # its memory reused: neither may reach the checkpoint.
    state["model"]["w"].fill_(float("nan"))
    for piece in state["optimizer"]["m"]:
        piece.local.zero_()
    del state["model"]["b"]
    torch.full((1000,), -1.0, device="cuda")
    handle.committed.result(timeout=120)
    manager.close()
    return want, manager, handle


@pytest.mark.parametrize("snapshot", ["device", "host", "auto"])
def test_tensors_changed_right_after_save_do_not_leak_into_the_checkpoint(tmp_path: Path, snapshot: str) -> None:
    want, manager, handle = _saved_then_changed(tmp_path, snapshot)
    assert handle.snapshot.kind == ("host" if snapshot == "host" else "device")  # a small state fits on any GPU
    loaded = ckptkit.load(str(tmp_path / "step_00000001"))
    assert torch.equal(loaded["model"]["w"], want["w"]) and torch.equal(loaded["optimizer"]["m"], want["m"])
    assert torch.equal(loaded["model"]["b"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(loaded["cpu"], torch.ones(10))
    assert ckptkit.verify(str(tmp_path)).ok


def test_a_device_snapshot_reuses_its_gpu_buffers_and_pinned_host_buffers(tmp_path: Path) -> None:
    state = _state()
    cuda_bytes = sum(t.numel() * t.element_size() for t in (state["model"]["w"], state["model"]["b"]))
    cuda_bytes += sum(p.local.numel() * 4 for p in state["optimizer"]["m"])
    with CheckpointManager(tmp_path, snapshot="device") as manager:
        manager.save(1, state)
        manager.wait()
        allocations = manager._device_buffers.allocations
        assert manager.device_buffer_bytes == cuda_bytes == manager.snapshot_choice.device_bytes
        assert all(t.device.type == "cuda" for t in manager._device_buffers.tensors.values())
        assert all(t.is_pinned() for key, t in manager._buffers.tensors.items() if key[0] != "cpu")
        state["model"]["w"].add_(1)
        manager.save(2, state)
        manager.wait()
        assert manager._device_buffers.allocations == allocations
    assert torch.equal(ckptkit.load(str(tmp_path / "step_00000002"))["model"]["w"], state["model"]["w"].cpu())


def test_device_refuses_a_state_over_max_device_bytes_before_anything_is_written(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, snapshot="device", max_device_bytes=1 << 20) as manager:
        with pytest.raises(CkptkitError, match="max_device_bytes") as caught:
            manager.save(1, _state())
        assert "\n" not in str(caught.value)
        assert manager.device_buffer_bytes == 0
    assert not (tmp_path / "latest").exists() and not list(tmp_path.glob("step_*"))


def test_auto_falls_back_to_host_over_max_device_bytes_and_says_so(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, snapshot="auto", max_device_bytes=1 << 20) as manager:
        handle = manager.save(1, _state())
        manager.wait()
        assert handle.snapshot.kind == "host" and "max_device_bytes" in handle.snapshot.reason
        assert manager.device_buffer_bytes == 0
    assert ckptkit.verify(str(tmp_path)).ok


def test_a_host_snapshot_after_device_ones_gives_the_gpu_buffers_back(tmp_path: Path) -> None:
    state = _state()
    with CheckpointManager(tmp_path, snapshot="auto") as manager:
        manager.save(1, state)
        manager.wait()
        assert manager.device_buffer_bytes > 0
        manager.max_device_bytes = 0
        handle = manager.save(2, state)
        manager.wait()
        assert handle.snapshot.kind == "host" and manager.device_buffer_bytes == 0
