"""The ``ckptkit`` command: exit codes, one-line errors without tracebacks, JSON that matches its schema."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from ckptkit.cli import cli
from ckptkit.ops.inspect import InspectReport
from ckptkit.ops.listing import ListingReport
from ckptkit.ops.verify import VerifyReport
from .conftest import cli_schema

REPO = Path(__file__).resolve().parents[1]
GOLDEN_V1 = REPO / "fixtures" / "v1"
CORRUPT = REPO / "fixtures" / "corrupt"
SCHEMAS = REPO / "schemas" / "cli"
MODELS = {"verify": VerifyReport, "inspect": InspectReport, "ls": ListingReport}


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _assert_one_line_error(stderr: str) -> None:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ckptkit: error: ")
    assert "Traceback" not in stderr


def _assert_matches_schema(text: str, command: str) -> None:
    """Validate a command's JSON output against its published schema (with pydantic where jsonschema is absent)."""
    schema = cli_schema(command)
    doc = json.loads(text)
    try:
        import jsonschema
    except ImportError:
        MODELS[command].model_validate_json(text)  # the model the published schema is generated from
        assert set(schema["required"]) <= set(doc) <= set(schema["properties"])
    else:
        jsonschema.validate(doc, schema)


@pytest.fixture
def root_with_leftovers(tmp_path: Path) -> Path:
    """Return a root holding the golden checkpoint, an interrupted save's temp dir and a dir with no manifest."""
    root = tmp_path / "ckpts"
    shutil.copytree(GOLDEN_V1, root, symlinks=True)
    (root / ".step_00000009.tmp-abc123").mkdir()
    (root / ".step_00000009.tmp-abc123" / "rank00000.safetensors").write_bytes(b"\0" * 8)
    (root / "step_00000007").mkdir()
    (root / "step_00000007" / "rank00000.safetensors").write_bytes(b"\0" * 8)
    return root


# --- missing paths and user mistakes: one line on stderr, no traceback, the documented code -----


def test_verify_of_missing_path_exits_2_with_one_line_error(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("verify", str(tmp_path / "nothing-here"))
    assert proc.returncode == 2
    _assert_one_line_error(proc.stderr)
    assert "no such checkpoint" in proc.stderr


def test_inspect_of_missing_path_exits_2_with_one_line_error(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("inspect", str(tmp_path / "nothing-here"))
    assert proc.returncode == 2
    _assert_one_line_error(proc.stderr)
    assert "no such checkpoint" in proc.stderr


def test_ls_of_missing_root_exits_2_with_one_line_error(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("ls", str(tmp_path / "nothing-here"))
    assert proc.returncode == 2
    _assert_one_line_error(proc.stderr)
    assert "no such directory" in proc.stderr


def test_verify_of_missing_path_directly_under_filesystem_root_exits_2(run_ckptkit: Any) -> None:
    proc = run_ckptkit("verify", f"/ckptkit-no-such-checkpoint-{uuid.uuid4().hex}")
    assert proc.returncode == 2
    assert "no such checkpoint" in proc.stderr


def test_inspect_of_malformed_manifest_exits_1_with_one_line_error(run_ckptkit: Any) -> None:
    proc = run_ckptkit("inspect", str(CORRUPT / "malformed_json"))
    assert proc.returncode == 1
    _assert_one_line_error(proc.stderr)
    assert "not valid JSON" in proc.stderr


def test_unknown_command_exits_2_without_traceback(run_ckptkit: Any) -> None:
    proc = run_ckptkit("frobnicate")
    assert proc.returncode == 2
    assert "No such command 'frobnicate'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_argument_exits_2() -> None:
    result = _invoke("verify")
    assert result.exit_code == 2
    assert "Missing argument 'PATH'" in result.stderr


def test_out_of_range_option_exits_2() -> None:
    result = _invoke("verify", "--workers", "0", str(GOLDEN_V1))
    assert result.exit_code == 2
    assert "--workers" in result.stderr


# --- verify and inspect of the golden checkpoint -------------------------------------------------


def test_verify_of_sound_checkpoint_exits_0_and_says_sound() -> None:
    result = _invoke("verify", str(GOLDEN_V1))
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        f"{GOLDEN_V1 / 'step_00000005'}: sound (5 files, 7 tensors; sizes, headers, tiling, checksums)"
    ]


def test_verify_json_matches_published_schema() -> None:
    result = _invoke("verify", "--json", str(GOLDEN_V1))
    assert result.exit_code == 0
    _assert_matches_schema(result.stdout, "verify")
    assert json.loads(result.stdout)["ok"] is True


def test_verify_json_of_corrupt_checkpoint_matches_schema_and_exits_1() -> None:
    result = _invoke("verify", "--json", str(CORRUPT / "flipped_byte"))
    assert result.exit_code == 1
    _assert_matches_schema(result.stdout, "verify")
    assert [f["code"] for f in json.loads(result.stdout)["findings"]] == ["checksum"]


def test_inspect_json_matches_published_schema() -> None:
    result = _invoke("inspect", "--json", str(GOLDEN_V1))
    assert result.exit_code == 0
    _assert_matches_schema(result.stdout, "inspect")
    assert json.loads(result.stdout)["step"] == 5


# --- ls --------------------------------------------------------------------------------------


def test_ls_json_matches_published_schema(root_with_leftovers: Path) -> None:
    result = _invoke("ls", "--json", str(root_with_leftovers))
    assert result.exit_code == 0
    _assert_matches_schema(result.stdout, "ls")
    assert [c["name"] for c in json.loads(result.stdout)["checkpoints"]] == ["step_00000005"]


def test_ls_marks_the_latest_checkpoint(root_with_leftovers: Path) -> None:
    result = _invoke("ls", str(root_with_leftovers))
    assert result.exit_code == 0
    assert "step_00000005\tstep 5\ttp=1 pp=1 dp=1 zero=0\t1.7 KiB\t2025-01-01T00:00:00+00:00\t<- latest" in result.stdout.splitlines()


def test_ls_names_an_interrupted_save_as_leftover(root_with_leftovers: Path) -> None:
    result = _invoke("ls", str(root_with_leftovers))
    assert ".step_00000009.tmp-abc123\tleftover: uncommitted save of step_00000009" in result.stdout.splitlines()


def test_ls_names_a_directory_of_payloads_without_manifest_as_leftover(root_with_leftovers: Path) -> None:
    result = _invoke("ls", str(root_with_leftovers))
    assert "step_00000007\tleftover: no manifest.json (an interrupted save)" in result.stdout.splitlines()
