"""``ckptkit layout check|show`` and ``reshard --layout``: a layout with mistakes is refused line by line, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.layouts import reference_llama

LLAMA = dict(vocab_size=98, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=4)
CLI = [sys.executable, "-m", "ckptkit.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=120, check=False)


def _mistaken_file(tmp_path: Path) -> Path:
    doc = reference_llama(LLAMA).to_json()
    doc["units"][1]["params"][1]["tp"]["dim"] = 2  # q, k, v: dim out of range
    doc["units"][1]["params"][4]["parts"][0]["length"] = 100  # gate: partitions do not add up
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return path


def test_layout_check_lists_every_mistake_one_per_line_and_exits_1(tmp_path: Path) -> None:
    bad = _mistaken_file(tmp_path)
    done = _run("layout", "check", str(bad))
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and len(lines) == 4 and done.stdout == ""
    assert all(line.startswith(f"ckptkit: error: {bad}: ") for line in lines)
    assert "dim 2 is out of range for 'layers.{layer}.attn.q.weight'" in lines[0]
    assert "partitions along dim 0 add up to 100, not its size 128" in lines[3]


def test_layout_check_with_a_topology_names_heads_not_divisible_by_tp(tmp_path: Path) -> None:
    good = tmp_path / "llama.json"
    good.write_text(json.dumps(reference_llama(LLAMA).to_json()))
    assert _run("layout", "check", str(good)).stdout.strip() == f"{good}: sound (llama: 39 tensors, 4 layers)"
    done = _run("layout", "check", str(good), "--tp", "3", "--pp", "3")
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and lines[0] == f"ckptkit: error: {good}: 8 attention heads are not divisible by tp 3"
    assert lines[1] == f"ckptkit: error: {good}: 4 key/value heads are not divisible by tp 3"
    assert lines[-1] == f"ckptkit: error: {good}: 4 layers are not divisible by pp 3"


def test_layout_by_name_is_built_for_the_model_config_the_checkpoint_records(tmp_path: Path) -> None:
    src = tmp_path / "run" / "step_00000005"
    _save_llama(src, recorded=False)
    dst = tmp_path / "out" / "step_00000005"
    done = _run("reshard", str(src), str(dst), "--tp", "2", "--layout", "llama")
    assert done.returncode == 0, done.stderr
    assert ckptkit.read_manifest(str(dst)).layout == reference_llama(LLAMA).to_json()
    ckptkit.save({"model": {"w": torch.ones(3)}}, str(tmp_path / "bare"), step=1)
    for value, says in [("llama", f"--layout llama: built for the model config {tmp_path / 'bare'} records: "),
                        ("no-such", "--layout no-such: no such layout file, and not a built-in layout (built in: ")]:
        done = _run("reshard", str(tmp_path / "bare"), str(tmp_path / "out2"), "--tp", "2", "--layout", value)
        assert done.returncode == 1 and done.stderr.startswith(f"ckptkit: error: {says}"), done.stderr
        assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "out2").exists()


def _save_llama(path: Path, *, recorded: bool = True) -> None:
    """The reference Llama's state, its layout recorded (or, not `recorded`, only its model config)."""
    torch.manual_seed(0)
    layout = reference_llama(LLAMA)
    state: dict = {"model": {}, "optimizer": {"exp_avg": {}}}
    for name, shape in layout.tensors().items():
        state["model"][name] = torch.randn(shape)
        full = torch.randn(shape)
        half = shape[0] // 2  # held as two row halves, as two ZeRO ranks would
        state["optimizer"]["exp_avg"][name] = [ShardedTensor(full[:half].clone(), shape, (0,) * len(shape)),
                                               ShardedTensor(full[half:].clone(), shape, (half,) + (0,) * (len(shape) - 1))]
    if recorded:
        ckptkit.save(state, str(path), step=5, layout=layout)
    else:
        ckptkit.save(state, str(path), step=5, info=ckptkit.CheckpointInfo(model=ckptkit.ModelInfo(family="mine", config=LLAMA)))


def test_reshard_with_a_mistaken_layout_file_exits_1_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "run" / "step_00000005"
    _save_llama(src)
    bad = _mistaken_file(tmp_path)
    done = _run("reshard", str(src), str(tmp_path / "out" / "step_00000005"), "--tp", "2", "--layout", str(bad))
    lines = done.stderr.splitlines()
    assert done.returncode == 1 and lines[0] == f"ckptkit: error: {bad}: 4 problem(s) in the layout:"
    assert len(lines) == 5 and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_layout_show_prints_the_recorded_layout_and_reshard_records_it(tmp_path: Path) -> None:
    src = tmp_path / "run" / "step_00000005"
    _save_llama(src)
    shown = _run("layout", "show", str(src))
    assert shown.returncode == 0 and json.loads(shown.stdout) == reference_llama(LLAMA).to_json()
    dst = tmp_path / "out" / "step_00000005"
    done = _run("reshard", str(src), str(dst), "--tp", "2", "--dp", "2", "--zero", "1")
    assert done.returncode == 0, done.stderr
    assert ckptkit.read_manifest(str(dst)).layout == reference_llama(LLAMA).to_json()
    assert _run("diff", str(src), str(dst)).returncode == 0


def test_layout_show_of_a_checkpoint_without_a_layout_exits_1(tmp_path: Path) -> None:
    ckptkit.save({"model": {"w": torch.ones(3)}}, str(tmp_path / "c"), step=1)
    done = _run("layout", "show", str(tmp_path / "c"))
    assert done.returncode == 1 and "records no layout and names no model" in done.stderr
    assert len(done.stderr.splitlines()) == 1
