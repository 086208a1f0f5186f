"""Converters are found through the ``ckptkit.converters`` entry-point group; the core never imports them."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import ckptkit
from ckptkit.ops.convert import Converter, load_converter, name_problems

REPO = Path(__file__).resolve().parents[2]


def test_the_core_never_imports_the_converters() -> None:
    offenders = []
    for path in sorted((REPO / "ckptkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "ckptkit_converters"]
    assert offenders == []


def test_the_dcp_converter_is_declared_and_installed_as_an_entry_point() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["ckptkit.converters"]
    assert declared["dcp"] == "ckptkit_converters.dcp:CONVERTER"
    converter = load_converter("dcp")
    assert isinstance(converter, Converter) and converter.name == "dcp"
    assert "dcp" in ckptkit.list_converters() and set(ckptkit.list_converters()) <= set(declared)


def test_dcp_is_detected_only_in_a_dcp_directory(tmp_path: Path) -> None:
    converter = load_converter("dcp")
    assert converter.detect(str(REPO / "fixtures" / "dcp-nodist"))
    assert not converter.detect(str(REPO / "fixtures" / "v1" / "step_00000005"))
    assert not converter.detect(str(tmp_path / "missing"))
    assert ckptkit.detect_format(REPO / "fixtures" / "dcp-fsdp2-fp32") == "dcp"


def test_names_that_cannot_share_one_nested_state_are_found() -> None:
    assert name_problems(["a/b", "a/b/c", "a/d", ""]) == ["'': an empty name", "'a/b' is both a value and the parent of 'a/b/c'"]
    assert name_problems(["model/w", "model/v"]) == []
