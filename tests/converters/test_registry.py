"""Converters: detection and the names a converted state may hold (the registry is tests/test_adapters.py)."""

from __future__ import annotations

from pathlib import Path

import ckptkit
from ckptkit.ops.convert import load_converter, name_problems

REPO = Path(__file__).resolve().parents[2]


def test_dcp_is_detected_only_in_a_dcp_directory(tmp_path: Path) -> None:
    converter = load_converter("dcp")
    assert converter.detect(str(REPO / "fixtures" / "dcp-nodist"))
    assert not converter.detect(str(REPO / "fixtures" / "v1" / "step_00000005"))
    assert not converter.detect(str(tmp_path / "missing"))
    assert ckptkit.detect_format(REPO / "fixtures" / "dcp-fsdp2-fp32") == "dcp"


def test_names_that_cannot_share_one_nested_state_are_found() -> None:
    assert name_problems(["a/b", "a/b/c", "a/d", ""]) == ["'': an empty name", "'a/b' is both a value and the parent of 'a/b/c'"]
    assert name_problems(["model/w", "model/v"]) == []
