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


# About half a second of GPU time (torch.cuda._sleep spins this many clock cycles): queued on a
# stream before a write, it holds the write back long after a copy that does not wait for it.
SLEEP_CYCLES = 1_000_000_000


def _saved_then_changed(tmp_path: Path, snapshot: str) -> tuple[dict, CheckpointManager, object]:
    state = _state()
    want = {"w": state["model"]["w"].cpu() * 2, "m": torch.cat([p.local for p in state["optimizer"]["m"]]).cpu() * 2}
    # "b" is allocated on another stream, so that the current stream's waits do not order its
    # memory's reuse there: only record_stream keeps that reuse after the snapshot's copy.
    other = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(other):
        state["model"]["b"] = torch.arange(1000, dtype=torch.float32, device="cuda")
    torch.cuda.current_stream().wait_stream(other)
    manager = CheckpointManager(tmp_path, snapshot=snapshot)
    # Written on the current stream after a long delay, just before save: the snapshot must
    # wait for these writes (exact: doubling).
    torch.cuda._sleep(SLEEP_CYCLES)
    state["model"]["w"].mul_(2)
    for piece in state["optimizer"]["m"]:
        piece.local.mul_(2)
    handle = manager.save(1, state)
    # Changed in place on the current stream right after save returns, and a source freed and
    # its memory reused at once on the stream it was allocated on (which never waited for the
    # snapshot, still queued behind the delay): neither may reach the checkpoint.
    state["model"]["w"].fill_(float("nan"))
    for piece in state["optimizer"]["m"]:
        piece.local.zero_()
    del state["model"]["b"]
    with torch.cuda.stream(other):
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


def test_pinned_host_buffers_are_packed_into_power_of_two_arenas_counted_whole(tmp_path: Path) -> None:
    state = _state()
    state["model"]["e"] = torch.zeros(0, 3, device="cuda")  # an empty CUDA piece: no bytes to pin
    cuda_bytes = sum(t.numel() * t.element_size() for t in (state["model"]["w"], state["model"]["b"]))
    cuda_bytes += sum(p.local.numel() * 4 for p in state["optimizer"]["m"])
    with CheckpointManager(tmp_path, snapshot="host") as manager:
        manager.save(1, state)
        manager.wait()
        pool = manager._buffers
        allocations = pool.allocations
        arenas = sum(a.numel() for a in pool.arenas)
        assert all(n & (n - 1) == 0 for n in (a.numel() for a in pool.arenas)) and all(a.is_pinned() for a in pool.arenas)
        assert cuda_bytes <= arenas < 2 * cuda_bytes
        assert manager.host_buffer_bytes == arenas + 10 * 4  # the arenas whole, and the CPU tensor's buffer
        assert all(t.is_pinned() for key, t in pool.tensors.items() if key[0] not in ("cpu", "model/e"))
        state["model"]["w"].add_(1)
        manager.save(2, state)
        manager.wait()
        assert pool.allocations == allocations  # the arenas, the empty piece's buffer too, are reused
    loaded = ckptkit.load(str(tmp_path / "step_00000002"))
    assert torch.equal(loaded["model"]["w"], state["model"]["w"].cpu()) and loaded["model"]["e"].shape == (0, 3)
    assert torch.equal(loaded["optimizer"]["m"], torch.cat([p.local for p in state["optimizer"]["m"]]).cpu())


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@two_gpus
@pytest.mark.parametrize("snapshot", ["host", "device"])
def test_a_state_on_another_device_than_the_current_one_is_snapshotted_whole(tmp_path: Path, snapshot: str) -> None:
    cuda1 = torch.device("cuda", 1)
    with torch.cuda.device(0):  # the current device, where no tensor of the state is
        with torch.cuda.device(1):  # on cuda:1's current stream, a long delay then the values
            w = torch.zeros(N, device=cuda1)
            torch.cuda._sleep(SLEEP_CYCLES)
            w.fill_(3.0)
        with CheckpointManager(tmp_path, snapshot=snapshot) as manager:
            handle = manager.save(1, {"model": {"w": w}})
            with torch.cuda.device(1):
                w.fill_(float("nan"))  # after save returns, on cuda:1's current stream
            handle.committed.result(timeout=120)
            assert handle.snapshot.kind == snapshot
            assert torch.cuda.current_device() == 0
    assert torch.equal(ckptkit.load(str(tmp_path / "step_00000001"))["model"]["w"], torch.full((N,), 3.0))


@two_gpus
def test_a_host_snapshot_of_a_state_on_two_devices_waits_for_both(tmp_path: Path) -> None:
    parts = []
    for index in (0, 1):
        with torch.cuda.device(index):
            part = torch.zeros(N, device=f"cuda:{index}")
            torch.cuda._sleep(SLEEP_CYCLES // (1 + index))
            part.fill_(index + 1.0)
            parts.append(part)
    with CheckpointManager(tmp_path, snapshot="auto") as manager:
        handle = manager.save(1, {"model": {"a": parts[0], "b": parts[1]}})
        for part in parts:
            with torch.cuda.device(part.device):
                part.zero_()
        handle.committed.result(timeout=120)
        assert handle.snapshot.kind == "host" and "2 devices" in handle.snapshot.reason
    loaded = ckptkit.load(str(tmp_path / "step_00000001"))["model"]
    assert torch.equal(loaded["a"], torch.full((N,), 1.0)) and torch.equal(loaded["b"], torch.full((N,), 2.0))
