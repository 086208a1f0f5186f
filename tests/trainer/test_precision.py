"""Mixed precision in the reference trainer (on the CPU, as on a GPU): bf16 and fp16 compute on
fp32 master weights, exact resume, and fp16's dynamic loss scaler checkpointed and restored."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import ckptkit
from ckptkit.ops.diff import diff

from .runs import train

pytestmark = pytest.mark.multiprocess

STEPS = 8  # saves at 4 and 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {"root": tmp_path_factory.mktemp("precision"), "logs": {}}


def _trained(runs: dict, name: str, combo: tuple[int, int, int, int], **options: object) -> tuple[Path, list[dict]]:
    out = runs["root"] / name
    if name not in runs["logs"]:
        runs["logs"][name] = train(out, combo, STEPS, **options)
    return out, runs["logs"][name]


@pytest.mark.parametrize("combo", [(1, 1, 1, 0), (2, 1, 2, 1), (1, 2, 2, 3)], ids=lambda c: "tp{}-pp{}-dp{}-z{}".format(*c))
def test_bf16_losses_stay_within_bf16_tolerance_of_the_fp32_run(runs: dict, combo: tuple[int, int, int, int]) -> None:
    _, fp32 = _trained(runs, "fp32", (1, 1, 1, 0))
    _, bf16 = _trained(runs, "bf16-{}{}{}{}".format(*combo), combo, precision="bf16")
    for a, b in zip(bf16, fp32):
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["sample_ids"] == b["sample_ids"]
    assert any(a["loss"] != b["loss"] for a, b in zip(bf16, fp32))  # it did compute in bf16


def test_bf16_resume_is_bitwise_exact_and_the_checkpoint_holds_fp32_masters(runs: dict, tmp_path: Path) -> None:
    out, full = _trained(runs, "bf16-2121", (2, 1, 2, 1), precision="bf16")
    resumed = train(tmp_path / "resumed", (2, 1, 2, 1), STEPS, resume=str(out / "step_00000004"), precision="bf16")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:]]
    report = diff(out / "step_00000008", tmp_path / "resumed" / "step_00000008", kinds=("param", "optimizer", "rng"))
    assert report.ok and report.tensors > 0
    manifest = ckptkit.read_manifest(str(out / "step_00000008"))
    assert {t.dtype for t in manifest.tensors.values() if t.kind in ("param", "optimizer")} == {"float32"}
    assert manifest.info.config["precision"] == "bf16" and manifest.info.loss_scaler is None


def test_the_fp16_loss_scaler_backs_off_grows_and_is_restored_on_resume(runs: dict, tmp_path: Path) -> None:
    options = dict(precision="fp16", loss_scale=2.0**24, loss_scale_window=3)
    out, full = _trained(runs, "fp16", (1, 1, 2, 1), **options)
    # 2^24 overflows fp16's gradients: those steps are skipped (no norm) and the scale halves
    # until the gradients fit; after 3 steps without overflow it doubles.
    skipped = [r["step"] for r in full if r["grad_norm"] is None]
    assert skipped and skipped == list(range(1, len(skipped) + 1)) and len(skipped) < STEPS
    at4 = ckptkit.read_manifest(str(out / "step_00000004")).info.loss_scaler
    at8 = ckptkit.read_manifest(str(out / "step_00000008")).info.loss_scaler
    assert at4 is not None and at8 is not None
    assert at4["scale"] == 2.0 ** (24 - min(4, len(skipped))) and at4["skipped_steps"] == min(4, len(skipped))
    good = STEPS - len(skipped)
    assert at8["scale"] == 2.0 ** (24 - len(skipped) + good // 3) and at8["growth_tracker"] == good % 3
    resumed = train(tmp_path / "resumed", (1, 1, 2, 1), STEPS, resume=str(out / "step_00000004"), **options)
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in full[4:]]
    assert ckptkit.read_manifest(str(tmp_path / "resumed" / "step_00000008")).info.loss_scaler == at8
    assert diff(out / "step_00000008", tmp_path / "resumed" / "step_00000008", kinds=("param", "optimizer")).ok


def test_cuda_where_there_is_none_and_unknown_precisions_fail_before_any_process_starts(
    tmp_path: Path, run_ckptkit: Callable
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_ckptkit("train", "--device", "cuda", "--out", str(tmp_path / "run"), "--steps", "1")
    assert result.returncode == 1 and "--device cuda, but CUDA is not available here" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()
    bad = run_ckptkit("train", "--precision", "fp8", "--out", str(tmp_path / "run"), "--steps", "1")
    assert bad.returncode == 2 and not (tmp_path / "run").exists()
