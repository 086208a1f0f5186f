"""Long commands show progress on a terminal and nothing when piped (or with --json)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.layouts import Layout, Param, StateGroup, TensorPart, TPCut, Unit

from .conftest import _run_in_pty as _in_pty
from .conftest import cli_schema

SCHEMAS = Path(__file__).resolve().parents[1] / "schemas" / "cli"
LABELS = {"verify": "hashing", "diff": "comparing", "reshard": "resharding", "export": "exporting", "convert": "converting"}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A checkpoint with a layout file, a second one for diff, and a torch DCP save for convert."""
    root = tmp_path_factory.mktemp("progress")
    w = torch.arange(6 * 256, dtype=torch.float32).reshape(6, 256)
    halves = [ShardedTensor(w[:3].clone(), (6, 256), (0, 0)), ShardedTensor(w[3:].clone(), (6, 256), (3, 0))]
    ckptkit.save({"model": {"w": halves}}, root / "a" / "step_1", step=1)
    ckptkit.save({"model": {"w": w + 1}}, root / "b" / "step_1", step=1)
    param = Param(name="w", parts=(TensorPart(tensor="w", shape=(6, 256)),), tp=TPCut(dim=0))
    layout = Layout(name="toy", units=(Unit(name="w", place="first", params=(param,)),), states=(StateGroup(prefix="model", role="param"),))
    (root / "layout.json").write_text(json.dumps(layout.to_json()))
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a save of one process, without a process group
        dcp.save({"model": {"w": w}}, checkpoint_id=str(root / "dcp"))
    return {"root": root, "a": root / "a" / "step_1", "b": root / "b" / "step_1"}


def _args(command: str, work: dict[str, Path], out: str) -> list[str]:
    root = work["root"]
    return {
        "verify": ["verify", str(work["a"])],
        "diff": ["diff", str(work["a"]), str(work["b"])],
        "reshard": ["reshard", str(work["a"]), str(root / out / "step_1"), "--tp", "3", "--layout", str(root / "layout.json")],
        "export": ["export", str(work["a"]), str(root / out), "--format", "zarr"],
        "convert": ["convert", str(root / "dcp"), str(root / out)],
    }[command]


@pytest.mark.parametrize("command", sorted(LABELS))
def test_a_long_command_shows_progress_on_a_terminal(command: str, work: dict[str, Path]) -> None:
    code, _, terminal = _in_pty(*_args(command, work, f"tty-{command}"))
    assert code in (0, 1), terminal  # diff of two different checkpoints exits 1
    assert f"{LABELS[command]}  [" in terminal and "100%" in terminal, terminal  # click's bar: label  [####]  100%
    # its label before anything else of the work (before torch imports), the bar drawn over it
    assert terminal.replace("\r\n", "\n").split("\r")[0].splitlines()[-1] == f"{LABELS[command]} ...", terminal


@pytest.mark.parametrize("command", sorted(LABELS))
def test_a_long_command_piped_shows_no_progress(command: str, work: dict[str, Path], run_ckptkit: Any) -> None:
    proc = run_ckptkit(*_args(command, work, f"piped-{command}"))
    assert proc.returncode in (0, 1), proc.stderr
    assert f"{LABELS[command]}  [" not in proc.stderr and "%" not in proc.stderr


@pytest.mark.parametrize("command", sorted(LABELS))
def test_json_on_a_terminal_shows_no_progress_and_matches_its_schema(command: str, work: dict[str, Path]) -> None:
    code, out, terminal = _in_pty(*_args(command, work, f"json-{command}"), "--json")
    assert code in (0, 1), terminal
    jsonschema.validate(json.loads(out), cli_schema(command))
    assert f"{LABELS[command]}  [" not in terminal and "%" not in terminal


def test_a_warning_while_the_label_shows_gets_its_own_line(capsys: pytest.CaptureFixture[str]) -> None:
    from ckptkit.cli.base import progress

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *_a, **_k: print(f"warning: {message}", file=sys.stderr)  # as on stderr
        before = warnings.showwarning
        with progress("exporting", True) as update:
            warnings.warn("a tensor is odd", UserWarning, stacklevel=1)
            assert update is not None
        assert warnings.showwarning is before  # put back when the work ends
    err = capsys.readouterr().err
    # the label cleared, the warning on its own line, the label again; no bar came: cleared at the end
    assert err == "exporting ...\r\033[Kwarning: a tensor is odd\nexporting ...\r\033[K"
