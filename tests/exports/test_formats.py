"""The table of export formats is the one source of the formats and of the options each takes: the command
offers its names and forms, and the library and the command refuse the same options with the same message."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest

import ckptkit
from ckptkit.cli import cli
from ckptkit.errors import LayoutError
from ckptkit.exports.formats import EXPORT_FORMATS, ExportFormat
from ckptkit.exports.run import export
from ckptkit.layouts import layout_for

LLAMA = Path(__file__).resolve().parents[2] / "fixtures" / "llama-v1.1"
LAYOUT = layout_for(ckptkit.read_manifest(LLAMA))

# An option: its flag, what asks for it in the library and on the command line ({layout}: a layout
# file), and whether a format takes it.
Option = tuple[str, dict[str, Any], list[str], Callable[[ExportFormat], bool]]
OPTIONS: list[Option] = [
    ("--dtype", {"dtype": "fp16"}, ["--dtype", "fp16"], lambda f: "fp16" in f.dtypes),
    ("--include-optimizer", {"include_optimizer": True}, ["--include-optimizer"], lambda f: f.optimizer != "never"),
    ("--layout", {"layout": LAYOUT}, ["--layout", "{layout}"], lambda f: f.layout),
    ("--tp/--pp/--ep", {"pp": 2}, ["--pp", "2"], lambda f: f.pieces),
    ("--dcp-form", {"dcp_form": "plain"}, ["--dcp-form", "plain"], lambda f: "plain" in f.forms),
    ("--dp", {"dp": 2}, ["--dp", "2"], lambda f: f.dp),
]
REFUSED = [(f.name, option) for f in EXPORT_FORMATS.values() for option in OPTIONS if not option[3](f)]


def _choices(name: str) -> list[str]:
    param = next(p for p in cli.commands["export"].params if p.name == name)
    assert isinstance(param.type, click.Choice)
    return list(param.type.choices)


def test_the_command_offers_the_formats_dtypes_and_forms_of_the_table() -> None:
    assert _choices("fmt") == list(EXPORT_FORMATS) == ["dcp", "deepspeed", "hf", "hf-trainer", "megatron", "peft", "torchtitan", "zarr"]
    assert _choices("dtype") == ["bf16", "fp16", "fp32"]
    assert _choices("dcp_form") == [form for f in EXPORT_FORMATS.values() for form in f.forms] == ["fsdp2", "plain"]


@pytest.mark.parametrize(("name", "option"), REFUSED, ids=[f"{name}{option[0]}" for name, option in REFUSED])
def test_an_option_a_format_does_not_take_is_refused_alike_by_the_library_and_the_command(
    name: str, option: Option, tmp_path: Path, run_ckptkit: Any
) -> None:
    flag, kwargs, args, _ = option
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps(LAYOUT.to_json()))
    with pytest.raises(LayoutError) as refused:
        export(LLAMA, tmp_path / "out", format=name, **kwargs)
    assert str(refused.value).startswith(f"{flag}: ")
    proc = run_ckptkit("export", str(LLAMA), str(tmp_path / "out"), "--format", name, *(a.format(layout=layout) for a in args))
    assert proc.returncode == 2
    assert proc.stderr == f"ckptkit: error: {refused.value}\n"  # one line: the library's message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layout.json"]  # nothing written


@pytest.mark.parametrize("name", list(EXPORT_FORMATS))
def test_every_option_a_format_does_not_take_is_in_one_message(name: str) -> None:
    fmt = EXPORT_FORMATS[name]
    problem = fmt.options_problem(dtype="fp16", include_optimizer=True, layout=True, pp=2, dcp_form="plain", dp=2)
    refused = [option[0] for option in OPTIONS if not option[3](fmt)]
    assert problem is not None and "\n" not in problem
    assert [part.split(":")[0] for part in problem.split("; ")] == refused
