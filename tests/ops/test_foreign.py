"""inspect, verify and ls read another tool's checkpoint directly, through its adapter, writing
nothing beside it; the commands that write (or compare) name the convert that brings it in; a
converted checkpoint records its source and inspect shows it."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import cli
from ckptkit.manifest.dtypes import itemsize
from ..conftest import cli_schema

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
SCHEMAS = Path(__file__).resolve().parents[2] / "schemas" / "cli"

# (fixture, adapter, step, the topology the source was saved at: (world, tp, pp, dp, zero) or None, ranks)
SOURCES = [
    ("deepspeed/zero3-bf16-dp3", "deepspeed", 3, (3, 1, 1, 3, 3), 3),
    ("deepspeed/zero2-fp32", "deepspeed", 3, (2, 1, 1, 2, 2), 2),
    ("megatron-lm/gpt-tp2-pp2", "megatron", 3, (4, 2, 2, 1, 0), 4),
    ("megatron/gpt-tp2-pp2", "megatron", 0, None, 4),
    ("dcp-fsdp2-fp32", "dcp", 3, None, 2),
    ("dcp-hf-fsdp2", "dcp", 0, None, None),
]


def _tree(path: Path) -> dict[str, str]:
    """Every file under `path` and the hash of its bytes: what nothing may change."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ckptkit.ConvertReport]:
    """Each source converted by ``ckptkit convert``: what reading it directly must agree with."""
    out = tmp_path_factory.mktemp("converted")
    return {src: ckptkit.convert(FIXTURES / src, out / src.replace("/", "-")) for src, *_ in SOURCES}


@pytest.fixture(scope="module")
def converted(reports: dict[str, ckptkit.ConvertReport]) -> dict[str, Path]:
    return {src: Path(report.destination) for src, report in reports.items()}


@pytest.fixture(scope="module")
def warnings(reports: dict[str, ckptkit.ConvertReport]) -> dict[str, list[str]]:
    return {src: report.warnings for src, report in reports.items()}


@pytest.mark.parametrize(("src", "adapter", "step", "topology", "ranks"), SOURCES)
def test_inspect_reads_another_tools_checkpoint_as_convert_would_and_writes_nothing(
    src: str, adapter: str, step: int, topology: Any, ranks: int | None, converted: dict[str, Path],
) -> None:
    path = FIXTURES / src
    before = _tree(path)
    result = CliRunner().invoke(cli, ["inspect", "--json", str(path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, cli_schema("inspect"))
    assert _tree(path) == before
    assert (doc["read_through"], doc["step"], doc["producer"], doc["checkpoint_id"]) == (adapter, step, None, "")
    assert doc["kind"] == ckptkit.list_checkpoints(path).kind  # the kind ls names the folder by
    assert doc["files"] == len(before) and doc["payload_bytes"] == sum((path / f).stat().st_size for f in before)
    same = ckptkit.inspect(converted[src])
    assert doc["tensor_list"] == [t.model_dump() for t in same.tensor_list]
    assert (doc["tensors"], doc["objects"], doc["bytes_by_kind"]) == (same.tensors, same.objects, same.bytes_by_kind)
    source = doc["info"]["source"]
    read = next((d for d in path.iterdir() if d.name in ("global_step3", "iter_0000003")), path)  # the tag a root names
    assert (source["format"], source["path"], source.get("ranks")) == (adapter, str(read.resolve()), ranks)
    assert same.info.source is not None and source == same.info.source.model_dump(exclude_none=True)
    shown = None if topology is None else dict(zip(("world_size", "tp", "pp", "dp", "zero_stage"), topology))
    assert (None if "topology" not in source else {k: source["topology"][k] for k in shown or {}}) == shown


def test_inspect_of_another_tools_checkpoint_says_what_it_is_and_where_it_came_from() -> None:
    path = FIXTURES / "deepspeed" / "zero3-bf16-dp3"
    lines = CliRunner().invoke(cli, ["inspect", str(path)]).stdout.splitlines()
    assert lines[0] == (f"checkpoint  {path}   (a DeepSpeed save, read through the deepspeed adapter; "
                        f"`ckptkit convert {path} DST` brings it in)")
    assert lines[2] == "source      deepspeed 0.19.8, world 3 = tp 1 x pp 1 x dp 3 x cp 1, ep 1, zero 3"


def test_inspect_warns_as_convert_does(warnings: dict[str, list[str]]) -> None:
    for src, *_ in SOURCES:
        assert ckptkit.inspect(FIXTURES / src).warnings == warnings[src]
    assert "holds no Megatron-LM arguments" in warnings["megatron/gpt-tp2-pp2"][0]


def test_verify_reads_every_tensor_of_another_tools_checkpoint(converted: dict[str, Path]) -> None:
    for src, adapter, *_ in SOURCES:
        report = ckptkit.verify(FIXTURES / src)
        manifest = ckptkit.read_manifest(converted[src])
        nbytes = sum(math.prod(t.shape) * itemsize(t.dtype) for t in manifest.tensors.values())
        assert (report.ok, report.read_through, report.tensors, report.bytes_read) == (True, adapter, len(manifest.tensors), nbytes)
        quick = ckptkit.verify(FIXTURES / src, quick=True)
        assert quick.ok and quick.bytes_read < nbytes


def test_verify_of_a_truncated_foreign_file_is_a_problem_named_in_one_line(tmp_path: Path) -> None:
    src = tmp_path / "zero2"
    shutil.copytree(FIXTURES / "deepspeed" / "zero2-fp32", src)
    optim = next(src.rglob("*optim_states.pt"))
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    before = _tree(src)
    result = CliRunner().invoke(cli, ["verify", str(src)])
    assert result.exit_code == 1
    problem, summary = result.stdout.splitlines()
    assert problem.startswith(f"[metadata] {src}: ") or problem.startswith(f"[integrity] {src}: ")
    assert summary.startswith(f"{src}: 1 problem(s)")
    assert _tree(src) == before


def test_ls_of_another_tools_checkpoint_lists_it_with_its_step_and_topology() -> None:
    result = CliRunner().invoke(cli, ["ls", str(FIXTURES / "megatron-lm" / "gpt-tp2-pp2")])
    assert result.exit_code == 0
    name, step, topology, _, _, how = result.stdout.splitlines()[0].split("\t")
    assert (name, step, topology, how) == ("gpt-tp2-pp2", "step 3", "tp=2 pp=2 dp=1 zero=0", "(read through the megatron adapter)")


@pytest.mark.parametrize("command", ["diff", "reshard", "export"])
def test_the_commands_that_write_or_compare_name_the_convert_that_brings_it_in(command: str, tmp_path: Path) -> None:
    src = str(FIXTURES / "deepspeed" / "zero2-fp32")
    args = {"diff": ["diff", src, src], "reshard": ["reshard", src, str(tmp_path / "out"), "--dp", "2"],
            "export": ["export", src, str(tmp_path / "out"), "--format", "hf"]}[command]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"ckptkit: error: {src}: a DeepSpeed save, not a ckptkit checkpoint; bring it in with "
                                          f"`ckptkit convert {src} DST`"]
    assert not (tmp_path / "out").exists()


def test_a_converted_checkpoint_shows_where_it_came_from(converted: dict[str, Path]) -> None:
    lines = ckptkit.inspect(converted["megatron-lm/gpt-tp2-pp2"]).render().splitlines()
    assert lines[2].startswith("topology    world 1 = ")
    assert lines[3] == (f"source      megatron at {(FIXTURES / 'megatron-lm' / 'gpt-tp2-pp2' / 'iter_0000003').resolve()}, "
                        "world 4 = tp 2 x pp 2 x dp 1 x cp 1, ep 1, zero 0")
