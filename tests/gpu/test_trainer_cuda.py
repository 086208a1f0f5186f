"""The reference trainer on a GPU (``--device cuda``, NCCL): bf16 against the fp32 run, exact
resume, the fp16 loss scaler's round trip, the mixture of experts (needs a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.ops.diff import diff

from ..trainer.runs import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 6  # saves at 4 and 6


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cuda-train")


def _close(a: list[dict], b: list[dict], rel: float) -> None:
    assert [r["sample_ids"] for r in a] == [r["sample_ids"] for r in b]
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= rel * abs(y["loss"]), (x["step"], x["loss"], y["loss"])


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_bf16_on_cuda_is_within_bf16_tolerance_of_the_fp32_cpu_run_and_resumes_bitwise(root: Path, model: str, tmp_path: Path) -> None:
    cpu = train(root / f"cpu-{model}", (1, 1, 1, 0), STEPS, model=model)
    out = root / f"cuda-{model}"
    gpu = train(out, (1, 1, 1, 0), STEPS, model=model, device="cuda", precision="bf16")
    _close(gpu, cpu, 1e-2)
    resumed = train(tmp_path / "resumed", (1, 1, 1, 0), STEPS, resume=str(out / "step_00000004"), model=model, device="cuda",
                    precision="bf16")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in gpu[4:]]
    assert diff(out / "step_00000006", tmp_path / "resumed" / "step_00000006", kinds=("param", "optimizer", "rng")).ok
    manifest = ckptkit.read_manifest(str(out / "step_00000006"))
    assert "rng/torch_cuda" in manifest.tensors


def test_fp32_on_cuda_matches_the_cpu_run_closely(root: Path) -> None:
    cpu = train(root / "cpu-fp32", (1, 1, 1, 0), STEPS)
    gpu = train(root / "cuda-fp32", (1, 1, 1, 0), STEPS, device="cuda")
    _close(gpu, cpu, 1e-4)


def test_the_fp16_loss_scaler_round_trips_on_cuda(root: Path, tmp_path: Path) -> None:
    options = dict(device="cuda", precision="fp16", loss_scale=2.0**24, loss_scale_window=2)
    out = root / "cuda-fp16"
    full = train(out, (1, 1, 1, 0), STEPS, **options)
    saved = ckptkit.read_manifest(str(out / "step_00000004")).info.loss_scaler
    assert saved is not None and saved["type"] == "dynamic"
    resumed = train(tmp_path / "resumed", (1, 1, 1, 0), STEPS, resume=str(out / "step_00000004"), **options)
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in full[4:]]
    assert (ckptkit.read_manifest(str(tmp_path / "resumed" / "step_00000006")).info.loss_scaler
            == ckptkit.read_manifest(str(out / "step_00000006")).info.loss_scaler)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_on_two_gpus_over_nccl_compute_the_single_gpu_losses(root: Path) -> None:
    one = train(root / "cuda-1", (1, 1, 1, 0), STEPS, device="cuda", precision="bf16")
    two = train(root / "cuda-2", (1, 1, 2, 1), STEPS, device="cuda", precision="bf16")
    _close(two, one, 1e-2)
