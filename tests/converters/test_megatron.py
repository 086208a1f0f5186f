"""``ckptkit convert`` of Megatron-Core ``torch_dist`` checkpoints: real ``dist_checkpointing``
saves of a GPTModel at TP 2 x DP 2 with the distributed optimizer (fp32 and bf16;
``fixtures/make_megatron.py``) come across bitwise against megatron-core's own
``load_plain_tensors``, layer-stacked tensors split per layer under Megatron's names; damaged or
unsupported input fails in one line and leaves no destination."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit_converters.megatron import CONVERTER, checkpoint_directory, layer_key

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "megatron"
SAVES = ["gpt-tp2-dp2", "gpt-tp2-dp2-bf16"]
needs_entry_point = pytest.mark.skipif("megatron" not in ckptkit.list_converters(),
                                       reason="the megatron entry point is not installed (pip install -e .)")


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _one_line_error(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ckptkit: error: ") and "Traceback" not in stderr
    return lines[0]


def _assert_nothing_written(tmp_path: Path, dst: Path) -> None:
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.tmp-")]


def _per_layer(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """An oracle entry under the converter's names: stacked layers split, the layer put back."""
    if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
        return {layer_key(key, i): value[i] for i in range(value.shape[0])}
    return {key: value}


@pytest.mark.parametrize("name", SAVES)
def test_every_tensor_equals_megatrons_load_plain_tensors_and_verifies(name: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / name), str(dst))
    assert report.skipped == [] and report.step == 3
    assert ckptkit.verify(dst).ok
    state = ckptkit.load(dst)
    want: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(FIXTURES / f"{name}.oracle" / "plain.safetensors")).items():
        if key.startswith("optimizer.state."):
            kind, param = key[len("optimizer.state."):].split(".", 1)
            want.update({f"optimizer/{'fp32' if kind == 'param' else kind}/{k}": v for k, v in _per_layer(param, value).items()})
        else:
            want.update({f"model/{k}": v for k, v in _per_layer(key, value).items()})
    got = {f"{group}/{k}": v for group, tree in (("model", state["model"]),
                                                  *((f"optimizer/{s}", t) for s, t in state["optimizer"].items()))
           for k, v in tree.items() if isinstance(v, torch.Tensor)}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert len([k for k in got if k.startswith("model/decoder.layers.1.")]) == 6  # both layers of every stacked tensor
    assert bool((got["optimizer/exp_avg/decoder.layers.0.self_attention.linear_qkv.weight"] != 0).any())
    assert state["optimizer"]["fp32"]["output_layer.weight"].dtype == torch.float32  # the master, also for bf16


def test_values_and_info_come_from_common_pt(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / "gpt-tp2-dp2"), str(dst))
    manifest = ckptkit.read_manifest(dst)
    assert manifest.step == 3
    assert manifest.objects["megatron/optimizer"]["param_state_sharding_type"] == "fully_reshardable"  # type: ignore[index,call-overload]
    assert manifest.objects["model/decoder.layers.1.mlp.linear_fc2._extra_state"] == [None]
    info = manifest.info.optimizer
    assert info is not None and info.step == 3 and [g.options["wd_mult"] for g in info.param_groups] == [1.0, 0.0]
    sources = {t.name: t.source for t in report.tensors}
    assert sources["model/decoder.layers.1.self_attention.linear_qkv.weight"] == "decoder.layers.self_attention.linear_qkv.weight[1:2, 0:32, 0:16]"
    assert sources["optimizer/fp32/embedding.word_embeddings.weight"] == "optimizer.state.param.embedding.word_embeddings.weight"
    chunks = {t.name: t.chunks for t in report.tensors}
    assert chunks["model/decoder.layers.0.mlp.linear_fc1.weight"] == 4  # gate and up rows of each TP rank


@needs_entry_point
@pytest.mark.parametrize("where", ["checkpoint", "save"])
def test_the_cli_recognises_a_checkpoint_or_a_megatron_lm_save_directory(where: str, tmp_path: Path, run_ckptkit: Any) -> None:
    if where == "checkpoint":
        src = FIXTURES / "gpt-tp2-dp2"
    else:  # a Megatron-LM save directory: latest_checkpointed_iteration.txt naming iter_0000003
        src = tmp_path / "run"
        shutil.copytree(FIXTURES / "gpt-tp2-dp2", src / "iter_0000003")
        (src / "latest_checkpointed_iteration.txt").write_text("3")
    proc = run_ckptkit("convert", "--json", str(src), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"ckptkit: {src}: converting from megatron ({ckptkit.list_converters()['megatron']})"]
    report = json.loads(proc.stdout)
    assert report["format"] == "megatron" and report["skipped"] == [] and len(report["tensors"]) == 60


@needs_entry_point
def test_a_missing_rank_file_fails_in_one_line_and_leaves_no_destination(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("gpt-tp2-dp2", tmp_path)
    (src / "__1_0.distcp").unlink()
    proc = run_ckptkit("convert", "--from", "megatron", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "__1_0.distcp: missing" in _one_line_error(proc.stderr)
    _assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_truncated_rank_file_is_refused(tmp_path: Path) -> None:
    src = _copy("gpt-tp2-dp2-bf16", tmp_path)
    os.truncate(src / "__0_1.distcp", (src / "__0_1.distcp").stat().st_size // 2)
    with pytest.raises(IntegrityError, match="truncated"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))
    _assert_nothing_written(tmp_path, tmp_path / "out")


def test_another_backend_and_a_legacy_checkpoint_are_refused_by_name(tmp_path: Path) -> None:
    src = _copy("gpt-tp2-dp2", tmp_path)
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(ManifestError, match="sharded backend 'zarr'"):
        checkpoint_directory(str(src))
    legacy = tmp_path / "legacy" / "iter_0000001"
    (legacy / "mp_rank_00").mkdir(parents=True)
    (legacy / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    assert CONVERTER.detect(str(legacy))
    with pytest.raises(ManifestError, match="legacy Megatron-LM"):
        CONVERTER.convert(str(legacy), str(tmp_path / "out"))


def test_a_dcp_directory_without_megatrons_files_is_not_megatron() -> None:
    assert not CONVERTER.detect(str(REPO / "fixtures" / "dcp-nodist"))
    assert ckptkit.detect_format(FIXTURES / "gpt-tp2-dp2") == "megatron"
