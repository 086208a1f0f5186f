"""The example of a user's own model: saved with its layout at tp 2, resharded offline both ways, exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptkit

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "ckptkit.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*args], capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
                          env=dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]))
    assert done.returncode == 0, done.stderr
    return done


def _payloads(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def test_own_model_example_reshards_to_two_topologies_and_back_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "own"
    done = _run(sys.executable, str(REPO / "examples" / "own_model.py"), str(out))
    assert "all 13 tensors and their Adam moments are equal" in done.stdout
    src = out / "tp2" / "step_00000001"
    assert json.loads((out / "layout.json").read_text()) == ckptkit.read_manifest(str(src)).layout
    targets = {"tp1": out / "tp1" / "step_00000001", "tp4-dp2-z1": tmp_path / "tp4" / "step_00000001"}
    _run(*CLI, "reshard", str(src), str(targets["tp4-dp2-z1"]), "--tp", "4", "--dp", "2", "--zero", "1")
    assert ckptkit.read_manifest(str(targets["tp4-dp2-z1"])).topology.world_size == 8
    for name, target in targets.items():
        assert _run(*CLI, "diff", str(src), str(target)).stdout.strip().startswith("equal"), name
        back = tmp_path / f"back-{name}" / "step_00000001"
        _run(*CLI, "reshard", str(target), str(back), "--tp", "2")
        assert _payloads(back) == _payloads(src), name  # A -> B -> A: the same payload files, byte for byte
