from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.io import checksum
from ckptkit import ShardedTensor
from ckptkit.errors import IntegrityError, CheckpointNotFoundError, LayoutError
from ckptkit.storage import MemoryStorage

from .fakes import CountingStorage


def _grid_pieces(g: torch.Tensor, cuts: list[list[int]]) -> list[ShardedTensor]:
    pieces = []
    for idx in np.ndindex(*[len(c) - 1 for c in cuts]):
        off = tuple(c[i] for c, i in zip(cuts, idx))
        sl = tuple(slice(c[i], c[i + 1]) for c, i in zip(cuts, idx))
        pieces.append(ShardedTensor(g[sl].clone(), tuple(g.shape), off))
    return pieces


@st.composite
def partitions(draw: st.DrawFn) -> tuple[tuple[int, ...], list[list[int]], list[list[int]], int, int]:
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    n = math.prod(shape)

    def cuts() -> list[list[int]]:
        return [sorted({0, s} | set(draw(st.lists(st.integers(1, s), max_size=2)))) for s in shape]

    a = draw(st.integers(0, n))
    b = draw(st.integers(a, n))
    return shape, cuts(), cuts(), a, b


@settings(max_examples=60, deadline=None)
@given(partitions())
def test_any_saved_partition_loads_into_any_target_partition(case: tuple) -> None:
    shape, src_cuts, dst_cuts, a, b = case
    g = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    store = MemoryStorage()
    ckptkit.save({"model": {"w": _grid_pieces(g, src_cuts)}}, "ck", step=1, storage=store)
    targets = _grid_pieces(torch.zeros(shape), dst_cuts)
    ckptkit.load("ck", {"model": {"w": targets}}, storage=store)
    for t in targets:
        assert torch.equal(t.local, g[t.box.slices()])
    flat = torch.full((b - a,), -1.0)
    ckptkit.load("ck", {"model": {"w": ShardedTensor.from_flat(flat, shape, a)}}, storage=store)
    assert torch.equal(flat, g.reshape(-1)[a:b])


def test_load_reads_only_the_blocks_its_boxes_touch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "MIN_BLOCK", 512)  # small blocks, so that this small file has many
    g = torch.arange(256 * 32, dtype=torch.float32).reshape(256, 32)  # rows of 128 bytes
    store = CountingStorage()
    ckptkit.save({"model": {"w": g}}, "ck", step=1, storage=store)
    assert ckptkit.read_manifest("ck", storage=store).files[0].blocks.size == 512  # type: ignore[union-attr]
    header = 8 + int.from_bytes(store.read("ck/rank00000.safetensors", 0, 8), "little")
    store.bytes_read.clear()
    target = ShardedTensor(torch.zeros(40, 32), (256, 32), (100, 0))  # rows 100 to 139: 5,120 bytes
    ckptkit.load("ck", {"model": {"w": target}}, storage=store)
    assert torch.equal(target.local, g[100:140])
    header_blocks = -(-header // 512) * 512  # the blocks holding the header are checked too
    assert store.bytes_read["ck/rank00000.safetensors"] <= header + header_blocks + 40 * 128 + 2 * 512


def test_a_flipped_byte_in_a_box_read_in_part_is_caught(tmp_path: Path) -> None:
    g = torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024)  # 256 KiB: one block of 1 MiB
    with mock.patch.object(checksum, "MIN_BLOCK", 1 << 20):
        ckptkit.save({"model": {"w": g}}, tmp_path / "ck", step=1)
    payload = tmp_path / "ck" / "rank00000.safetensors"
    data = bytearray(payload.read_bytes())
    data[-5] ^= 0x10  # in the last row
    payload.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=r"rank00000.safetensors: block [0-9]+ .* does not match its checksum"):
        ckptkit.load(tmp_path / "ck", {"model": {"w": ShardedTensor(torch.zeros(8, 1024), (64, 1024), (56, 0))}})
    first_rows = ShardedTensor(torch.zeros(8, 1024), (64, 1024), (0, 0))
    with pytest.raises(IntegrityError, match="does not match its checksum"):  # the flip shares the rows' block
        ckptkit.load(tmp_path / "ck", {"model": {"w": first_rows}})


def test_plain_tensor_target_is_filled_in_place(tmp_path: Path) -> None:
    g = torch.randn(5, 3)
    ckptkit.save({"model": {"w": g}}, tmp_path / "ck", step=1)
    target = torch.zeros(5, 3)
    out = ckptkit.load(tmp_path / "ck", {"model": {"w": target}})
    assert out["model"]["w"] is target and torch.equal(target, g)


def test_partial_target_loads_only_what_it_names(tmp_path: Path) -> None:
    ckptkit.save({"model": {"a": torch.ones(2), "b": torch.zeros(2)}, "sched": {"lr": 1.0}}, tmp_path / "ck", step=1)
    out = ckptkit.load(tmp_path / "ck", {"model": {"a": torch.empty(2)}})
    assert set(out["model"]) == {"a"} and out["sched"] == {"lr": 1.0}


def test_target_problems_are_all_listed(tmp_path: Path) -> None:
    ckptkit.save({"model": {"a": torch.ones(2), "b": torch.zeros(2)}}, tmp_path / "ck", step=1)
    target = {"model": {"a": torch.empty(3), "b": torch.empty(2, dtype=torch.float64), "c": torch.empty(1)}}
    with pytest.raises(LayoutError) as err:
        ckptkit.load(tmp_path / "ck", target)
    message = str(err.value)
    assert "3 problem(s)" in message and "model/c: not in the checkpoint" in message
    assert "target global shape [3]" in message and "target dtype torch.float64" in message


def test_missing_checkpoint_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        ckptkit.load(tmp_path / "nope")


def test_uncommitted_directory_is_invisible(tmp_path: Path) -> None:
    ckptkit.save({"model": {"w": torch.ones(1)}}, tmp_path / "ck", step=1)
    (tmp_path / "ck" / "manifest.json").unlink()
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        ckptkit.load(tmp_path / "ck")
