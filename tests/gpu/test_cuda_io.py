"""Loads into CUDA targets and saves of CUDA tensors, through the pinned bounce pool (needs a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.io.read import Reader
from ckptkit.ops.load import fill
from ckptkit.state.device import BouncePool, staged_bytes
from ckptkit.state.torch_io import byte_view
from benchmarks.memory import PeakRss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL_POOL = 64 << 10  # forces many chunks: buffers of 16 KiB
# About half a second of GPU time (torch.cuda._sleep spins this many clock cycles) queued on the
# caller's stream before a write: a copy that did not wait for that stream would run before the write.
SLEEP_CYCLES = 1_000_000_000


def _bits(t: torch.Tensor) -> bytes:
    return bytes(byte_view(t.detach().cpu().contiguous()))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(96, 80, generator=g),
        "b": torch.randn(5000, generator=g).to(torch.bfloat16),
        "m": torch.rand(9, 4, 33, generator=g) > 0.5,
        "s": torch.tensor(2.25, dtype=torch.float64),
        "e": torch.zeros(0, 3),
        "i": torch.arange(40 * 1000, dtype=torch.int64).reshape(40, 1000),
    }


def _grid(g: torch.Tensor, rows: list[int], cols: list[int], device: str) -> list[ShardedTensor]:
    return [ShardedTensor(g[r0:r1, c0:c1].clone().to(device), tuple(g.shape), (r0, c0))
            for r0, r1 in zip(rows, rows[1:]) for c0, c1 in zip(cols, cols[1:])]


def test_cuda_targets_are_loaded_whole_bitwise(tmp_path: Path) -> None:
    state = _state()
    ckptkit.save({"model": state}, tmp_path / "ck", step=1)
    target = {"model": {k: torch.full_like(v, 0, device="cuda") for k, v in state.items()}}
    out = ckptkit.load(tmp_path / "ck", target, pinned_bytes=SMALL_POOL)
    for k, v in state.items():
        assert out["model"][k].device.type == "cuda"
        assert out["model"][k] is target["model"][k]
        assert _bits(out["model"][k]) == _bits(v), k


def test_sharded_cuda_targets_get_exactly_their_boxes(tmp_path: Path) -> None:
    g = torch.randn(96, 80)
    ckptkit.save({"model": {"w": _grid(g, [0, 48, 96], [0, 40, 80], "cpu")}}, tmp_path / "ck", step=1)
    targets = _grid(torch.zeros(96, 80), [0, 48, 96], [0, 40, 80], "cuda")
    ckptkit.load(tmp_path / "ck", {"model": {"w": targets}}, pinned_bytes=SMALL_POOL)
    for t in targets:
        assert _bits(t.local) == _bits(g[t.box.slices()])


def test_a_checkpoint_saved_at_one_topology_loads_into_other_cuda_boxes(tmp_path: Path) -> None:
    g = torch.randn(96, 80)
    ckptkit.save({"model": {"w": _grid(g, [0, 32, 64, 96], [0, 80], "cpu")}}, tmp_path / "ck", step=1)
    for rows, cols in (([0, 48, 96], [0, 40, 80]), ([0, 10, 70, 96], [0, 25, 80]), ([0, 96], [0, 13, 80])):
        targets = _grid(torch.zeros(96, 80), rows, cols, "cuda")
        ckptkit.load(tmp_path / "ck", {"model": {"w": targets}}, pinned_bytes=SMALL_POOL)
        for t in targets:
            assert _bits(t.local) == _bits(g[t.box.slices()]), (rows, cols, t.box)
    flat = torch.full((3000,), -1.0, device="cuda")  # a ZeRO-style flat range
    ckptkit.load(tmp_path / "ck", {"model": {"w": ShardedTensor.from_flat(flat, (96, 80), 1234)}}, pinned_bytes=SMALL_POOL)
    assert _bits(flat) == _bits(g.reshape(-1)[1234:4234])


def test_mixed_cpu_and_cuda_targets_load_together(tmp_path: Path) -> None:
    state = _state()
    ckptkit.save({"model": state}, tmp_path / "ck", step=1)
    transposed = torch.zeros(80, 96, device="cuda").t()  # a non-contiguous CUDA target
    target = {"model": {
        "w": transposed, "b": torch.zeros(5000, dtype=torch.bfloat16), "m": torch.zeros(9, 4, 33, dtype=torch.bool, device="cuda"),
        "s": torch.zeros((), dtype=torch.float64, device="cuda"), "e": torch.zeros(0, 3, device="cuda"),
        "i": ShardedTensor(torch.zeros(20, 700, dtype=torch.int64, device="cuda"), (40, 1000), (10, 300)),
    }}
    out = ckptkit.load(tmp_path / "ck", target, pinned_bytes=SMALL_POOL)["model"]
    assert out["b"].device.type == "cpu" and out["w"].device.type == "cuda"
    for k in ("w", "b", "m", "s", "e"):
        assert _bits(out[k]) == _bits(state[k]), k
    assert _bits(out["i"].local) == _bits(state["i"][10:30, 300:1000])


def test_cuda_parameters_are_loaded_into_and_stay_leaves(tmp_path: Path) -> None:
    state = _state()
    ckptkit.save({"model": state}, tmp_path / "ck", step=1)
    model = torch.nn.Linear(80, 96, device="cuda")  # its weight is (96, 80), as "w"
    rows = torch.nn.Parameter(torch.zeros(30, 80, device="cuda"))  # a parameter holding rows 10 to 40 of "w"
    out = ckptkit.load(tmp_path / "ck", {"model": {"w": model.weight}}, pinned_bytes=SMALL_POOL)["model"]
    ckptkit.load(tmp_path / "ck", {"model": {"w": ShardedTensor(rows, (96, 80), (10, 0))}}, pinned_bytes=SMALL_POOL)
    assert out["w"] is model.weight and _bits(model.weight) == _bits(state["w"]) and _bits(rows) == _bits(state["w"][10:40])
    for param in (model.weight, rows):
        assert param.is_leaf and param.requires_grad and param.grad_fn is None


def test_weights_saved_in_bf16_are_cast_on_the_gpu_into_fp32_cuda_parameters(tmp_path: Path) -> None:
    saved = torch.randn(96, 80).to(torch.bfloat16)
    ckptkit.save({"model": {"weight": saved}}, tmp_path / "ck", step=1)
    model = torch.nn.Linear(80, 96, bias=False, device="cuda")
    ckptkit.load_weights(tmp_path / "ck", dict(model.named_parameters()))
    assert model.weight.dtype == torch.float32 and model.weight.is_leaf and model.weight.requires_grad
    assert _bits(model.weight) == _bits(saved.float())


def test_a_load_waits_for_work_queued_on_the_callers_stream(tmp_path: Path) -> None:
    g = torch.randn(2048, 2048)
    ckptkit.save({"model": {"w": g}}, tmp_path / "ck", step=1)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        target = torch.zeros(2048, 2048, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        target.fill_(7.0)  # runs long after the load's copies, unless they wait for this stream
        ckptkit.load(tmp_path / "ck", {"model": {"w": target}}, pinned_bytes=1 << 20)
        assert _bits(target) == _bits(g)


def test_cuda_tensors_save_bitwise_as_their_cpu_copies(tmp_path: Path) -> None:
    state = {k: v.cuda() for k, v in _state().items()}
    state["t"] = torch.randn(70, 30, device="cuda").t()  # non-contiguous
    sharded = _grid(torch.randn(96, 80), [0, 48, 96], [0, 80], "cuda")
    m_gpu = ckptkit.save({"model": {**state, "g": sharded}}, tmp_path / "gpu", step=1, pinned_bytes=SMALL_POOL)
    cpu = {k: v.cpu() for k, v in state.items()}
    cpu_sharded = [ShardedTensor(p.local.cpu(), p.global_shape, p.global_offsets) for p in sharded]
    m_cpu = ckptkit.save({"model": {**cpu, "g": cpu_sharded}}, tmp_path / "cpu", step=1)
    assert [(f.path, f.checksum) for f in m_gpu.files] == [(f.path, f.checksum) for f in m_cpu.files]
    loaded = ckptkit.load(tmp_path / "gpu")["model"]
    for k, v in cpu.items():
        assert _bits(loaded[k]) == _bits(v), k
    assert ckptkit.verify(tmp_path / "gpu").ok


def test_a_save_sees_work_queued_on_the_callers_stream(tmp_path: Path) -> None:
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        w = torch.zeros(2048, 2048, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        w.fill_(3.0)  # a save that did not wait for this stream would read the zeros
        ckptkit.save({"model": {"w": w}}, tmp_path / "ck", step=1, pinned_bytes=1 << 20)
    loaded = ckptkit.load(tmp_path / "ck")["model"]["w"]
    assert torch.equal(loaded, torch.full((2048, 2048), 3.0))


# Host memory a load or save of 64 MiB (32 MiB) of CUDA tensors may add beyond its bounce pool: the
# reader's scratch and the allocator's slack, well under the state's size.
HOST_SLACK = 16 << 20


def test_host_memory_a_load_adds_stays_within_the_pool(tmp_path: Path) -> None:
    state = {f"w{i}": torch.randn(1024, 1024) for i in range(16)}  # 64 MiB
    ckptkit.save({"model": state}, tmp_path / "ck", step=1)
    ck = ckptkit.open(tmp_path / "ck")
    pieces = {f"model/{k}": [ShardedTensor(torch.zeros(1024, 1024, device="cuda"), (1024, 1024), (0, 0))] for k in state}
    pool = BouncePool(8 << 20)
    assert pool.pinned
    reader = Reader(ck.location, ck.manifest)
    fill(reader, pieces, pool=pool)  # warms up: the pool's buffers, the reader's scratch, CUDA's lazy setup
    for piece in pieces.values():
        piece[0].local.zero_()
    with PeakRss() as rss:
        fill(reader, pieces, pool=pool)
    assert rss.peak - rss.before <= (8 << 20) + HOST_SLACK, (rss.peak - rss.before, rss.method)
    assert pool.peak_bytes <= 8 << 20
    assert pool.handed_out >= 64  # 2 x 64 MiB through buffers of 2 MiB
    for k, v in state.items():
        assert _bits(pieces[f"model/{k}"][0].local) == _bits(v)


def test_host_memory_a_save_adds_stays_within_the_pool() -> None:
    tensors = [torch.randn(1024, 1024, device="cuda") for _ in range(8)] + [torch.arange(10, device="cuda")]
    want = b"".join(_bits(t) for t in tensors)
    pool = BouncePool(4 << 20)

    def streamed() -> int:
        """Compare the staged bytes with `want` chunk by chunk (keeping none); return how many."""
        at = 0
        pool.follow(t.device for t in tensors)
        for chunk in staged_bytes(tensors, pool):
            assert chunk == memoryview(want)[at : at + len(chunk)]
            at += len(chunk)
        return at

    assert streamed() == len(want)  # warms up
    with PeakRss() as rss:
        assert streamed() == len(want)
    assert rss.peak - rss.before <= (4 << 20) + HOST_SLACK, (rss.peak - rss.before, rss.method)
    assert pool.peak_bytes <= 4 << 20
    assert pool.handed_out >= 64  # 2 x 32 MiB through buffers of 1 MiB
