"""Whole-tensor bytes without torch: conversions match torch's rounding bit for bit; reads assemble any shards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit.exports.convert import convert
from ckptkit.io.catalog import resolve
from ckptkit.io.read import Reader, byte_shape
from ckptkit.errors import LayoutError
from ckptkit.state.sharded import ShardedTensor

SPECIAL = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 3.4028235e38, -3.4028235e38, 1e-45, -1e-45,
           1.1754942e-38, 65504.0, 65520.0, 1e-8, 6.1e-5, 1.00390625, 1.01171875, 1.0 + 2**-8, 1.0 + 3 * 2**-9]
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300),
    st.sampled_from(sorted({(a, b) for a in TORCH for b in TORCH})),
)
def test_conversions_round_as_torch_does(words: list[int], pair: tuple[str, str]) -> None:
    src, dst = pair
    raw = np.array(words, dtype=np.uint32).view(np.float32)
    values = torch.from_numpy(np.concatenate([raw, np.array(SPECIAL, dtype=np.float32)])).to(TORCH[src])
    got = convert(np.frombuffer(_bits(values), np.uint8), src, dst)
    want = values.to(TORCH[dst])
    nan = torch.isnan(want)
    ours = torch.from_numpy(got.copy()).view(TORCH[dst])
    assert _bits(ours[~nan]) == _bits(want[~nan])
    assert torch.isnan(ours[nan].float()).all()  # a NaN stays a NaN (torch's own NaN bits vary by code path)


def test_other_conversions_are_refused() -> None:
    with pytest.raises(LayoutError, match="cannot convert float64 to bfloat16"):
        convert(np.zeros(16, np.uint8), "float64", "bfloat16")


def test_read_whole_assembles_row_and_column_shards(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 10, generator=g).to(torch.bfloat16)
    cols = [ShardedTensor(w[:, :4].clone(), (6, 10), (0, 0)), ShardedTensor(w[:, 4:].clone(), (6, 10), (0, 4))]
    rows = torch.randn(9, 2, 3, generator=g)
    state = {"w": cols, "r": [ShardedTensor(rows[:4].clone(), (9, 2, 3), (0, 0, 0)), ShardedTensor(rows[4:].clone(), (9, 2, 3), (4, 0, 0))],
             "s": torch.tensor(7, dtype=torch.int64), "e": torch.zeros(0, 5)}
    ckptkit.save(state, tmp_path / "c", step=1)
    loc = resolve(tmp_path / "c")
    manifest = ckptkit.read_manifest(str(tmp_path / "c"))
    reader = Reader(loc, manifest)
    with ThreadPoolExecutor(2) as pool:
        for name, want in (("w", w), ("r", rows), ("s", state["s"]), ("e", state["e"])):
            got = reader.read_whole(name, pool=pool)
            assert got.shape == byte_shape(tuple(want.shape), want.element_size())
            assert got.tobytes() == _bits(want), name
    assert len(reader.headers) == len(manifest.files)  # each header read once, then cached
