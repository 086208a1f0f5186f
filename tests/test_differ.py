from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.cli import cli
from ckptkit.ops.diff import diff


def _save(path: Path, w: torch.Tensor, *, split: int = 1, extra: dict | None = None) -> None:
    rows = w.shape[0] // split
    pieces = [ShardedTensor(w[i * rows : (i + 1) * rows].clone(), tuple(w.shape), (i * rows, 0)) for i in range(split)]
    ckptkit.save({"model": {"w": pieces}, **(extra or {})}, path, step=1)


def test_same_logical_tensor_saved_with_different_shardings_is_equal(tmp_path: Path) -> None:
    w = torch.randn(8, 4)
    _save(tmp_path / "a", w, split=1)
    _save(tmp_path / "b", w, split=4)
    report = diff(tmp_path / "a", tmp_path / "b")
    assert report.ok and report.tensors == 1
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 0 and "equal (1 tensors compared)" in result.output


def test_a_changed_value_is_reported_with_its_size(tmp_path: Path) -> None:
    w = torch.zeros(8, 4)
    _save(tmp_path / "a", w)
    w[3, 2] = 0.5
    _save(tmp_path / "b", w, split=2)
    report = diff(tmp_path / "a", tmp_path / "b")
    assert not report.ok
    (d,) = report.differences
    assert (d.name, d.mismatched, d.numel, d.max_abs) == ("model/w", 1, 32, 0.5)
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 1 and "model/w: 1/32 differ, max abs 0.5" in result.output


def test_tolerances_accept_small_differences(tmp_path: Path) -> None:
    w = torch.ones(4, 4)
    _save(tmp_path / "a", w)
    _save(tmp_path / "b", w + 1e-6)
    assert not diff(tmp_path / "a", tmp_path / "b").ok
    assert diff(tmp_path / "a", tmp_path / "b", atol=1e-5).ok
    assert diff(tmp_path / "a", tmp_path / "b", rtol=1e-5).ok


def test_missing_tensors_and_json_values_make_a_difference(tmp_path: Path) -> None:
    _save(tmp_path / "a", torch.ones(2, 2), extra={"sched": {"lr": 1.0}})
    ckptkit.save({"model": {"v": torch.ones(2, 2)}, "sched": {"lr": 2.0}}, tmp_path / "b", step=1)
    report = diff(tmp_path / "a", tmp_path / "b")
    assert sorted((d.name, d.problem) for d in report.differences) == [("model/v", "only in B"), ("model/w", "only in A")]
    assert not report.objects_equal


def test_missing_checkpoint_exits_2(tmp_path: Path) -> None:
    _save(tmp_path / "a", torch.ones(2, 2))
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "nope")])
    assert result.exit_code == 2
