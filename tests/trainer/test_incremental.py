"""The reference trainer with incremental saves, fine-tuning the top of the model: every step's
checkpoint equals the one a full save writes, a resume from one continues bitwise, and reshard and
export read it as a full checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import ckptkit
from ckptkit.exports.run import export
from ckptkit.trainer.train import config_from, launch, prepare

pytestmark = pytest.mark.multiprocess

STEPS = 4
OPTIONS = dict(dp=2, zero=1, steps=STEPS, save_every=1, freeze_layers=3)


def _train(out: Path, **options: Any) -> list[dict]:
    log = out.parent / f"{out.name}.jsonl"
    cfg = config_from(out=str(out), log_jsonl=str(log), **{**OPTIONS, **options})
    launch(cfg, prepare(cfg))
    return [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("incremental")
    return {"inc": base / "inc", "full": base / "full", "base": base,
            "inc_log": _train(base / "inc", incremental=True), "full_log": _train(base / "full")}


def _step(root: Path, step: int) -> str:
    return str(root / f"step_{step:08d}")


def test_every_incremental_step_equals_the_full_save_and_writes_only_what_changed(runs: dict[str, Any]) -> None:
    assert runs["inc_log"] == runs["full_log"]
    for step in range(1, STEPS + 1):
        report = ckptkit.diff(_step(runs["inc"], step), _step(runs["full"], step), kinds=("param", "optimizer", "buffer", "rng", "other"))
        assert report.ok and report.tensors > 0, (step, report.differences[:3])
        assert ckptkit.verify(_step(runs["inc"], step)).ok
    last = ckptkit.inspect(_step(runs["inc"], STEPS))
    full = ckptkit.inspect(_step(runs["full"], STEPS))
    # the embedding and 3 of the 4 layers, their masters and moments: read from step 1, never written again
    assert [b.checkpoint for b in last.borrowed] == ["step_00000001"]
    frozen = last.borrowed[0].tensor_bytes
    assert frozen > 0.6 * full.tensor_bytes
    assert last.owned_bytes is not None and last.owned_bytes < full.payload_bytes - frozen + 64 * 1024


def test_a_resume_from_an_incremental_step_continues_bitwise(runs: dict[str, Any]) -> None:
    again = runs["base"] / "again"
    again.mkdir()
    for step in (1, 2):  # step 2 reads files of step 1: the two move together
        shutil.copytree(_step(runs["inc"], step), _step(again, step))
    log = _train(again, incremental=True, resume=_step(again, 2))
    assert log == runs["inc_log"][2:]
    assert ckptkit.diff(_step(again, STEPS), _step(runs["full"], STEPS)).ok


def test_reshard_and_export_of_an_incremental_step_match_the_full_saves(runs: dict[str, Any]) -> None:
    out = runs["base"] / "resharded"
    for name in ("inc", "full"):
        ckptkit.reshard(_step(runs[name], STEPS), str(out / name / "step"), ckptkit.Topology(world_size=2, tp=2))
        export(str(out / name / "step"), str(out / name / "hf"))
    assert ckptkit.diff(str(out / "inc" / "step"), str(out / "full" / "step")).ok
    files = sorted(p.name for p in (out / "full" / "hf").glob("*.safetensors"))
    assert files
    for name in files:
        assert (out / "inc" / "hf" / name).read_bytes() == (out / "full" / "hf" / name).read_bytes(), name
