"""The Hugging Face mapping (pure): names, shard plan, sizes, configs."""

from __future__ import annotations

from typing import Any

import pytest

from ckptkit_adapters.hf import mapping as hf
from ckptkit.errors import LayoutError
from ckptkit.cli import parse_size
from ckptkit.models import spec_from_config
from ckptkit.models.reference import model_of, reference_hf_config
from ckptkit.trainer.config import model_config


def _hf_names(family: str, tensors: dict[str, int], **config: Any) -> dict[str, str]:
    """Each Hugging Face tensor of a reference checkpoint of `tensors` (fqns), with its one source."""
    layout = model_config("tiny" if family == "llama" else "tiny-moe", vocab_size=98, **config).layout()
    spec, view = model_of(layout)
    runs = hf.hf_runs(tensors, spec, view)
    assert all(len(rs) == 1 and rs[0].src_row == 0 for rs in runs.values())  # a rename: each whole, of one tensor
    return {rs[0].fqn.removeprefix("model/"): name for name, rs in runs.items()}


def test_every_logical_parameter_has_a_distinct_llama_name() -> None:
    names = list(model_config("tiny", vocab_size=98).layout().tensors())
    mapped = _hf_names("llama", {f"model/{n}": 1 for n in names})
    assert mapped["embed.weight"] == "model.embed_tokens.weight" and mapped["lm_head.weight"] == "lm_head.weight"
    assert mapped["layers.3.attn.k.weight"] == "model.layers.3.self_attn.k_proj.weight"
    assert mapped["layers.0.mlp_norm.weight"] == "model.layers.0.post_attention_layernorm.weight"
    assert sorted(mapped) == sorted(names) and len(set(mapped.values())) == len(names)


def test_every_moe_parameter_has_a_distinct_mixtral_name() -> None:
    names = list(model_config("tiny-moe", vocab_size=98).layout().tensors())
    mapped = _hf_names("llama-moe", {f"model/{n}": 1 for n in names})
    assert mapped["layers.1.mlp.router.weight"] == "model.layers.1.block_sparse_moe.gate.weight"
    assert [mapped[f"layers.0.mlp.experts.7.{w}.weight"] for w in ("gate", "down", "up")] == [
        f"model.layers.0.block_sparse_moe.experts.7.{w}.weight" for w in ("w1", "w2", "w3")]
    assert mapped["layers.0.attn.q.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert sorted(mapped) == sorted(names) and len(set(mapped.values())) == len(names)
    # Experts in numeric order within their layer.
    order = [s.names for s in hf.plan_shards({mapped[f"layers.0.mlp.experts.{e}.up.weight"]: 1 for e in (7, 2)}, 10)]
    assert order == [("model.layers.0.block_sparse_moe.experts.2.w3.weight", "model.layers.0.block_sparse_moe.experts.7.w3.weight")]


def test_parameters_the_config_has_no_place_for_are_listed() -> None:
    names = list(model_config("tiny", vocab_size=98, tie_embeddings=True).layout().tensors())
    tensors = {**{f"model/{n}": 1 for n in names}, "model/lm_head.weight": 1}
    with pytest.raises(LayoutError, match=r"1 tensor\(s\) the model config has no place for .*: model/lm_head.weight$"):
        _hf_names("llama", tensors, tie_embeddings=True)


def test_unplaced_and_missing_tensors_are_all_listed() -> None:
    names = list(model_config("tiny", vocab_size=98).layout().tensors())
    tensors = {**{f"model/{n}": 1 for n in names if n != "norm.weight"}, "model/extra.bias": 1, "model/other": 1}
    with pytest.raises(LayoutError, match=r"2 tensor\(s\) the model config has no place for .*: model/extra.bias, model/other; "
                                          r"1 tensor\(s\) the model config needs are missing: model/norm.weight"):
        _hf_names("llama", tensors)


def test_shards_follow_module_order_and_the_size_bound() -> None:
    sizes = {"lm_head.weight": 40, "model.norm.weight": 1, "model.layers.10.mlp.up_proj.weight": 30,
             "model.layers.2.mlp.up_proj.weight": 30, "model.embed_tokens.weight": 40}
    shards = hf.plan_shards(sizes, 64)
    assert [s.names for s in shards] == [
        ("model.embed_tokens.weight",),
        ("model.layers.2.mlp.up_proj.weight", "model.layers.10.mlp.up_proj.weight", "model.norm.weight"),
        ("lm_head.weight",)]
    assert [s.file for s in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [s.names for s in hf.plan_shards({"a": 100}, 10)] == [("a",)]  # too big for the bound: alone


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 << 30), ("123", 123), ("1.5kb", 1500)])
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "0", "-5MB", "5XB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(LayoutError, match="is not a size"):
        parse_size(text)


def test_config_describes_the_model() -> None:
    cfg = model_config("tiny", vocab_size=98).to_json()
    doc = hf.config_json(spec_from_config(reference_hf_config("llama", cfg)), "bfloat16")
    assert doc["model_type"] == "llama" and doc["num_key_value_heads"] == 4 and doc["head_dim"] == 8
    assert doc["torch_dtype"] == "bfloat16" and doc["tie_word_embeddings"] is False
    moe = reference_hf_config("llama-moe", model_config("tiny-moe", vocab_size=98).to_json())
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["num_local_experts"] == 8 and moe["num_experts_per_tok"] == 2
    assert "mlp_bias" not in moe and moe["sliding_window"] is None and moe["head_dim"] == 8
    tok = hf.tokenizer_config_json({"model": {"vocab": {"<unk>": 0, "<eos>": 1, "a": 2}}}, 256)
    assert tok == {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256, "unk_token": "<unk>", "eos_token": "<eos>"}
