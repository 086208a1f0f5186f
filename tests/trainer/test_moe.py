"""The reference trainer's mixture of experts over real gloo ranks, with expert and context
parallelism: the same losses at every topology, exact resume, resharding at load and offline,
and no expert (or moment of one) lost or repeated on the way."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import warnings

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load

import ckptkit
from ckptkit.boxes import tiling_problems
from ckptkit.manifest import Topology
from ckptkit.manifest.shards import iter_shards
from ckptkit.ops.diff import diff
from ckptkit.ops.reshard import reshard

from .runs import train

pytestmark = pytest.mark.multiprocess

# (tp, pp, dp, zero, cp, ep)
Combo = tuple[int, int, int, int, int, int]
SINGLE: Combo = (1, 1, 1, 0, 1, 1)
EP4: Combo = (1, 1, 4, 1, 1, 4)
STEPS = 6  # saves at 4 and 6; resumes continue from 4
LAYERS, EXPERTS = 2, 8
GROUPS = ("model", "optimizer/exp_avg", "optimizer/exp_avg_sq")


def _name(c: Combo) -> str:
    return "tp{}-pp{}-dp{}-z{}-cp{}-ep{}".format(*c)


def _train(out: Path, c: Combo, steps: int, resume: str | None = None) -> list[dict]:
    tp, pp, dp, zero, cp, ep = c
    return train(out, (tp, pp, dp, zero), steps, resume=resume, model="tiny-moe", cp=cp, ep=ep)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each topology trained once for STEPS steps (cached for the module)."""
    return {"root": tmp_path_factory.mktemp("moe"), "logs": {}}


def _trained(runs: dict, c: Combo) -> tuple[Path, list[dict]]:
    out = runs["root"] / _name(c)
    if c not in runs["logs"]:
        runs["logs"][c] = _train(out, c, STEPS)
    return out, runs["logs"][c]


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * abs(b)


PARALLEL = [(2, 1, 2, 1, 1, 2), (1, 1, 2, 1, 2, 2), (2, 1, 1, 0, 2, 1), EP4, (1, 2, 2, 2, 1, 2), (1, 1, 4, 3, 1, 2)]


@pytest.mark.parametrize("combo", PARALLEL, ids=_name)
def test_every_topology_computes_the_single_process_losses(runs: dict, combo: Combo) -> None:
    _, ref = _trained(runs, SINGLE)
    _, got = _trained(runs, combo)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert _close(got[0]["loss"], ref[0]["loss"])  # step 1
    for a, b in zip(got, ref):
        assert _close(a["loss"], b["loss"], 1e-4), (a["step"], a["loss"], b["loss"])
        assert a["sample_ids"] == b["sample_ids"]


@pytest.mark.parametrize("combo", [(2, 1, 2, 1, 1, 2), (1, 1, 2, 1, 2, 2)], ids=_name)
def test_resume_is_bitwise_exact(runs: dict, combo: Combo, tmp_path: Path) -> None:
    out, full = _trained(runs, combo)
    resumed = _train(tmp_path / "resumed", combo, STEPS, resume=str(out / "step_00000004"))
    assert [r["step"] for r in resumed] == [5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:]]
    assert [r["sample_ids"] for r in resumed] == [r["sample_ids"] for r in full[4:]]
    report = diff(out / "step_00000006", tmp_path / "resumed" / "step_00000006", kinds=("param", "optimizer", "rng"))
    assert report.ok and report.tensors > 0, report.differences[:3]


@pytest.mark.parametrize("target", [(2, 1, 2, 2, 1, 1), (1, 1, 2, 1, 2, 2)], ids=_name)
def test_resume_at_another_topology_continues_the_run(runs: dict, target: Combo, tmp_path: Path) -> None:
    out, full = _trained(runs, EP4)
    resumed = _train(tmp_path / "resumed", target, STEPS, resume=str(out / "step_00000004"))
    assert [r["step"] for r in resumed] == [5, 6]
    for a, b in zip(resumed, full[4:]):
        assert _close(a["loss"], b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["sample_ids"] == b["sample_ids"]  # no sample repeated or skipped
    assert [r["consumed_samples"] for r in resumed] == [r["consumed_samples"] for r in full[4:]]


def _topology(c: Combo) -> Topology:
    tp, pp, dp, zero, cp, ep = c
    return Topology(world_size=tp * pp * dp * cp, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero_stage=zero)


def _payloads(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def test_offline_reshard_across_ep_sizes_round_trips_byte_for_byte(runs: dict, tmp_path: Path) -> None:
    out, _ = _trained(runs, EP4)
    src = out / "step_00000004"
    mid, back = tmp_path / "mid" / "step_00000004", tmp_path / "back" / "step_00000004"
    reshard(src, mid, _topology((2, 1, 2, 2, 1, 2)))
    assert ckptkit.read_manifest(str(mid)).topology == _topology((2, 1, 2, 2, 1, 2))
    assert diff(src, mid).ok  # experts and both moments, every element
    reshard(mid, back, ckptkit.read_manifest(str(src)).topology)
    assert _payloads(back) == _payloads(src)
    assert diff(src, back, kinds=("param", "optimizer", "rng")).ok


def test_cli_reshard_to_ep_and_cp_then_diff_says_equal(runs: dict, tmp_path: Path, run_ckptkit: Callable) -> None:
    out, _ = _trained(runs, EP4)
    dst = tmp_path / "r" / "step_00000004"
    result = run_ckptkit("reshard", str(out / "step_00000004"), str(dst), "--dp", "2", "--ep", "2", "--cp", "2", "--zero", "1")
    assert result.returncode == 0, result.stderr
    assert ckptkit.read_manifest(str(dst)).topology == _topology((1, 1, 2, 1, 2, 2))
    same = run_ckptkit("diff", str(out / "step_00000004"), str(dst))
    assert same.returncode == 0 and "equal" in same.stdout
    bad = run_ckptkit("reshard", str(out / "step_00000004"), str(tmp_path / "x" / "step_00000004"), "--dp", "3", "--ep", "3")
    assert bad.returncode == 1 and "8 experts are not divisible by ep 3" in bad.stderr
    assert "ep 3 does not divide" not in bad.stderr and not (tmp_path / "x" / "step_00000004").exists()


def _expert_names() -> list[str]:
    return [f"layers.{layer}.mlp.experts.{e}.{w}.weight" for layer in range(LAYERS) for e in range(EXPERTS)
            for w in ("gate", "up", "down")]


def _account(path: Path) -> None:
    """Every expert of every layer, parameters and both moments, is in the checkpoint once:
    its shards tile it exactly (no gap, no overlap) and no other tensor claims its name."""
    manifest = ckptkit.read_manifest(str(path))
    experts = {fqn for fqn in manifest.tensors if ".mlp.experts." in fqn}
    want = {f"{group}/{name}" for group in GROUPS for name in _expert_names()}
    assert experts == want, (sorted(want - experts)[:3], sorted(experts - want)[:3])
    for fqn in sorted(want):
        entry = manifest.tensors[fqn]
        boxes = [s.box for s in iter_shards(entry)]
        assert tiling_problems(entry.shape, boxes) == [], fqn


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_no_expert_is_lost_or_repeated_by_save_reshard_and_export(runs: dict, ep: int, tmp_path: Path) -> None:
    out, _ = _trained(runs, (1, 1, 4, 1, 1, ep))
    saved = out / "step_00000006"
    _account(saved)
    other = tmp_path / "resharded" / "step_00000006"
    reshard(saved, other, _topology((2, 1, 2, 2, 1, 1 if ep == 2 else 2)))  # to another EP size
    _account(other)
    assert diff(saved, other).ok
    # The exports: the Hugging Face weights (each expert's once, as saved) and the DCP form (moments too).
    saved_values = ckptkit.load(str(saved))
    hf = tmp_path / "hf"
    ckptkit.export(str(saved), str(hf), format="hf", dtype="fp32", max_shard_bytes=200_000)  # several files
    written: dict[str, list[torch.Tensor]] = {}
    for file in hf.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                written.setdefault(key, []).append(f.get_tensor(key))
    hf_names = {"gate": "w1", "down": "w2", "up": "w3"}
    want = {f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight": (layer, e, ours)
            for layer in range(LAYERS) for e in range(EXPERTS) for ours, w in hf_names.items()}
    assert {k for k in written if ".experts." in k} == set(want)
    for key, (layer, e, ours) in want.items():
        (value,) = written[key]  # once
        assert torch.equal(value, saved_values["model"][f"layers.{layer}.mlp.experts.{e}.{ours}.weight"]), key
    dcp = tmp_path / "dcp"
    ckptkit.export(str(saved), str(dcp), format="dcp", dcp_form="plain", include_optimizer=True)
    metadata = FileSystemReader(str(dcp)).read_metadata()
    plain = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(plain, checkpoint_id=str(dcp))
    for group in GROUPS:
        held = saved_values["model"] if group == "model" else saved_values["optimizer"][group.split("/")[1]]
        for name in _expert_names():
            key = f"{group.replace('/', '.')}.{name}"
            assert torch.equal(plain[key], held[name]), key


def test_impossible_combinations_fail_before_any_process_starts(tmp_path: Path, run_ckptkit: Callable) -> None:
    cases = [
        (["--model", "tiny-moe", "--dp", "3", "--ep", "3"], "8 experts are not divisible by ep 3"),
        (["--model", "tiny-moe", "--dp", "3", "--ep", "2"], "ep 2 does not divide dp 3"),
        (["--model", "tiny", "--dp", "2", "--ep", "2"], "the llama layout has no experts (ep must be 1)"),
        (["--model", "tiny-moe", "--cp", "3"], "sequence length 32 is not divisible by cp 3"),
    ]
    for args, message in cases:
        result = run_ckptkit("train", *args, "--out", str(tmp_path / "run"), "--steps", "1")
        assert result.returncode == 1, (args, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert not (tmp_path / "run").exists()


def test_the_checkpoint_records_the_topology_and_the_model(runs: dict) -> None:
    out, _ = _trained(runs, (1, 1, 2, 1, 2, 2))
    manifest = ckptkit.read_manifest(str(out / "step_00000006"))
    assert manifest.topology == _topology((1, 1, 2, 1, 2, 2))
    assert manifest.info.model is not None and manifest.info.model.family == "llama-moe"
    assert manifest.info.model.config["num_experts"] == EXPERTS and manifest.info.model.config["top_k"] == 2
    assert manifest.layout is not None and manifest.layout["name"] == "llama-moe"
    assert json.loads(json.dumps(manifest.info.config))["cp"] == 2


def test_inspect_and_layout_check_speak_of_the_experts(runs: dict, tmp_path: Path, run_ckptkit: Callable) -> None:
    out, _ = _trained(runs, (1, 1, 2, 1, 2, 2))
    shown = run_ckptkit("inspect", str(out / "step_00000006"))
    assert shown.returncode == 0 and "topology    world 4 = tp 1 x pp 1 x dp 2 x cp 2, ep 2, zero 1" in shown.stdout
    assert "model       llama-moe: 2 layers, hidden 64, 8 heads (4 kv), vocabulary 98, intermediate 64, 8 experts (top 2)" in shown.stdout
    layout = tmp_path / "layout.json"
    layout.write_text(run_ckptkit("layout", "show", str(out / "step_00000006")).stdout)
    assert run_ckptkit("layout", "check", str(layout), "--dp", "4", "--ep", "4").returncode == 0
    bad = run_ckptkit("layout", "check", str(layout), "--dp", "6", "--ep", "3")
    assert bad.returncode == 1 and "8 experts are not divisible by ep 3" in bad.stderr
