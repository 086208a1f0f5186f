"""Megatron-LM itself resumes from ckptkit's export of its own saves: what the regenerated record
(``fixtures/make_megatron_lm_resume.py``, run with a Megatron-LM source tree) says, and that ckptkit
today writes the very files Megatron-LM resumed from.

Megatron-LM's training package is not on PyPI, so the resume itself runs with the record's script,
not here; this test redoes ckptkit's part (convert, reshard, export) and compares every file of
the export, byte for byte, with the files the record's resume loaded.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from .conftest import _ckptkit_command
from .fixture_scripts import FIXTURES, fixture_script

RESUME = fixture_script("make_megatron_lm_resume")
RECORD = json.loads((FIXTURES / RESUME.RECORD).read_text())
CASES = sorted(RESUME.CASES)


def test_the_record_holds_every_case_and_names_megatron_lms_commit() -> None:
    assert sorted(RECORD["cases"]) == CASES
    assert len(RECORD["megatron_lm"] or "") == 40 and RECORD["ckptkit"]


@pytest.mark.parametrize("name", CASES)
def test_ckptkit_writes_the_files_megatron_lm_resumed_from(name: str, tmp_path: Path) -> None:
    _, commands, report = RESUME.ckptkit_steps(_ckptkit_command(), name, tmp_path)
    recorded = RECORD["cases"][name]
    assert commands == recorded["commands"]
    assert sorted([f["path"], f["size"], f["checksum"]] for f in report["file_list"]) == recorded["export_files"]


@pytest.mark.parametrize("name", CASES)
def test_megatron_lm_resumed_from_the_export_as_from_its_own_save(name: str) -> None:
    case = RECORD["cases"][name]
    original, export, control = case["original"], case["export"], case["export_without_optimizer"]
    # the resume from the export took the model's sizes and parallel sizes from its arguments
    assert "--use-checkpoint-args" in case["export_arguments"] and "--num-layers" not in case["export_arguments"]
    assert "--tensor-model-parallel-size" not in case["export_arguments"]
    # the step and learning rate come back from the checkpoint (the job's own arguments start at 0)
    assert original["iteration"] == export["iteration"] == 3 and export["lr"] == original["lr"] > 0
    # every parameter, fp32 master, Adam moment and step as loaded, on every rank, bitwise
    assert export["digests"] == original["digests"]
    states = {key for rank in export["digests"].values() for tensors in rank.values() for key in tensors}
    assert states == {"model", "param", "exp_avg", "exp_avg_sq", "step"}
    assert sorted(export["digests"]) == ["0", "1", "2", "3"] and all(export["digests"].values())
    # the next steps' losses (the second one moved by the loaded moments): equal
    assert len(export["losses"]) == RESUME.STEPS and _close(export["losses"], original["losses"], 1e-6)
    # a resume without the optimizer state steps differently: the losses can tell
    assert control["losses"][0] == original["losses"][0] and not _close(control["losses"][1:], original["losses"][1:], 1e-6)


def _close(a: list[Any], b: list[Any], rel: float) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=rel, abs_tol=0.0) for x, y in zip(a, b))
