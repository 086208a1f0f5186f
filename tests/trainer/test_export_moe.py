"""Export of the reference trainer's mixture of experts (layout llama-moe) to Hugging Face: a
MixtralForCausalLM that transformers loads and that computes the trainer's logits."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import LayoutError
from ckptkit.exports.run import REPORT_NAME, export
from ckptkit.layouts import reference_llama_moe
from ckptkit.manifest import manifest_to_json, seal
from ckptkit.manifest.shards import listed_form
from ckptkit.trainer.data import Tokenizer
from ckptkit.trainer.train import config_from, launch, prepare

from .runs import trainer_logits

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

TEXT = "the cat sat on the mat.\nit was warm, and the dog slept by the door all day long."


def _train(out: Path, **options: Any) -> Path:
    """Train the tiny mixture of experts for 2 steps at one rank; return its checkpoint."""
    cfg = config_from(model="tiny-moe", steps=2, save_every=2, out=str(out), **options)
    launch(cfg, prepare(cfg))
    return out / "step_00000002"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("moe-src") / "run")


@pytest.fixture(scope="module")
def tied_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("moe-tied") / "run", tie_embeddings=True)


def _hf_logits(dst: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the export in transformers (nothing missing or left over); its logits of `TEXT`
    and the ids its tokenizer gives (the trainer's)."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(dst), output_loading_info=True)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = transformers.AutoTokenizer.from_pretrained(str(dst))(TEXT, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == Tokenizer().encode(TEXT).tolist()
    with torch.no_grad():
        return model(ids).logits, ids


def test_fp32_export_loads_as_mixtral_with_thetrainer_logits(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    report = export(source, dst, dtype="fp32", max_shard_bytes=100_000)
    assert len(list(dst.glob("model-*.safetensors"))) > 1
    theirs, ids = _hf_logits(dst)
    assert (theirs - trainer_logits(source, ids)).abs().max().item() <= 1e-4
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["router_aux_loss_coef"]) == (8, 2, 0.01)
    assert config["intermediate_size"] == 64 and config["sliding_window"] is None and config["router_jitter_noise"] == 0.0
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "float32"
    # Under the on-disk names of the Mixtral checkpoints on the Hub: each expert's w1, w2, w3.
    names = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(names) == sorted(t.name for t in report.tensor_list) and len(names) == 3 + 2 * (6 + 1 + 8 * 3)
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.7.w2.weight",
            "model.layers.0.self_attn.k_proj.weight", "model.layers.0.post_attention_layernorm.weight"} <= set(names)
    assert not [n for n in names if ".mlp." in n]
    assert {e.name for e in report.skipped} == {f for f in ckptkit.read_manifest(str(source)).tensors if not f.startswith("model/")}
    assert json.loads((dst / REPORT_NAME).read_text()) == json.loads(report.model_dump_json())


def test_bf16_export_holds_each_experts_rounded_master_weights(source: Path, tmp_path: Path) -> None:
    export(source, tmp_path / "hf", dtype="bf16")
    whole = ckptkit.load(str(source))["model"]
    got = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    pairs = {"model.layers.1.block_sparse_moe.experts.5.w1.weight": "layers.1.mlp.experts.5.gate.weight",
             "model.layers.1.block_sparse_moe.experts.5.w2.weight": "layers.1.mlp.experts.5.down.weight",
             "model.layers.1.block_sparse_moe.experts.5.w3.weight": "layers.1.mlp.experts.5.up.weight",
             "model.layers.0.block_sparse_moe.gate.weight": "layers.0.mlp.router.weight",
             "model.embed_tokens.weight": "embed.weight"}
    for name, logical in pairs.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name].view(torch.int16), whole[logical].to(torch.bfloat16).view(torch.int16)), name
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tied_export_has_no_head_and_thetrainer_logits(tied_source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    report = export(tied_source, dst, dtype="fp32")
    assert json.loads((dst / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in {t.name for t in report.tensor_list}
    theirs, ids = _hf_logits(dst)
    assert (theirs - trainer_logits(tied_source, ids)).abs().max().item() <= 1e-4


def _with_layout(source: Path, dst: Path, change: Callable[[dict[str, Any], dict[str, Any]], None]) -> Path:
    """A copy of `source` whose manifest (resealed, consistent, listing every tensor) is changed
    by `change(doc, config)` and records the llama-moe layout of the changed config."""
    shutil.copytree(source, dst)
    doc = json.loads(manifest_to_json(listed_form(ckptkit.read_manifest(str(dst)))))  # every tensor listed, to change
    config = dict(doc["info"]["model"]["config"])
    change(doc, config)
    doc["layout"] = json.loads(reference_llama_moe(config).model_dump_json())
    (dst / "manifest.json").write_bytes(seal(doc))
    return dst


def test_a_head_with_tied_embeddings_is_refused_before_writing(source: Path, tmp_path: Path, run_ckptkit: Callable) -> None:
    def tie(doc: dict[str, Any], config: dict[str, Any]) -> None:
        config["tie_embeddings"] = True

    tied = _with_layout(source, tmp_path / "tied", tie)
    with pytest.raises(LayoutError, match=r"1 tensor\(s\) the model config has no place for .*: model/lm_head.weight$"):
        export(tied, tmp_path / "a")
    done = run_ckptkit("export", str(tied), str(tmp_path / "b"), "--format", "hf")
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "model/lm_head.weight" in done.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_missing_experts_and_bad_routing_are_refused_before_writing(source: Path, tmp_path: Path, run_ckptkit: Callable) -> None:
    def drop(doc: dict[str, Any], config: dict[str, Any]) -> None:
        for name in ("model/layers.1.mlp.experts.3.up.weight", "model/layers.0.mlp.router.weight"):
            del doc["tensors"][name]

    broken = _with_layout(source, tmp_path / "broken", drop)
    with pytest.raises(LayoutError, match=r"2 tensor\(s\) the model config needs are missing: "
                                          r"model/layers.0.mlp.router.weight, model/layers.1.mlp.experts.3.up.weight"):
        export(broken, tmp_path / "a")

    def route(doc: dict[str, Any], config: dict[str, Any]) -> None:
        config["top_k"] = 9

    over = _with_layout(source, tmp_path / "over", route)
    done = run_ckptkit("export", str(over), str(tmp_path / "b"))
    assert done.returncode == 1 and done.stderr.count("\n") == 1
    assert "top_k 9 of 8 experts; top_k must be between 1 and num_experts" in done.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
