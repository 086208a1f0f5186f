"""The CLI contract across commands: one exit code per mistake, one-line errors, an error object
with --json, a schema for every --json output, summaries instead of endless lines."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.schemas import CLI_REPORTS
from .conftest import cli_schema

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas" / "cli"
GOLDEN_V1 = Path(__file__).resolve().parents[1] / "fixtures" / "v1"
DOCS = Path(__file__).resolve().parents[1] / "docs"

# Each command given a path that holds nothing (the same mistake): exit 2.
MISSING = {
    "ls": ["ls", "{p}"],
    "inspect": ["inspect", "{p}"],
    "verify": ["verify", "{p}"],
    "diff": ["diff", "{p}", "{p}"],
    "reshard": ["reshard", "{p}", "{p}-out", "--tp", "2"],
    "export": ["export", "{p}", "{p}-out"],
    "clean": ["clean", "{p}"],
    "convert": ["convert", "{p}", "{p}-out"],
    "convert --from": ["convert", "{p}", "{p}-out", "--from", "deepspeed"],
    "prune": ["prune", "{p}", "--keep-last", "1"],
    "compact": ["compact", "{p}"],
    "flush": ["flush", "{p}", "{p}-root"],
}


def _schema(name: str) -> dict[str, Any]:
    return cli_schema(name)


def _one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptkit: error: ") and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("command", sorted(MISSING))
def test_a_path_that_holds_nothing_exits_2_everywhere(command: str, tmp_path: Path, run_ckptkit: Any) -> None:
    args = [a.format(p=tmp_path / "nothing") for a in MISSING[command]]
    proc = run_ckptkit(*args)
    assert proc.returncode == 2, proc.stderr
    _one_line(proc.stderr)
    assert proc.stdout == ""


@pytest.mark.parametrize("command", sorted(MISSING))
def test_a_failing_command_with_json_prints_an_error_object(command: str, tmp_path: Path, run_ckptkit: Any) -> None:
    args = [a.format(p=tmp_path / "nothing") for a in MISSING[command]] + ["--json"]
    proc = run_ckptkit(*args)
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, _schema("error"))
    assert (doc["ok"], doc["error"], doc["exit_code"]) == (False, "CheckpointNotFoundError", proc.returncode)
    assert _one_line(proc.stderr) == f"ckptkit: error: {doc['message']}"


def test_bad_usage_is_one_line_and_an_error_object_with_json(run_ckptkit: Any) -> None:
    proc = run_ckptkit("verify", "--json")
    assert proc.returncode == 2
    assert _one_line(proc.stderr) == "ckptkit: error: Missing argument 'PATH' (see 'ckptkit verify --help')"
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, _schema("error"))
    assert doc["error"] == "UsageError"


def test_options_that_do_not_go_together_exit_2(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("export", str(GOLDEN_V1), str(tmp_path / "out"), "--format", "zarr", "--dtype", "bf16")
    assert proc.returncode == 2
    assert _one_line(proc.stderr) == "ckptkit: error: --dtype: the zarr form keeps every tensor in its saved dtype"
    assert not (tmp_path / "out").exists()


def test_diff_json_matches_its_schema_and_keeps_limit(tmp_path: Path, run_ckptkit: Any) -> None:
    for name, value in (("a", 1.0), ("b", 2.0)):
        ckptkit.save({"model": {f"t{i}": torch.full((3,), value * (i + 1)) for i in range(4)}}, tmp_path / name, step=1)
    proc = run_ckptkit("diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json", "--limit", "2")
    assert proc.returncode == 1
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, _schema("diff"))
    assert (len(doc["differences"]), doc["differences_total"], doc["ok"]) == (2, 4, False)
    assert [d["name"] for d in doc["differences"]] == ["model/t3", "model/t2"]  # the largest first


def test_convert_json_matches_its_schema(tmp_path: Path, run_ckptkit: Any) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a save of one process, without a process group
        dcp.save({"model": {"w": torch.arange(6.0)}}, checkpoint_id=str(tmp_path / "dcp"))
    proc = run_ckptkit("convert", str(tmp_path / "dcp"), str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), _schema("convert"))


def test_ls_json_of_a_root_matches_its_schema_with_null_latest(tmp_path: Path, run_ckptkit: Any) -> None:
    ckptkit.save({"w": torch.ones(2)}, tmp_path / "step_1", step=1, update_latest=False)
    proc = run_ckptkit("ls", str(tmp_path), "--json")
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, _schema("ls"))
    assert doc["latest"] is None


def test_a_load_mismatch_is_summarized_in_one_short_line(tmp_path: Path) -> None:
    ckptkit.save({"model": {f"w{i}": torch.zeros(4, 4) for i in range(40)}}, tmp_path / "c", step=1)
    target = {"model": {f"w{i}": ShardedTensor(torch.zeros(2, 8), (2, 8), (0, 0)) for i in range(40)}}
    with pytest.raises(ckptkit.LayoutError) as info:
        ckptkit.load(tmp_path / "c", target)
    message = str(info.value)
    assert "40 problem(s)" in message and message.endswith("; and 30 more")
    assert len(message) < 10 * 300 + 200 and "\n" not in message


def test_help_says_what_the_demo_runs(run_ckptkit: Any) -> None:
    for args in (["--help"], ["demo", "--help"]):
        proc = run_ckptkit(*args)
        assert proc.returncode == 0
        assert "4 ranks" not in proc.stdout
    assert "8 ranks" in run_ckptkit("demo", "--help").stdout


@pytest.mark.multiprocess
def test_a_failing_trainer_rank_is_one_line_without_torch_noise(tmp_path: Path, run_ckptkit: Any) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_ckptkit("train", "--dp", "2", "--steps", "1", "--out", str(tmp_path / "run"), "--quiet",
                       "--log-jsonl", str(blocker / "log.jsonl"))
    assert proc.returncode == 1
    line = _one_line("\n".join(line for line in proc.stderr.splitlines() if not line.startswith("ckptkit: train: ")))
    assert line.startswith("ckptkit: error: rank 0 failed: ")
    assert "SIGTERM" not in proc.stderr


def test_verify_text_shows_the_first_problems_and_counts_them_all(tmp_path: Path, run_ckptkit: Any) -> None:
    ckptkit.save({"model": {f"w{i}": torch.zeros(4) for i in range(12)}}, tmp_path / "c", step=1, max_file_bytes=1)
    payloads = sorted((tmp_path / "c").glob("*.safetensors"))
    assert len(payloads) >= 12
    for path in payloads:
        path.write_bytes(path.read_bytes()[:-1])  # every payload truncated
    proc = run_ckptkit("verify", str(tmp_path / "c"))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 11 and all(line.startswith("[") for line in lines[:10])
    assert "problem(s), the first 10 shown (--json lists all)" in lines[-1]
    assert len(json.loads(run_ckptkit("verify", str(tmp_path / "c"), "--json").stdout)["findings"]) >= 12


def test_a_library_warning_is_one_line(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("export", str(GOLDEN_V1), str(tmp_path / "out"), "--format", "zarr")  # schema 1.0: no block checksums
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"ckptkit: warning: {GOLDEN_V1 / 'step_00000005'} was written before block checksums (schema 1.0); partial reads "
        "of its files are not checked (whole-file reads and `ckptkit verify` are)"
    ]


def test_every_command_has_examples_of_itself_and_no_untyped_text_value() -> None:
    from ckptkit.cli.reference import commands, help_text

    assert len(commands()) == 16
    for name, command in commands():
        text = help_text(name, command)
        examples = text.split("Examples:\n", 1)[1].split("\n\n", 1)[0].splitlines() if "Examples:\n" in text else []
        assert examples and all(line.strip().startswith(f"ckptkit {name}") for line in examples), name
        assert " TEXT " not in text, name  # every value says what it is (DIR, FILE, LAYOUT.json|NAME)


def test_convert_and_export_help_name_every_converter_and_format() -> None:
    from ckptkit.cli.reference import commands, help_text
    from ckptkit.ops.convert import list_converters

    helps = {name: " ".join(help_text(name, command, 1000).split()) for name, command in commands()}
    named = helps["convert"].split("--from FORMAT", 1)[1].split("--", 1)[0]
    assert all(re.search(rf"\b{c}\b", named) for c in list_converters()), named
    assert all(f"{f}:" in helps["export"] for f in ckptkit.EXPORT_FORMATS), helps["export"]
    assert all(what in helps["export"].split("Exit 0")[0] for what in ("Trainer", "peft", "zarr", "Megatron", "DeepSpeed", "DCP"))


def test_the_reference_page_is_every_commands_help(run_ckptkit: Any) -> None:
    """The docs site's command reference is made from the commands: each section is what
    ``ckptkit NAME --help`` prints (at the page's width), for every command, in order."""
    import importlib.util

    from ckptkit.cli.reference import WIDTH, commands, help_text

    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec and spec.loader
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.on_page_markdown((DOCS / "cli.md").read_text(encoding="utf-8"), page=None)
    assert hooks.MARK not in page
    sections = re.findall(r"^## `ckptkit ([a-z ]+)`\n\n.*?\n\n```text\n(.*?)\n```$", page, re.S | re.M)
    assert [name for name, _ in sections] == [name for name, _ in commands()]
    assert all(text == help_text(name, command, WIDTH) for (name, text), (_, command) in zip(sections, commands()))
    for name, command in commands()[:2] + commands()[-2:]:  # and help_text is what the command prints
        proc = run_ckptkit(*name.split(), "--help", env={"COLUMNS": "80"})
        assert proc.returncode == 0 and proc.stdout.rstrip("\n") == help_text(name, command, 80), name

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The committed Hugging Face fixtures brought in: a model, a Trainer folder, a peft adapter."""
    root = tmp_path_factory.mktemp("json")
    out = {}
    for name, src in (("llama", "hf/llama"), ("trainer", "hf/trainer/checkpoint-4"), ("lora", "hf/peft-lora")):
        ckptkit.convert(FIXTURES / src, root / name)
        out[name] = root / name
    return out


def _json_runs(converted: dict[str, Path], tmp: Path) -> list[tuple[str, list[str]]]:
    """Every command that prints a --json report, each export format once, on real checkpoints."""
    llama, run = str(converted["llama"]), tmp / "run"
    for step in (1, 2, 3):
        ckptkit.save({"model": {"w": torch.full((4,), float(step)), "frozen": torch.ones(8)}}, run / f"step_{step:08d}",
                     step=step, incremental=True)  # steps 2 and 3 read `frozen` from step 1
    (run / ".step_00000009.tmp-0123456789ab").mkdir()  # a leftover for clean
    with ckptkit.CheckpointManager(tmp / "flushed", memory=ckptkit.MemoryTier(str(tmp / "shm"), node="n0")) as manager:
        manager.save(1, {"w": torch.ones(4)}, tier="memory")  # a memory snapshot for flush
    runs = [("verify", [llama]), ("inspect", [llama, "--tensors"]), ("ls", [str(run)]),
            ("diff", [str(run / "step_00000001"), str(run / "step_00000002")]),
            ("reshard", [llama, str(tmp / "tp2"), "--tp", "2"]),
            ("convert", [str(FIXTURES / "hf" / "llama"), str(tmp / "again")]),
            ("clean", [str(run)]), ("compact", [str(run / "step_00000003")]), ("prune", [str(run), "--keep-last", "1"]),
            ("flush", [str(tmp / "shm" / "n0"), str(tmp / "flushed")])]
    formats = [("hf", llama, []), ("megatron", str(converted["trainer"]), ["--include-optimizer"]), ("deepspeed", str(converted["trainer"]), []),
               ("dcp", llama, []), ("zarr", llama, []), ("peft", str(converted["lora"]), []),
               ("hf-trainer", str(converted["trainer"]), [])]
    runs += [("export", [src, str(tmp / f"out-{fmt}"), "--format", fmt, *more]) for fmt, src, more in formats]
    return runs


def test_every_json_output_validates_against_its_schema(converted: dict[str, Path], tmp_path: Path) -> None:
    """Each command's --json output (each export format's too, and export_report.json on disk) is
    valid against its current schema, and says ok; a failing one prints the error object."""
    from click.testing import CliRunner

    from ckptkit.cli import cli

    seen = set()
    for command, args in _json_runs(converted, tmp_path):
        result = CliRunner().invoke(cli, [command, *args, "--json"])
        assert result.exit_code in (0, 1) and result.exception is None or isinstance(result.exception, SystemExit), (command, args, result.output)
        doc = json.loads(result.stdout)
        jsonschema.validate(doc, cli_schema(command))
        assert doc["ok"] is (result.exit_code == 0), (command, doc)
        if command == "export":
            on_disk = json.loads((Path(args[1]) / "export_report.json").read_text(encoding="utf-8"))
            jsonschema.validate(on_disk, cli_schema("export"))
            assert on_disk["tensors"] == len(on_disk["tensor_list"]) > 0 and on_disk["files"] == len(on_disk["file_list"])
        seen.add(command)
    assert seen == {name for name in CLI_REPORTS if name != "error"}
    failed = CliRunner().invoke(cli, ["convert", str(tmp_path / "nothing"), str(tmp_path / "x"), "--json"])
    jsonschema.validate(json.loads(failed.stdout), cli_schema("error"))
    assert failed.exit_code == 2
