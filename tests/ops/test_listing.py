"""ckptkit ls: checkpoints with their details, other directories named for what they are, only
interrupted saves as leftovers, and a warning when latest names nothing."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import cli
from ckptkit.io.kinds import classify
from ckptkit.trainer.train import config_from, launch, prepare
from ..conftest import cli_schema

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas" / "cli"


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A trainer's root (steps 1 and 2) holding an HF export, a DCP export, a torch DCP save, a
    stray directory, an interrupted save and a directory of payloads without manifest."""
    root = tmp_path_factory.mktemp("ls") / "run"
    cfg = config_from(steps=2, save_every=1, out=str(root))
    launch(cfg, prepare(cfg))
    ckptkit.export(root / "step_00000002", root / "hf-2", format="hf")
    ckptkit.export(root / "step_00000002", root / "dcp-2", format="dcp")
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a save of one process, without a process group
        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(root / "torch-dcp"))
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("mine")
    (root / ".step_00000003.tmp-0a1b2c").mkdir()
    (root / ".step_00000003.tmp-0a1b2c" / "rank00000.safetensors").write_bytes(b"\0" * 8)
    (root / "step_00000009").mkdir()
    (root / "step_00000009" / "rank00000.safetensors").write_bytes(b"\0" * 8)
    return root


def test_ls_lists_checkpoints_with_step_topology_size_time_and_latest(run_root: Path) -> None:
    report = ckptkit.list_checkpoints(run_root)
    assert [(c.name, c.step, c.is_latest) for c in report.checkpoints] == [("step_00000001", 1, False), ("step_00000002", 2, True)]
    for c in report.checkpoints:
        manifest = ckptkit.read_manifest(run_root / c.name)
        assert (c.topology, c.payload_bytes, c.created_at) == (manifest.topology, sum(f.size for f in manifest.files), manifest.created_at)
    assert report.run is not None and report.run.model == "llama tiny"


def test_ls_names_exports_and_other_tools_checkpoints_for_what_they_are(run_root: Path) -> None:
    report = ckptkit.list_checkpoints(run_root)
    assert {o.name: o.kind for o in report.others} == {"hf-2": "hf-export", "dcp-2": "dcp-export", "torch-dcp": "dcp",
                                                      "notes": "unknown"}


def test_ls_calls_only_interrupted_saves_leftovers(run_root: Path) -> None:
    report = ckptkit.list_checkpoints(run_root)
    assert [(left.name, left.reason) for left in report.leftovers] == [
        (".step_00000003.tmp-0a1b2c", "uncommitted save of step_00000003"),
        ("step_00000009", "no manifest.json (an interrupted save)"),
    ]


def test_ls_text_shows_details_kinds_and_leftovers(run_root: Path) -> None:
    result = CliRunner().invoke(cli, ["ls", str(run_root)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    latest = next(line for line in lines if line.startswith("step_00000002\t"))
    assert latest.startswith("step_00000002\tstep 2\ttp=1 pp=1 dp=1 zero=0\t") and latest.endswith("\t<- latest")
    assert "hf-2\thf-export: a Hugging Face model directory written by ckptkit export" in lines
    assert "step_00000009\tleftover: no manifest.json (an interrupted save)" in lines
    assert not any(line.startswith(("run.json", "latest", ".leases")) for line in lines)


def test_ls_of_a_checkpoint_directory_says_so_instead_of_calling_its_files_leftovers(run_root: Path) -> None:
    result = CliRunner().invoke(cli, ["ls", str(run_root / "step_00000001")])
    assert result.exit_code == 0
    assert result.stdout.splitlines()[0].startswith("step_00000001\tstep 1\t")
    assert "leftover" not in result.output
    assert result.stderr.splitlines() == [
        f"ckptkit: warning: {run_root / 'step_00000001'} is a committed ckptkit checkpoint, not a root of checkpoints; "
        "ckptkit inspect it, or ckptkit ls its parent"
    ]
    assert ckptkit.list_checkpoints(run_root / "step_00000001").kind == "checkpoint"


def test_ls_of_an_export_says_so_and_lists_it_read_through_its_adapter(run_root: Path) -> None:
    report = ckptkit.list_checkpoints(run_root / "hf-2")
    assert (report.kind, report.leftovers) == ("hf-export", [])
    assert [(c.name, c.step, c.read_through) for c in report.checkpoints] == [("hf-2", 0, "hf")]


def test_ls_warns_when_latest_names_a_checkpoint_that_is_gone(tmp_path: Path) -> None:
    for step in (1, 2):
        ckptkit.save({"w": torch.ones(2)}, tmp_path / f"step_{step}", step=step)
    (tmp_path / "step_2" / "manifest.json").unlink()
    result = CliRunner().invoke(cli, ["ls", str(tmp_path)])
    assert result.exit_code == 0
    assert ("ckptkit: warning: latest names step_2, which is not a committed checkpoint here: "
            "--resume latest fails until a new save moves it") in result.stderr.splitlines()


def test_ls_json_has_null_latest_and_matches_its_schema(tmp_path: Path) -> None:
    ckptkit.save({"w": torch.ones(2)}, tmp_path / "step_1", step=1, update_latest=False)
    result = CliRunner().invoke(cli, ["ls", "--json", str(tmp_path)])
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, cli_schema("ls"))
    assert doc["latest"] is None and doc["run"] is None
    assert doc["warnings"] == ["no latest pointer, though 1 checkpoint(s) are committed: resume one by its path"]


@pytest.mark.parametrize(("names", "kind"), [
    (["manifest.json", "rank00000.safetensors"], "checkpoint"),
    (["config.json", "model.safetensors", "export_report.json"], "hf-export"),
    (["export_report.json", "latest_universal", "global_step4_universal/"], "deepspeed-export"),
    (["export_report.json", "common.pt", "metadata.json", ".metadata", "__0_0.distcp"], "megatron-export"),
    (["export_report.json", ".metadata", "__0_0.distcp"], "dcp-export"),
    (["adapter_config.json", "adapter_model.safetensors", "README.md"], "peft"),
    (["adapter_config.json", "adapter_model.safetensors", "export_report.json"], "peft-export"),
    (["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"], "hf"),
    ([".metadata", "__0_0.distcp"], "dcp"),
    (["latest", "global_step10/", "zero_to_fp32.py"], "deepspeed"),
    (["latest_checkpointed_iteration.txt", "iter_0000010/"], "megatron"),
    (["latest", "step_00000010/"], "run-root"),
    (["rank00000.safetensors"], "leftover"),
    (["notes.txt"], "unknown"),
])
def test_classify_names_a_directory_from_what_it_holds(names: list[str], kind: Any) -> None:
    assert classify(names) == kind


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.mark.parametrize(("path", "what"), [
    ("deepspeed/zero2-fp32", "a DeepSpeed save"), ("megatron/gpt-tp2-dp2", "a Megatron save"),
    ("megatron-lm/gpt-tp2-pp2", "a Megatron save"), ("dcp-nodist", "a torch.distributed.checkpoint (DCP) directory"),
])
def test_a_command_given_another_tools_checkpoint_says_what_it_is_and_how_to_bring_it_in(path: str, what: str) -> None:
    src = str(FIXTURES / path)
    result = CliRunner().invoke(cli, ["diff", src, src])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"ckptkit: error: {src}: {what}, not a ckptkit checkpoint; bring it in with "
                                          f"`ckptkit convert {src} DST`"]
    with pytest.raises(ckptkit.ForeignCheckpointError) as raised:
        ckptkit.open(src)
    assert (raised.value.kind, raised.value.path, str(raised.value)) == (path.split("/")[0].split("-")[0], src,
                                                                         result.stderr.splitlines()[0].removeprefix("ckptkit: error: "))
