"""``ckptkit convert`` of a Megatron-Core save whose distributed optimizer is ``dp_reshardable``
(Megatron-LM's default: flat bucket buffers per data-parallel group, here bf16 parameters in
three buckets and fp32 norms in a fourth; ``fixtures/make_megatron.py``): each parameter's
master and moments come across bitwise against megatron-core's own per-parameter state,
under the names of the ``fully_reshardable`` form; a layout that does not fit is refused."""

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
from ckptkit.errors import IntegrityError
from ckptkit.layouts import builtin
from ckptkit_adapters.megatron import buckets as megatron_buckets
from ckptkit_adapters.common.dcp_metadata import read_metadata
from ckptkit_adapters.megatron.reader import CONVERTER, METADATA_ALLOWED, layer_key
from ckptkit_adapters.megatron.buckets import bucket_places, buckets_of

from .checks import assert_nothing_written, one_line_error

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron"
SAVE = FIXTURES / "gpt-tp2-dp2-dpr-bf16"
MODEL_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")


def _config() -> dict[str, Any]:
    config = json.loads((FIXTURES / "gpt-tp2-dp2-dpr-bf16.oracle" / "config.json").read_text())
    return {k: config[k] for k in MODEL_KEYS}


def _per_layer(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
        return {layer_key(key, i): value[i] for i in range(value.shape[0])}
    return {key: value}


def _oracle() -> dict[str, torch.Tensor]:
    """megatron-core's own view under the converter's names: the model as load_plain_tensors
    reads it, each parameter's state as the live distributed optimizer held it."""
    want: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(FIXTURES / "gpt-tp2-dp2-dpr-bf16.oracle" / "plain.safetensors")).items():
        if key.startswith("optimizer.state."):
            state, param = key[len("optimizer.state."):].split(".", 1)
            want.update({f"optimizer/{'fp32' if state == 'param' else state}/{k}": v for k, v in _per_layer(param, value).items()})
        else:
            want.update({f"model/{k}": v for k, v in _per_layer(key, value).items()})
    return want


def test_every_parameter_master_and_moment_equals_megatrons_own_state_and_verifies(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(SAVE), str(dst), layout=builtin("megatron-gpt", _config()))
    assert report.skipped == [] and report.step == 3
    assert ckptkit.verify(dst).ok
    state = ckptkit.load(dst)
    got = {f"{group}/{k}": v for group, tree in (("model", state["model"]),
                                                  *((f"optimizer/{s}", t) for s, t in state["optimizer"].items()))
           for k, v in tree.items() if isinstance(v, torch.Tensor)}
    want = _oracle()
    assert sorted(got) == sorted(want) and len(want) == 60
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert bool((got["optimizer/exp_avg_sq/decoder.layers.1.mlp.linear_fc1.weight"] != 0).all())
    # fc1 is [gate; up] on each TP rank: rank 1's up rows come from its own bucket, after rank 0's
    sources = {t.name: t for t in report.tensor_list}
    fc1 = sources["optimizer/exp_avg/decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.chunks == 2 and "bucket_idx_1.exp_avg[576:960]" in fc1.source


def test_the_bucket_sizes_and_parameter_groups_come_across(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    CONVERTER.convert(str(SAVE), str(dst), layout=builtin("megatron-gpt", _config()))
    manifest = ckptkit.read_manifest(dst)
    sizes = manifest.objects["megatron/optimizer.distributed.dp_group_idx_1.per_bucket_numel_unpadded~1shard_0_1"]
    assert sizes == [[{"param_dtype": "torch.bfloat16", "grad_dtype": "torch.bfloat16", "numel": [896, 960, 704]}],
                     [{"param_dtype": "torch.float32", "grad_dtype": "torch.float32", "numel": [272]}]]
    info = manifest.info.optimizer
    assert info is not None and info.step == 3 and [g.options["wd_mult"] for g in info.param_groups] == [1.0, 0.0]
    assert manifest.objects["megatron/optimizer"] == {"param_state_sharding_type": "dp_reshardable"}


def test_the_places_fit_only_the_sources_tensor_parallel_size() -> None:
    md = read_metadata(str(SAVE), METADATA_ALLOWED)
    buckets, states = buckets_of(md.entries)
    assert states == {"param", "exp_avg", "exp_avg_sq"} and len(buckets) == 8  # 2 groups x (3 bf16 + 1 fp32 buckets)
    dtypes = {f"decoder.layers.{i}.{k}": d for i in range(2) for k, d in (
        ("self_attention.linear_qkv.layer_norm_weight", "float32"), ("mlp.linear_fc1.layer_norm_weight", "float32"),
        ("self_attention.linear_qkv.weight", "bfloat16"), ("self_attention.linear_proj.weight", "bfloat16"),
        ("mlp.linear_fc1.weight", "bfloat16"), ("mlp.linear_fc2.weight", "bfloat16"))}
    dtypes.update({"embedding.word_embeddings.weight": "bfloat16", "output_layer.weight": "bfloat16",
                   "decoder.final_layernorm.weight": "float32"})
    layout = builtin("megatron-gpt", _config())
    places, order, problems = bucket_places(layout, 2, 1, buckets, dtypes)
    assert problems == [] and order == "local" and len(places) == 2 * 15
    first = [(p.bucket.index, p.start, p.spec.parts[0].name) for p in places if p.group == 1 and p.bucket.gbuf == 0][:3]
    assert first == [(0, 0, "output_layer.weight"), (0, 320, "decoder.layers.1.mlp.linear_fc2.weight"),
                     (0, 512, "decoder.layers.1.mlp.linear_fc1.weight")]  # the last parameter first, starts padded to 64
    places, _, problems = bucket_places(layout, 1, 2, buckets, dtypes)
    assert places == [] and any("no saved chunk starts at" in p or "past the bucket" in p for p in problems)


def test_a_parameter_order_that_fits_the_chunks_but_not_the_values_is_refused(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The two norms of a layer are the same size in the same buffer: swapped, every chunk
    # boundary still fits; the masters' check against the model's own tensors catches it.
    local = megatron_buckets.LAYER_ORDERS["local"]
    swapped = tuple({local[0]: local[3], local[3]: local[0]}.get(n, n) for n in local)
    monkeypatch.setattr(megatron_buckets, "LAYER_ORDERS", {"local": swapped})
    with pytest.raises(IntegrityError, match="does not round to the model's tensor"):
        CONVERTER.convert(str(SAVE), str(tmp_path / "out"), layout=builtin("megatron-gpt", _config()))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_without_a_layout_the_buckets_are_refused_in_one_line(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("convert", "--from", "megatron", str(SAVE), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "dp_reshardable" in one_line_error(proc.stderr) and "--layout" in proc.stderr
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_truncated_bucket_file_is_refused(tmp_path: Path, run_ckptkit: Any) -> None:
    src = Path(shutil.copytree(SAVE, tmp_path / "src"))
    os.truncate(src / "__2_1.distcp", 100)
    layout = tmp_path / "layout.json"
    layout.write_text(builtin("megatron-gpt", _config()).model_dump_json())
    proc = run_ckptkit("convert", "--from", "megatron", str(src), str(tmp_path / "out"), "--layout", str(layout))
    assert proc.returncode == 1 and "truncated" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_resharded_to_another_topology_and_back_every_state_is_kept(tmp_path: Path, run_ckptkit: Any) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(builtin("megatron-gpt", _config()).model_dump_json())
    converted, there, back = tmp_path / "converted", tmp_path / "tp1pp2dp2", tmp_path / "back"
    proc = run_ckptkit("convert", str(SAVE), str(converted), "--layout", str(layout))
    assert proc.returncode == 0, proc.stderr
    proc = run_ckptkit("reshard", str(converted), str(there), "--tp", "1", "--pp", "2", "--dp", "2", "--zero", "2", "--no-latest")
    assert proc.returncode == 0, proc.stderr
    assert run_ckptkit("reshard", str(there), str(back), "--tp", "2", "--dp", "2", "--no-latest").returncode == 0
    for a, b in ((converted, there), (converted, back)):
        proc = run_ckptkit("diff", str(a), str(b))
        assert proc.returncode == 0 and "equal" in proc.stdout, proc.stdout + proc.stderr
