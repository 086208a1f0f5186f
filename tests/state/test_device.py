"""The device machinery's logic (chunking, packing, the bounce pool, ordering), driven on the CPU:
CPU tensors moved through a small pool give the bytes of a normal load or save, bitwise."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.boxes import Box, full_box
from ckptkit.errors import LayoutError
from ckptkit.io.read import Reader
from ckptkit.state.device import (
    ALIGN, BouncePool, SideStreams, chunk_box, device_problems, load_through, pack, side_copy, staged_bytes,
)
from ckptkit.state.torch_io import byte_view
from ckptkit.storage import MemoryStorage

from ..cuda_fakes import FakeCuda, FakeTensor


def _flat_indices(shape: tuple[int, ...], box: Box) -> list[int]:
    grid = np.arange(math.prod(shape)).reshape(shape)
    return grid[box.slices()].reshape(-1).tolist()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=0, max_size=4), st.sampled_from([1, 2, 4, 8]), st.integers(8, 200))
def test_chunks_tile_the_box_in_row_major_order_each_within_the_limit(shape: list[int], size: int, limit: int) -> None:
    box = full_box(tuple(shape))
    chunks = chunk_box(box, size, limit)
    assert all(c.volume * size <= limit or c.volume == 1 for c in chunks)
    assert all(c.volume * size <= limit for c in chunks)
    order = [i for c in chunks for i in _flat_indices(tuple(shape), c)]
    assert order == list(range(math.prod(shape)))


def test_a_box_that_fits_is_one_chunk_and_rows_too_large_are_cut_along_the_next_dim() -> None:
    box = Box((2, 0), (3, 10))
    assert chunk_box(box, 4, 1000) == [box]
    assert chunk_box(box, 4, 80) == [Box((2, 0), (2, 10)), Box((4, 0), (1, 10))]
    assert chunk_box(box, 4, 24)[:2] == [Box((2, 0), (1, 6)), Box((2, 6), (1, 4))]


def test_batches_fit_one_buffer_with_aligned_chunks_that_do_not_overlap() -> None:
    items = [(full_box((3, 5)), 4), (full_box((0, 4)), 4), (full_box(()), 8), (full_box((40,)), 2), (full_box((7,)), 1)]
    batches = pack(items, 128)
    assert {c.item for b in batches for c in b} == {0, 2, 3, 4}  # the empty item has no chunk
    for batch in batches:
        assert batch[-1].offset + batch[-1].nbytes <= 128
        assert all(c.offset % ALIGN == 0 for c in batch)
        assert all(a.offset + a.nbytes <= b.offset for a, b in zip(batch, batch[1:]))
    moved = {i: sum(c.nbytes for b in batches for c in b if c.item == i) for i in range(len(items))}
    assert moved == {0: 60, 1: 0, 2: 8, 3: 80, 4: 7}


def _bits(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t.contiguous()))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(37, 11, generator=g),
        "b": torch.randn(300, generator=g).to(torch.bfloat16),
        "m": torch.rand(5, 3, 7, generator=g) > 0.5,
        "s": torch.tensor(3.5, dtype=torch.float64),
        "e": torch.zeros(0, 4),
        "i": torch.arange(1000, dtype=torch.int64).reshape(10, 100),
    }


def _saved() -> tuple[MemoryStorage, Reader, dict[str, torch.Tensor]]:
    state = _state()
    pieces = [ShardedTensor(state["w"][a:b].clone(), (37, 11), (a, 0)) for a, b in ((0, 9), (9, 30), (30, 37))]
    store = MemoryStorage()
    ckptkit.save({"model": {**state, "w": pieces}}, "ck", step=1, storage=store)
    ck = ckptkit.open("ck", storage=store)
    return store, Reader(ck.location, ck.manifest), state


def _targets(state: dict[str, torch.Tensor]) -> list[tuple[str, ShardedTensor]]:
    out = [(f"model/{k}", ShardedTensor(torch.zeros_like(v), tuple(v.shape), (0,) * v.dim())) for k, v in state.items()]
    transposed = torch.zeros(11, 37).t()  # a non-contiguous target, resharded: rows 5 to 25
    out.append(("model/w", ShardedTensor(transposed[5:25], (37, 11), (5, 0))))
    out.append(("model/i", ShardedTensor(torch.zeros(4, 30, dtype=torch.int64), (10, 100), (3, 60))))
    return out


def test_loading_through_a_small_pool_fills_every_box_resharded() -> None:
    store, reader, state = _saved()
    targets = _targets(state)
    pool = BouncePool(1024, buffers=4, pinned=False)
    load_through(reader, targets, pool)
    assert pool.handed_out > 20  # the pool was reused, many chunks through few buffers
    assert pool.peak_bytes <= 1024
    for fqn, piece in targets:
        assert _bits(piece.local) == _bits(state[fqn.split("/")[1]][piece.box.slices()]), fqn


def test_a_pool_loaded_tensor_equals_a_normal_load_bitwise() -> None:
    store, reader, state = _saved()
    whole = ckptkit.load("ck", storage=store)["model"]
    targets = [(f"model/{k}", ShardedTensor(torch.empty_like(v), tuple(v.shape), (0,) * v.dim())) for k, v in state.items()]
    load_through(reader, targets, BouncePool(512, buffers=2, pinned=False))
    for fqn, piece in targets:
        ref = whole[fqn.split("/")[1]]
        assert _bits(piece.local) == _bits(ref), fqn


def test_staged_bytes_are_the_tensors_bytes_in_order_within_the_pool() -> None:
    state = _state()
    tensors = [*state.values(), state["w"].t(), torch.arange(64, dtype=torch.int32).reshape(2, 32)[:, ::2]]
    pool = BouncePool(512, buffers=2, pinned=False)
    out = b"".join(bytes(v) for v in staged_bytes(tensors, pool, staged=lambda t: True))
    assert out == b"".join(bytes(byte_view(t.contiguous())) for t in tensors)
    assert pool.handed_out > 10
    assert pool.peak_bytes <= 512


def test_only_the_picked_tensors_go_through_the_pool() -> None:
    tensors = [torch.ones(100), torch.arange(10.0)]
    pool = BouncePool(1024, pinned=False)
    out = list(staged_bytes(tensors, pool, staged=lambda t: t.numel() == 10))
    assert b"".join(bytes(v) for v in out) == bytes(byte_view(tensors[0])) + bytes(byte_view(tensors[1]))
    assert pool.handed_out == 1


def test_writers_sharing_a_pool_each_get_their_own_bytes() -> None:
    pool = BouncePool(1024, buffers=2, pinned=False)
    sources = [[torch.arange(n * 300, n * 300 + 300, dtype=torch.float32) for n in range(k, k + 3)] for k in (0, 10, 20)]
    results: dict[int, bytes] = {}

    def write(k: int) -> None:
        results[k] = b"".join(bytes(v) for v in staged_bytes(sources[k], pool, staged=lambda t: True))

    threads = [threading.Thread(target=write, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {k: b"".join(bytes(byte_view(t)) for t in ts) for k, ts in enumerate(sources)}
    assert pool.peak_bytes <= 1024


def test_a_pool_too_small_for_its_buffers_is_refused() -> None:
    with pytest.raises(LayoutError, match="pinned_bytes=100"):
        BouncePool(100, buffers=4, pinned=False)


def test_cpu_and_cuda_are_the_devices_and_cuda_needs_cuda() -> None:
    assert device_problems([("a", torch.device("cpu"))]) == []
    [meta] = device_problems([("model/w", torch.device("meta")), ("model/w", torch.device("meta"))])
    assert "model/w" in meta and "meta" in meta
    cuda = device_problems([("model/b", torch.device("cuda", 0))])
    if torch.cuda.is_available():
        assert cuda == []
    else:
        assert len(cuda) == 1 and "model/b" in cuda[0] and "cuda:0" in cuda[0] and "not available" in cuda[0]


def test_loading_into_a_meta_tensor_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    ckptkit.save({"model": {"w": torch.ones(4, 4), "b": torch.ones(4)}}, tmp_path / "ck", step=1)
    target = {"model": {"w": torch.empty(4, 4, device="meta"), "b": torch.zeros(4)}}
    with pytest.raises(LayoutError) as err:
        ckptkit.load(tmp_path / "ck", target)
    assert "model/w" in str(err.value) and "device meta" in str(err.value) and "\n" not in str(err.value)
    assert torch.equal(target["model"]["b"], torch.zeros(4))  # nothing was loaded
    sharded = {"model": {"w": ShardedTensor(torch.empty(2, 4, device="meta"), (4, 4), (2, 0)), "b": torch.zeros(4)}}
    with pytest.raises(LayoutError, match="model/w: on device meta"):
        ckptkit.load(tmp_path / "ck", sharded)


def test_saving_a_meta_tensor_is_refused_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    with pytest.raises(LayoutError) as err:
        ckptkit.save({"model": {"w": torch.empty(3, device="meta"), "b": torch.ones(2)}}, tmp_path / "ck", step=1)
    assert "model/w" in str(err.value) and "device meta" in str(err.value) and "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_buffers_are_a_power_of_two_within_the_pool_and_no_larger_than_needed() -> None:
    assert BouncePool(pinned=False).buffer_bytes == 256 << 20
    assert BouncePool(100 << 20, pinned=False).buffer_bytes == 16 << 20
    assert BouncePool(1 << 30, moving=10**6, pinned=False).buffer_bytes == 1 << 18
    assert BouncePool(1 << 30, moving=1000, pinned=False).buffer_bytes == 256
    pool = BouncePool(1 << 12, buffers=4, pinned=False)
    held = [pool.acquire(1000) for _ in range(4)]
    assert pool.acquire(1000, wait=False) is None  # all four in use: no fifth buffer
    assert pool.allocated_bytes == pool.peak_bytes == 4 << 10
    pool.release(held[2])
    assert pool.acquire(10) is held[2]


def test_parameters_are_loaded_into_through_the_pool_and_directly_and_stay_leaves(tmp_path: Path) -> None:
    store, reader, state = _saved()
    params = [("model/w", ShardedTensor(torch.nn.Parameter(torch.zeros(11, 37).t()[5:25]), (37, 11), (5, 0))),
              ("model/b", ShardedTensor(torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16)), (300,), (0,)))]
    load_through(reader, params, BouncePool(512, buffers=2, pinned=False))
    ckptkit.save({"w": state["w"]}, tmp_path / "ck", step=1)
    direct = torch.nn.Parameter(torch.zeros(11, 37).t())  # non-contiguous: read into a buffer, then copied
    ckptkit.load(tmp_path / "ck", {"w": direct})
    for (fqn, piece), param in zip(params, (params[0][1].local, params[1][1].local)):
        assert _bits(piece.local.detach()) == _bits(state[fqn.split("/")[1]][piece.box.slices()]), fqn
        assert param.is_leaf and param.requires_grad and param.grad_fn is None
    assert _bits(direct.detach()) == _bits(state["w"]) and direct.is_leaf and direct.requires_grad


def test_side_copies_copy_host_pairs_at_once_and_issue_none_on_a_device() -> None:
    dest, src = torch.nn.Parameter(torch.zeros(3)), torch.arange(3.0)
    assert side_copy(SideStreams(), [(dest[1:], src[1:]), (torch.zeros(2), torch.ones(2))]) == []
    assert dest.tolist() == [0.0, 1.0, 2.0] and dest.is_leaf


@pytest.mark.parametrize("ordered", [False, True])
def test_side_copies_run_per_device_on_its_side_stream_ordered_as_asked(fake_cuda: FakeCuda, ordered: bool) -> None:
    cuda0, cuda1, host = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    pairs = [(FakeTensor(fake_cuda, "d1", cuda1), FakeTensor(fake_cuda, "h1", host)),  # host to cuda:1
             (FakeTensor(fake_cuda, "h0", host), FakeTensor(fake_cuda, "s0", cuda0)),  # cuda:0 to host
             (FakeTensor(fake_cuda, "e1", cuda1), FakeTensor(fake_cuda, "f1", cuda1))]  # on cuda:1
    streams = SideStreams()
    issued = side_copy(streams, pairs, follow=ordered, hold=ordered, keep_sources=ordered)
    side0, side1 = streams.streams[cuda0], streams.streams[cuda1]
    assert [(c.device, c.stream) for c in issued] == [(cuda1, side1), (cuda0, side0)]  # first-seen order
    log = fake_cuda.log
    assert [e for e in log if e[0] == "copy"] == [("copy", "h1", cuda1, side1), ("copy", "f1", cuda1, side1),
                                                  ("copy", "s0", cuda0, side0)]
    caller0, caller1 = fake_cuda.current[cuda0], fake_cuda.current[cuda1]
    waits = [e[1:] for e in log if e[0] == "wait"]
    assert waits == ([(side1, caller1), (caller1, side1), (side0, caller0), (caller0, side0)] if ordered else [])
    kept = [e[1:] for e in log if e[0] == "record_stream"]
    assert kept == ([("f1", side1), ("s0", side0)] if ordered else [])  # the CUDA sources only
    for side in (side1, side0):
        last = max(i for i, e in enumerate(log) if e[0] == "copy" and e[3] is side)
        assert log.index(("record", side)) > last  # each device's event comes after its copies
    assert fake_cuda.device == cuda0 and fake_cuda.current == {cuda0: caller0, cuda1: caller1}  # all restored
