"""Snapshot kinds of the manager's saves: the choice (pure), the buffer pools, and what a save
with CPU tensors does whatever `snapshot` says."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit import CkptkitError, ShardedTensor
from ckptkit.state.device import SideStreams, by_device
from ckptkit.writer.manager import CheckpointManager
from ckptkit.writer.snapshot import (
    DEVICE_MARGIN, BufferPool, DeviceMemory, choose_snapshot, copy_to_device, copy_to_host, plan_arenas, pow2_ceil,
)

from ..cuda_fakes import FakeCuda, FakeTensor

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


def test_pinned_arenas_are_few_powers_of_two_holding_every_piece_aligned_and_apart() -> None:
    sizes = [3000, 0, 1 << 20, 5, (1 << 20) + 1, 70_000, 0, 64]
    arenas, where = plan_arenas(sizes, min_arena=4 << 20)
    assert all(n & (n - 1) == 0 for n in arenas) and len(arenas) == 1
    assert where[1] == where[6] == (-1, 0)  # empty pieces take no arena
    spans = sorted((where[i][1], where[i][1] + n) for i, n in enumerate(sizes) if n)
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])) and spans[-1][1] <= arenas[0]
    assert plan_arenas([]) == ([], []) and plan_arenas([0, 0]) == ([], [(-1, 0), (-1, 0)])
    # Pieces over the arena size get arenas of the power of two above the largest.
    arenas, where = plan_arenas([5 << 20, 5 << 20, 1 << 20], min_arena=1 << 20)
    assert arenas == [8 << 20, 8 << 20] and where == [(0, 0), (1, 0), (0, 5 << 20)]


def test_pinned_arenas_of_the_benchmark_state_pin_little_more_than_its_bytes() -> None:
    from benchmarks.gpu_state import BYTES_PER_PARAM, DEFAULT_BYTES, llama_for

    model = llama_for(DEFAULT_BYTES)
    sizes = [n * 2 if i == 0 else n * 4 for _, shape in model.parameters() for i in range(4)
             for n in [int(torch.Size(shape).numel())]]
    nominal = sum(sizes)
    assert nominal == model.parameter_count() * BYTES_PER_PARAM
    arenas, _ = plan_arenas(sizes)
    per_piece = sum(pow2_ceil(n) for n in sizes)  # one pinned buffer per piece
    assert sum(arenas) <= 1.02 * nominal < per_piece
    assert len(arenas) <= nominal // (64 << 20) + 2


def test_sources_are_grouped_by_their_device_in_first_seen_order() -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    items = [("a", cuda1), ("b", cuda0), ("c", cuda1), ("d", cuda0)]
    groups = by_device(items, lambda item: item[1])
    assert list(groups) == [cuda1, cuda0]
    assert [[name for name, _ in g] for g in groups.values()] == [["a", "c"], ["b", "d"]]


def test_a_host_snapshot_copies_each_device_on_its_own_side_stream_after_its_current_stream(fake_cuda: FakeCuda) -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    host = torch.device("cpu")
    pairs = [(FakeTensor(fake_cuda, f"h{n}", host), FakeTensor(fake_cuda, n, d)) for n, d in (("a", cuda1), ("b", cuda0), ("c", cuda1))]
    streams = SideStreams()
    ready = copy_to_host(streams, pairs)
    side0, side1 = streams.streams[cuda0], streams.streams[cuda1]
    caller0, caller1 = fake_cuda.current[cuda0], fake_cuda.current[cuda1]
    assert (side0.device, side1.device) == (cuda0, cuda1)
    assert [e for e in fake_cuda.log if e[0] == "copy"] == [
        ("copy", "a", cuda1, side1), ("copy", "c", cuda1, side1), ("copy", "b", cuda0, side0),
    ]
    log = fake_cuda.log
    for side, caller in ((side0, caller0), (side1, caller1)):
        first = next(i for i, e in enumerate(log) if e[0] == "copy" and e[3] is side)
        last = max(i for i, e in enumerate(log) if e[0] == "copy" and e[3] is side)
        assert log.index(("wait", side, caller)) < first  # the side stream waits for the caller's stream first
        assert log.index(("record", side)) > last  # one event per device, after its copies
        assert log.index(("wait", caller, side)) > last  # and the caller's stream waits for them
        assert ("record_stream", "a" if side is side1 else "b", side) in log
    assert fake_cuda.device == cuda0 and fake_cuda.current == {cuda0: caller0, cuda1: caller1}  # all restored
    fake_cuda.log.clear()
    ready.wait_on_host()
    assert sorted(map(repr, fake_cuda.log)) == sorted(map(repr, [("sync", side1), ("sync", side0)]))


def test_a_device_snapshot_allocates_then_copies_and_drains_each_device_on_its_side_stream(fake_cuda: FakeCuda) -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    host = torch.device("cpu")

    class Pool(BufferPool):
        def get(self, key: Any, like: Any) -> Any:
            fake_cuda.log.append(("alloc", key, fake_cuda.device, fake_cuda.current_stream()))
            return FakeTensor(fake_cuda, f"g{key[0]}", like.device)

    copies = [((n, 0), FakeTensor(fake_cuda, f"h{n}", host), FakeTensor(fake_cuda, n, d)) for n, d in (("a", cuda1), ("b", cuda0))]
    streams = SideStreams()
    ready = copy_to_device(streams, Pool(on_device=True), copies)
    side0, side1 = streams.streams[cuda0], streams.streams[cuda1]
    log = fake_cuda.log
    assert [e for e in log if e[0] == "alloc"] == [("alloc", ("a", 0), cuda1, side1), ("alloc", ("b", 0), cuda0, side0)]
    assert max(i for i, e in enumerate(log) if e[0] == "alloc") < min(i for i, e in enumerate(log) if e[0] == "copy")
    assert [e for e in log if e[0] == "copy"] == [("copy", "a", cuda1, side1), ("copy", "b", cuda0, side0)]
    caller0, caller1 = fake_cuda.current[cuda0], fake_cuda.current[cuda1]
    assert [e[1:] for e in log if e[0] == "wait"] == [(side1, caller1), (caller1, side1), (side0, caller0), (caller0, side0)]
    log.clear()
    ready.wait_staged()
    ready.wait_on_host()
    drains = [e for e in log if e[0] == "copy"]
    assert drains == [("copy", "ga", cuda1, side1), ("copy", "gb", cuda0, side0)]
    assert log[-2:] == [("sync", side1), ("sync", side0)]


def test_arranged_buffers_are_disjoint_views_of_the_arenas_kept_while_the_layout_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # no pinning without CUDA
    likes = {("w", 0): torch.zeros(33, 7, dtype=torch.bfloat16), ("s", 0): torch.zeros((), dtype=torch.float64),
             ("m", 0): torch.zeros(5, 3, dtype=torch.bool), ("e", 0): torch.zeros(0, 4), ("i", 1): torch.zeros(100, dtype=torch.int64)}
    pool = BufferPool()
    pool.arrange(list(likes.items()))
    assert len(pool.arenas) == 1 and pool.arenas[0].numel() == 2048  # 33*7*2, 8, 15, 800 bytes at 64-byte offsets
    assert pool.held_bytes() == 2048 and pool.allocations == 1
    for key, like in likes.items():
        buf = pool.tensors[key]
        assert (buf.shape, buf.dtype) == (like.shape, like.dtype) and buf.is_contiguous()
    for key, like in likes.items():
        pool.tensors[key].fill_(len(key[0]) + key[1] + 1 if like.dtype != torch.bool else True)
    assert pool.tensors[("w", 0)].eq(2).all() and pool.tensors[("i", 1)].eq(3).all() and pool.tensors[("s", 0)].item() == 2
    pool.arrange([(k, t.clone()) for k, t in likes.items()])
    assert pool.allocations == 1  # same keys, shapes and dtypes: kept
    pool.arrange([(("w", 0), likes[("w", 0)])])
    assert pool.allocations == 2 and set(pool.tensors) == {("w", 0)} and pool.arenas[0].numel() == 512
    pool.arrange([])
    assert pool.arenas == [] and pool.tensors == {} and pool.held_bytes() == 0
