"""Offline reshard of real trainer checkpoints: exact, round-trips bitwise, and the run continues."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest

import ckptkit
from ckptkit.ops.diff import diff
from ckptkit.errors import IntegrityError
from ckptkit.manifest import Topology
from ckptkit.ops.reshard import reshard
from ckptkit.manifest.shards import iter_shards
from ckptkit.trainer.config import MODELS, ModelConfig
from ckptkit.layouts import rank_boxes

from .runs import train
from ..conftest import cli_schema

pytestmark = pytest.mark.multiprocess

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
A = (2, 2, 2, 1)
STEPS = 9  # resumes continue from step 4 for 5 steps


def topo(combo: tuple[int, int, int, int]) -> Topology:
    tp, pp, dp, zero = combo
    return Topology(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, zero_stage=zero)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run at A for STEPS steps (saving at 4 and 8 and 9), and a (1,1,4,z3) run for 4 steps."""
    root = tmp_path_factory.mktemp("reshard-src")
    log = train(root / "a", A, STEPS)
    train(root / "z3", (1, 1, 4, 3), 4)
    return {"a": root / "a" / "step_00000004", "a_log": log, "z3": root / "z3" / "step_00000004"}


def _payloads(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


PAIRS = [("a", (1, 1, 1, 0)), ("a", (4, 1, 2, 2)), ("a", (1, 2, 4, 3)), ("z3", (2, 2, 1, 1))]


@pytest.mark.parametrize("source,combo", PAIRS, ids=lambda p: p if isinstance(p, str) else "tp{}-pp{}-dp{}-z{}".format(*p))
def test_reshard_is_exact_and_a_round_trip_gives_back_the_same_files(
    sources: dict, source: str, combo: tuple[int, int, int, int], tmp_path: Path
) -> None:
    src = sources[source]
    original = ckptkit.read_manifest(str(src))
    report = reshard(src, tmp_path / "b" / "step_00000004", topo(combo))
    b = tmp_path / "b" / "step_00000004"
    assert diff(src, b).ok  # parameters and optimizer state, every element
    assert ckptkit.verify(str(b)).ok
    manifest = ckptkit.read_manifest(str(b))
    assert manifest.topology == topo(combo) and manifest.step == 4
    assert manifest.info == original.info and manifest.tokenizer == original.tokenizer
    assert (b / "tokenizer" / "tokenizer.json").read_bytes() == (src / "tokenizer" / "tokenizer.json").read_bytes()
    # The target holds exactly the boxes the target topology's ranks hold.
    cfg = ModelConfig(**manifest.info.model.config)  # type: ignore[union-attr]
    want: dict[str, set] = {}
    for rank in range(manifest.topology.world_size):
        for key, by_name in rank_boxes(cfg.layout(), topo(combo), rank).items():
            for name, boxes in by_name.items():
                want.setdefault(f"{key}/{name}", set()).update(b for b in boxes if b.volume)
    for fqn, boxes in want.items():
        assert {s.box for s in iter_shards(manifest.tensors[fqn])} == boxes, fqn
    assert report.unplaced == ["rng/numpy", "rng/python", "rng/torch_cpu"]
    back = tmp_path / "back" / "step_00000004"
    reshard(b, back, original.topology)
    assert _payloads(back) == _payloads(src)  # A -> B -> A: the same payload files, byte for byte
    assert diff(src, back, kinds=("param", "optimizer", "rng")).ok


def test_cli_reshard_then_diff_says_equal(sources: dict, tmp_path: Path, run_ckptkit: Callable) -> None:
    dst = tmp_path / "run-b" / "step_00000004"
    done = run_ckptkit("reshard", str(sources["a"]), str(dst), "--tp", "4", "--pp", "1", "--dp", "2", "--zero", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    jsonschema.validate(report, cli_schema("reshard"))
    assert report["topology"]["tp"] == 4 and report["files"] >= 8 and report["bytes_read"] >= report["bytes_written"] > 0
    assert (tmp_path / "run-b" / "latest").read_text().split()[0] == "step_00000004"
    assert run_ckptkit("diff", str(sources["a"]), str(dst)).returncode == 0
    assert run_ckptkit("verify", str(dst)).returncode == 0


@pytest.mark.parametrize("combo", [(1, 1, 1, 0), (1, 2, 4, 3)], ids=lambda c: "tp{}-pp{}-dp{}-z{}".format(*c))
def test_resume_after_reshard_continues_the_run(sources: dict, combo: tuple[int, int, int, int], tmp_path: Path) -> None:
    full = sources["a_log"]
    resharded = tmp_path / "b" / "step_00000004"
    reshard(sources["a"], resharded, topo(combo))
    offline = train(tmp_path / "offline", combo, STEPS, resume=str(resharded))
    at_load = train(tmp_path / "at-load", combo, STEPS, resume=str(sources["a"]))
    assert [r["step"] for r in offline] == list(range(5, STEPS + 1))
    for got, want in zip(offline, full[4:]):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got["step"], got["loss"], want["loss"])
    # Both paths place the same values on the same ranks and derive the same RNG streams.
    assert [r["loss"] for r in offline] == [r["loss"] for r in at_load]
    assert [r["sample_ids"] for r in offline] == [r["sample_ids"] for r in full[4:]] == [r["sample_ids"] for r in at_load]
    seen = [i for r in full[:4] + offline for i in r["sample_ids"]]
    assert len(seen) == len(set(seen)) == 8 * STEPS


def test_cli_refuses_impossible_targets_before_writing(sources: dict, tmp_path: Path, run_ckptkit: Callable) -> None:
    dst = tmp_path / "out" / "step_00000004"
    heads = MODELS["tiny"]["num_heads"]
    bad = run_ckptkit("reshard", str(sources["a"]), str(dst), "--tp", "3", "--pp", "3")
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("ckptkit: error: cannot reshard to tp=3 pp=3 dp=1 zero=0")
    assert f"{heads} attention heads are not divisible by tp 3" in bad.stderr and "layers are not divisible by pp 3" in bad.stderr
    zero = run_ckptkit("reshard", str(sources["a"]), str(dst), "--zero", "4")
    assert zero.returncode == 2 and zero.stderr == "ckptkit: error: --zero: stage 4 is not one of 0, 1, 2, 3\n"
    missing = run_ckptkit("reshard", str(tmp_path / "nothing"), str(dst))
    assert missing.returncode == 2 and missing.stderr.startswith("ckptkit: error: ") and missing.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()
    exists = run_ckptkit("reshard", str(sources["a"]), str(sources["a"].parent / "step_00000008"))
    assert exists.returncode == 1 and "a committed checkpoint already exists" in exists.stderr
    assert ckptkit.verify(str(sources["a"].parent / "step_00000008")).ok


def test_a_corrupt_source_is_refused_and_nothing_is_committed(sources: dict, tmp_path: Path) -> None:
    import shutil

    src = tmp_path / "src"
    shutil.copytree(sources["a"], src)
    victim = src / "rank00003.safetensors"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10  # one bit of one tensor
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=rf"rank00003.safetensors: block \d+ \(bytes \d+ to {len(data)}\) does not match its checksum"):
        reshard(src, tmp_path / "out" / "step_00000004", topo((1, 1, 1, 0)))
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_torchrun_ranks_split_the_files_and_write_the_same_checkpoint(sources: dict, tmp_path: Path) -> None:
    single = tmp_path / "single" / "step_00000004"
    reshard(sources["a"], single, topo((4, 1, 2, 2)))
    split = tmp_path / "split" / "step_00000004"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ckptkit.cli", "reshard", str(sources["a"]), str(split), "--tp", "4", "--dp", "2", "--zero", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("committed step 4") == 1  # rank 0 reports
    assert _payloads(split) == _payloads(single) and len(_payloads(single)) >= 8
    assert ckptkit.verify(str(split)).ok
