"""Where a run starts: a new run never lands on another run's checkpoints, a resume needs something
to resume, and says what it resumed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import ckptkit
from ckptkit.errors import CheckpointExistsError, CheckpointNotFoundError, RunError
from ckptkit.trainer.start import plan_start
from ckptkit.trainer.train import config_from, launch, prepare

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def other_run(tmp_path: Path) -> Path:
    """A root holding steps 10 and 20 of another run, latest at 20."""
    root = tmp_path / "runs" / "a"
    for step in (10, 20):
        ckptkit.save({"model": {"w": torch.full((4,), float(step))}}, root / f"step_{step:08d}", step=step)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank run of the tiny model, 2 steps, saved at step 2."""
    root = tmp_path_factory.mktemp("start") / "run"
    cfg = config_from(steps=2, save_every=2, out=str(root))
    launch(cfg, prepare(cfg))
    return root


def test_a_new_run_into_a_root_of_another_run_is_refused_and_writes_nothing(other_run: Path, run_ckptkit: Any) -> None:
    before = _files(other_run)
    proc = run_ckptkit("train", "--out", str(other_run), "--steps", "2", "--save-every", "1", "--quiet")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"ckptkit: error: {other_run} already holds 2 checkpoint(s) of another run, the newest step_00000020 (step 20); "
        "continue that run with --resume latest, or start a new run with another --out"
    ]
    assert _files(other_run) == before  # nothing written, latest still names step 20
    assert (other_run / "latest").read_text().split()[0] == "step_00000020"


def test_the_refusal_names_the_run_the_root_records(trained: Path) -> None:
    with pytest.raises(CheckpointExistsError, match=r"of run [0-9a-f]{12}, llama tiny, tp=1 pp=1 dp=1 zero=0, the newest step_00000002"):
        plan_start(config_from(steps=4, out=str(trained)))


def test_resume_latest_with_nothing_to_resume_fails(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("train", "--resume", "latest", "--out", str(tmp_path / "typo"), "--steps", "2", "--quiet")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"ckptkit: error: {tmp_path / 'typo'}: no checkpoint to resume (--resume latest, and no latest there); "
        "drop --resume to start a new run, or add --resume-if-present"
    ]
    assert not (tmp_path / "typo").exists()


def test_resume_if_present_starts_a_new_run_when_there_is_nothing(tmp_path: Path) -> None:
    start = plan_start(config_from(resume="latest", resume_if_present=True, out=str(tmp_path / "new")))
    assert (start.resume, start.step, start.banner) == (None, 0, "")


def test_resume_if_present_resumes_when_there_is_something(other_run: Path) -> None:
    start = plan_start(config_from(resume="latest", resume_if_present=True, steps=30, out=str(other_run)))
    assert (start.resume, start.step) == (str(other_run / "step_00000020"), 20)


def test_resume_past_steps_fails(other_run: Path) -> None:
    with pytest.raises(RunError, match="step_00000020 is at step 20, past --steps 10: nothing to train"):
        plan_start(config_from(resume="latest", steps=10, out=str(other_run)))


def test_a_resume_that_would_save_a_committed_step_again_is_refused(other_run: Path) -> None:
    cfg = config_from(resume=str(other_run / "step_00000010"), steps=20, save_every=10, out=str(other_run))
    with pytest.raises(CheckpointExistsError, match="step_00000020 is already committed, and resuming from step 10 would save it again"):
        plan_start(cfg)


def test_resume_of_a_missing_path_fails(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint"):
        plan_start(config_from(resume=str(tmp_path / "nope"), out=str(tmp_path / "run")))


def test_the_first_save_records_the_run(trained: Path) -> None:
    doc = json.loads((trained / "run.json").read_text())
    jsonschema.validate(doc, json.loads((SCHEMAS / "run" / "v1.schema.json").read_text()))
    assert (doc["format"], doc["model"], doc["topology"]["world_size"], doc["parent"]) == ("ckptkit-run", "llama tiny", 1, None)


def test_a_resume_at_another_topology_says_what_it_reshards(trained: Path) -> None:
    start = plan_start(config_from(resume="latest", tp=2, steps=4, out=str(trained)))
    assert start.banner == (
        f"resuming from {trained / 'step_00000002'} (step 2): saved at tp=1 pp=1 dp=1 zero=0, now tp=2 pp=1 dp=1 zero=0; "
        "parameters and optimizer state resharded at load; RNG derived from the saved streams (other ranks); training steps 3-4"
    )
    assert start.run == ckptkit.read_run(ckptkit.open_storage(trained))  # the same run continues


def test_a_resume_into_another_root_is_a_new_run_naming_its_parent(trained: Path, tmp_path: Path) -> None:
    start = plan_start(config_from(resume=str(trained / "step_00000002"), steps=4, out=str(tmp_path / "b")))
    assert start.run.parent == str(trained / "step_00000002")
    assert start.run.run_id != ckptkit.read_run(ckptkit.open_storage(trained)).run_id  # type: ignore[union-attr]


BANNER = ("ckptkit: train: resuming from {ckpt} (step 2): saved at tp=1 pp=1 dp=1 zero=0, now tp=1 pp=1 dp=1 zero=0; "
          "same topology, nothing resharded; RNG restored; training steps 3-3")


def test_cli_resume_piped_prints_one_banner_and_no_start_up_phases(trained: Path, tmp_path: Path, run_ckptkit: Any) -> None:
    out = tmp_path / "b"
    proc = run_ckptkit("train", "--resume", str(trained / "step_00000002"), "--out", str(out), "--steps", "3", "--save-every", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [BANNER.format(ckpt=trained / "step_00000002")]
    assert ckptkit.list_checkpoints(out).latest == "step_00000003"


def test_cli_train_on_a_terminal_says_what_its_start_up_is_doing(trained: Path, tmp_path: Path, run_in_pty: Any) -> None:
    code, _, terminal = run_in_pty("train", "--resume", str(trained / "step_00000002"), "--out", str(tmp_path / "b"), "--steps", "3")
    assert code == 0, terminal
    lines = [line.strip() for line in terminal.splitlines()]
    assert lines[0] == "ckptkit: train: starting"  # before torch imports
    assert BANNER.format(ckpt=trained / "step_00000002") in lines
    assert lines.index("ckptkit: train: preparing the data") < lines.index("ckptkit: train: building the tiny model on 1 rank(s)")
    assert f"ckptkit: train: loading {trained / 'step_00000002'}" in lines and "ckptkit: train: training steps 3-3" in lines


def test_cli_resume_at_steps_says_nothing_to_train(trained: Path, run_ckptkit: Any) -> None:
    before = _files(trained)
    proc = run_ckptkit("train", "--resume", "latest", "--out", str(trained), "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"ckptkit: train: {trained / 'step_00000002'} is at step 2, which is --steps: nothing to train"
    assert _files(trained) == before


def test_cli_resume_if_present_says_it_starts_a_new_run(tmp_path: Path, run_ckptkit: Any) -> None:
    out = tmp_path / "new"
    proc = run_ckptkit("train", "--resume", "latest", "--resume-if-present", "--out", str(out), "--steps", "1", "--save-every", "1",
                       "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"ckptkit: train: nothing to resume under {out}; starting a new run (--resume-if-present)"]
    assert ckptkit.list_checkpoints(out).latest == "step_00000001"
