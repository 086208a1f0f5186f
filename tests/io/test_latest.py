"""The latest pointer only moves forward, and only in a run root: save, reshard, export."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.io.catalog import is_run_root, moves_forward, read_latest
from ckptkit.layouts import Layout, Param, StateGroup, TensorPart, TPCut, Unit
from ckptkit.manifest import Topology
from ckptkit.storage import open_storage


def _save(root: Path, step: int) -> Path:
    path = root / f"step_{step:08d}"
    ckptkit.save({"model": {"w": torch.full((6, 4), float(step))}}, path, step=step)
    return path


def _layout() -> Layout:
    param = Param(name="w", parts=(TensorPart(tensor="w", shape=(6, 4)),), tp=TPCut(dim=0))
    return Layout(name="toy", units=(Unit(name="w", place="first", params=(param,)),),
                  states=(StateGroup(prefix="model", role="param"),))


def _latest(root: Path) -> str:
    return (root / "latest").read_text().split()[0]


def test_moves_forward_only_to_a_higher_step() -> None:
    assert moves_forward(None, 0)
    assert moves_forward(10, 20)
    assert not moves_forward(20, 10)
    assert not moves_forward(20, 20)


def test_a_save_at_a_lower_step_does_not_move_latest_back(tmp_path: Path) -> None:
    _save(tmp_path, 20)
    _save(tmp_path, 10)
    assert _latest(tmp_path) == "step_00000020"
    assert [e.name for e in ckptkit.list_checkpoints(tmp_path).checkpoints] == ["step_00000010", "step_00000020"]


def test_a_save_moves_latest_past_a_pointer_that_names_nothing(tmp_path: Path) -> None:
    _save(tmp_path, 20)
    (tmp_path / "step_00000020" / "manifest.json").unlink()  # gone: latest names nothing committed
    _save(tmp_path, 5)
    assert _latest(tmp_path) == "step_00000005"


def test_reshard_of_an_older_step_into_the_run_root_leaves_latest(tmp_path: Path) -> None:
    src = _save(tmp_path, 10)
    _save(tmp_path, 20)
    report = ckptkit.reshard(src, tmp_path / "step_00000010-tp2", Topology(world_size=2, tp=2), layout=_layout())
    assert (report.latest_moved, report.latest) == (False, "step_00000020")
    assert _latest(tmp_path) == "step_00000020"


def test_reshard_of_the_newest_step_into_a_new_root_writes_its_latest(tmp_path: Path) -> None:
    src = _save(tmp_path / "a", 10)
    report = ckptkit.reshard(src, tmp_path / "b" / "step_00000010", Topology(world_size=2, tp=2), layout=_layout())
    assert (report.latest_moved, report.latest) == (True, "step_00000010")
    assert _latest(tmp_path / "b") == "step_00000010"


def test_reshard_into_a_bare_name_writes_no_latest_in_the_working_directory(tmp_path: Path, monkeypatch: Any) -> None:
    src = _save(tmp_path / "a", 10)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    report = ckptkit.reshard(src, "resharded", Topology(world_size=2, tp=2), layout=_layout())
    assert (report.latest_moved, report.latest) == (False, None)
    assert sorted(os.listdir(work)) == ["resharded"]


def test_reshard_into_a_directory_of_other_files_writes_no_latest(tmp_path: Path) -> None:
    src = _save(tmp_path / "a", 10)
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "notes.txt").write_text("mine")
    ckptkit.reshard(src, tmp_path / "misc" / "resharded", Topology(world_size=2, tp=2), layout=_layout())
    assert sorted(os.listdir(tmp_path / "misc")) == ["notes.txt", "resharded"]


def test_cli_reshard_says_it_left_latest(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _save(tmp_path, 10)
    _save(tmp_path, 20)
    layout = tmp_path.parent / f"{tmp_path.name}-layout.json"
    layout.write_text(json.dumps(_layout().to_json()))
    done = run_ckptkit("reshard", str(src), str(tmp_path / "tp2"), "--tp", "2", "--layout", str(layout))
    assert done.returncode == 0, done.stderr
    assert f"{tmp_path}/latest left at step_00000020 (it names a step at or above 10)" in done.stdout.splitlines()
    assert _latest(tmp_path) == "step_00000020"


def test_export_into_a_run_root_leaves_latest(tmp_path: Path) -> None:
    src = _save(tmp_path, 10)
    _save(tmp_path, 20)
    ckptkit.export(src, tmp_path / "export-10", format="dcp", dcp_form="plain")
    assert _latest(tmp_path) == "step_00000020"


def test_a_new_or_pointed_root_is_a_run_root_and_the_working_directory_is_not(tmp_path: Path, monkeypatch: Any) -> None:
    assert is_run_root(open_storage(tmp_path / "new"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    assert not is_run_root(open_storage(tmp_path / "other"))
    _save(tmp_path / "other", 1)
    assert is_run_root(open_storage(tmp_path / "other"))
    assert read_latest(open_storage(tmp_path / "other")) == "step_00000001"
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    assert not is_run_root(open_storage("."))


@pytest.mark.parametrize("steps", [(1, 2), (2, 1)])
def test_latest_names_the_highest_step_whatever_the_save_order(tmp_path: Path, steps: tuple[int, int]) -> None:
    for step in steps:
        _save(tmp_path, step)
    assert _latest(tmp_path) == "step_00000002"
