"""The other targets a converted Hugging Face checkpoint of every architecture exports to, each
read back by its own consumer: an FSDP2 job of transformers' model loads the DCP ``fsdp2`` form
and computes the original's logits (a mixture of experts' experts stacked as transformers keeps
them in memory), torch DCP loads the ``plain`` form, zarr-python reads the zarr form; every
tensor equals the original model's, bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit

from .test_hf_architectures import CONFIGS, _saved
from .test_megatron_views import HELD

transformers = pytest.importorskip("transformers")

NAMES = sorted(CONFIGS)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, dict[str, torch.Tensor]]]:
    """Each architecture saved by transformers (fp32), converted: (source, converted, state_dict)."""
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for name in NAMES:
        src, model = _saved(name, torch.float32, root)
        ckptkit.convert(src, root / f"{name}-converted")
        out[name] = (src, root / f"{name}-converted", {k: v.clone() for k, v in model.state_dict().items()})
    return out


def test_the_plain_dcp_form_loads_in_torch_dcp_with_every_tensor(converted: dict[str, Any], tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    for name, (_, path, want) in converted.items():
        ckptkit.export(path, tmp_path / name, format="dcp", dcp_form="plain")
        stored = {k: v for k, v in want.items() if f"model/{k}" in ckptkit.read_manifest(path).tensors}
        state = {f"model.{k}": torch.zeros_like(v) for k, v in stored.items()}
        dcp.load(state, checkpoint_id=str(tmp_path / name), no_dist=True)
        assert [k for k, v in stored.items() if not torch.equal(state[f"model.{k}"], v)] == [], name


def test_the_zarr_form_reads_in_zarr_python_with_every_tensor(converted: dict[str, Any], tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    for name, (_, path, want) in converted.items():
        ckptkit.export(path, tmp_path / name, format="zarr")
        group = zarr.open_group(str(tmp_path / name), mode="r")
        stored = {k: v for k, v in want.items() if f"model/{k}" in ckptkit.read_manifest(path).tensors}
        assert [k for k, v in stored.items() if not torch.equal(torch.from_numpy(group[f"model/{k}"][...]), v)] == [], name


@pytest.mark.multiprocess
def test_an_fsdp2_job_of_transformers_models_loads_the_fsdp2_form_with_the_originals_logits(
    converted: dict[str, Any], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from ckptkit.trainer.launch import run_ranks

    from .hf_fsdp2_job import job

    jobs = []
    for name, (src, path, want) in converted.items():
        report = ckptkit.export(path, tmp_path / name, format="dcp", dcp_form="fsdp2")
        assert report.form == "fsdp2"
        jobs.append((str(tmp_path / name), str(src), str(tmp_path / f"{name}.safetensors")))
    run_ranks(job, 2, jobs)
    for name, (src, _, want) in converted.items():
        got = load_file(str(tmp_path / f"{name}.safetensors"))
        logits = got.pop("__logits__")
        assert sorted(got) == sorted(want) and [k for k in want if not torch.equal(got[k], want[k])] == [], name
        original = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        ids = torch.randint(0, original.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert (original(ids).logits - logits).abs().max().item() <= 1e-5, name


def test_the_published_matrix_is_what_the_code_gives_and_leaves_no_cell_unexplained(
    converted: dict[str, Any], tmp_path: Path
) -> None:
    from . import matrix

    table = matrix.cells({name: path for name, (_, path, _) in converted.items()}, tmp_path)
    published = (Path(__file__).resolve().parents[2] / "docs" / "MATRIX.md").read_text(encoding="utf-8")
    assert matrix.page(table) == published, "regenerate: python -m tests.models.matrix > docs/MATRIX.md"
    assert "written, not checked" not in published
    assert all(row["hf"] == "ok" and row["dcp plain"] == "ok" and row["zarr"] == "ok" for row in table.values())
    assert sorted(name for name, row in table.items() if row["megatron"] == "ok") == sorted(HELD)  # each loaded by megatron-core
