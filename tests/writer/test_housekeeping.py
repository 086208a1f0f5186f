"""ckptkit clean and ckptkit prune: dry runs change nothing; real runs remove only what they
name; a checkpoint a live read lease holds survives; leases leave no empty folders."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import ckptkit
from ckptkit.storage import open_storage
from ckptkit.io import leases
from ..conftest import cli_schema

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas" / "cli"


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(proc.stdout)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1-5 committed (latest 5), an interrupted save, payloads without manifest, an HF-like
    directory, a stale lease and an empty lease folder."""
    root = tmp_path / "run"
    for step in range(1, 6):
        ckptkit.save({"w": torch.full((2,), float(step))}, root / f"step_{step:08d}", step=step)
    (root / ".step_00000006.tmp-abc123").mkdir()
    (root / ".step_00000006.tmp-abc123" / "rank00000.safetensors").write_bytes(b"\0" * 8)
    (root / "step_00000007").mkdir()
    (root / "step_00000007" / "rank00000.safetensors").write_bytes(b"\0" * 8)
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text("{}")
    (root / "hf" / "model.safetensors").write_bytes(b"\0" * 8)
    stale = root / ".leases" / "step_00000002" / f"{socket.gethostname()}-{_dead_pid()}-0000abcd"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid()}))
    (root / ".leases" / "step_00000003").mkdir()
    return root


def test_clean_dry_run_lists_the_leftovers_and_removes_nothing(root: Path, run_ckptkit: Any) -> None:
    before = _tree(root)
    proc = run_ckptkit("clean", str(root), "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, cli_schema("clean"))
    assert [r["name"] for r in doc["removed"]] == [".step_00000006.tmp-abc123", "step_00000007"]
    assert doc["stale_leases"] == 1 and doc["dry_run"] is True
    assert _tree(root) == before


def test_clean_removes_leftovers_and_stale_leases_and_nothing_else(root: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("clean", str(root))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"{root}: removed 2 leftover(s) and 1 stale lease(s)"
    assert sorted(p.name for p in root.iterdir()) == [".leases", "hf", "latest", "step_00000001", "step_00000002",
                                                      "step_00000003", "step_00000004", "step_00000005"]
    assert list((root / ".leases").iterdir()) == []  # the stale lease and the empty lease folders are gone
    assert all(ckptkit.verify(root / f"step_{s:08d}").ok for s in range(1, 6))
    assert (root / "hf" / "model.safetensors").exists()


def test_clean_keeps_a_leftover_a_live_lease_holds(root: Path) -> None:
    storage = open_storage(root)
    (root / "step_00000007" / "manifest.json").write_text("{}")  # lease() needs a manifest to take the lease
    with leases.lease(storage, "step_00000007"):
        (root / "step_00000007" / "manifest.json").unlink()  # then the checkpoint loses it: a leftover, being read
        report = ckptkit.clean(root)
    assert report.busy == ["step_00000007"]
    assert (root / "step_00000007" / "rank00000.safetensors").exists()
    assert not (root / ".step_00000006.tmp-abc123").exists()


def test_clean_of_a_checkpoint_directory_is_refused(root: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("clean", str(root / "step_00000001"))
    assert proc.returncode != 0
    assert proc.stderr.splitlines() == [f"ckptkit: error: {root / 'step_00000001'}: not a root of checkpoints (checkpoint); "
                                        "clean the root that holds it"]
    assert (root / "step_00000001" / "manifest.json").exists()


def test_a_released_lease_leaves_no_empty_folder(root: Path) -> None:
    with leases.lease(open_storage(root), "step_00000004"):
        assert len(list((root / ".leases" / "step_00000004").iterdir())) == 1
    assert not (root / ".leases" / "step_00000004").exists()


def test_prune_dry_run_lists_and_deletes_nothing(root: Path, run_ckptkit: Any) -> None:
    before = _tree(root)
    proc = run_ckptkit("prune", str(root), "--keep-last", "2", "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, cli_schema("prune"))
    assert [e["name"] for e in doc["removed"]] == ["step_00000001", "step_00000002", "step_00000003"]
    assert doc["removed"][0]["reason"] == "not among the newest 2"
    assert _tree(root) == before


def test_prune_deletes_what_the_policy_does_not_keep(root: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("prune", str(root), "--keep-last", "2", "--keep-every", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["deleted step_00000001\tnot among the newest 2 nor a step divisible by 2",
                                       "deleted step_00000003\tnot among the newest 2 nor a step divisible by 2", f"{root}: deleted 2 checkpoint(s), 3 kept"]
    assert [c.name for c in ckptkit.list_checkpoints(root).checkpoints] == ["step_00000002", "step_00000004", "step_00000005"]


def test_prune_keeps_a_checkpoint_a_live_lease_holds(root: Path) -> None:
    with leases.lease(open_storage(root), "step_00000001"):
        report = ckptkit.prune(root, keep_last=1)
        assert ckptkit.verify(root / "step_00000001").ok
    assert [e.name for e in report.removed] == ["step_00000002", "step_00000003", "step_00000004"]
    assert report.busy == ["step_00000001"]
    assert [c.name for c in ckptkit.list_checkpoints(root).checkpoints] == ["step_00000001", "step_00000005"]


def test_prune_never_deletes_the_checkpoint_latest_names(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ckptkit.save({"w": torch.ones(2)}, tmp_path / f"s{step}", step=step, update_latest=step == 1)
    report = ckptkit.prune(tmp_path, keep_last=1)
    assert [e.name for e in report.removed] == ["s2"] and report.kept == ["s1", "s3"]
