"""The Hugging Face mapping (pure): names, shard plan, sizes, configs."""

from __future__ import annotations

import pytest

from ckptkit.exports import hf
from ckptkit.errors import LayoutError
from ckptkit.cli import parse_size
from ckptkit.trainer.config import model_config


def test_every_logical_parameter_has_a_distinct_llama_name() -> None:
    names = list(model_config("tiny", vocab_size=98).layout().tensors())
    mapped = {n: hf.hf_name(n) for n in names}
    assert mapped["embed.weight"] == "model.embed_tokens.weight" and mapped["lm_head.weight"] == "lm_head.weight"
    assert mapped["layers.3.attn.k.weight"] == "model.layers.3.self_attn.k_proj.weight"
    assert mapped["layers.0.mlp_norm.weight"] == "model.layers.0.post_attention_layernorm.weight"
    assert None not in mapped.values() and len(set(mapped.values())) == len(names)
    assert hf.hf_name("layers.0.attn.qkv.weight") is None and hf.hf_name("rng/torch_cpu") is None


def test_every_moe_parameter_has_a_distinct_mixtral_name() -> None:
    names = list(model_config("tiny-moe", vocab_size=98).layout().tensors())
    mapped = {n: hf.RENAMES["llama-moe"](n) for n in names}
    assert mapped["layers.1.mlp.router.weight"] == "model.layers.1.block_sparse_moe.gate.weight"
    assert [mapped[f"layers.0.mlp.experts.7.{w}.weight"] for w in ("gate", "down", "up")] == [
        f"model.layers.0.block_sparse_moe.experts.7.{w}.weight" for w in ("w1", "w2", "w3")]
    assert mapped["layers.0.attn.q.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert None not in mapped.values() and len(set(mapped.values())) == len(names)
    assert hf.mixtral_name("layers.0.mlp.gate.weight") is None and hf.hf_name("layers.0.mlp.router.weight") is None
    # Experts in numeric order within their layer.
    order = [s.names for s in hf.plan_shards({hf.mixtral_name(f"layers.0.mlp.experts.{e}.up.weight") or "": 1 for e in (10, 2)}, 10)]
    assert order == [("model.layers.0.block_sparse_moe.experts.2.w3.weight", "model.layers.0.block_sparse_moe.experts.10.w3.weight")]


def test_parameters_the_config_has_no_place_for_are_listed() -> None:
    names = ["embed.weight", "norm.weight"]
    tensors = {"model/embed.weight": 1, "model/norm.weight": 1, "model/lm_head.weight": 1}
    with pytest.raises(LayoutError, match=r"1 tensor\(s\) the model config has no place for .*: model/lm_head.weight$"):
        hf.name_map(tensors, names)


def test_unmapped_and_missing_tensors_are_all_listed() -> None:
    names = ["embed.weight", "norm.weight", "layers.0.attn.q.weight"]
    tensors = {"model/embed.weight": 1, "model/layers.0.attn.q.weight": 1, "model/extra.bias": 1, "model/other": 1}
    with pytest.raises(LayoutError, match=r"2 tensor\(s\) with no Hugging Face name: model/extra.bias, model/other; "
                                          r"1 tensor\(s\) the model config needs are missing: model/norm.weight"):
        hf.name_map(tensors, names)


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
    doc = hf.config_json(cfg, "bfloat16")
    assert doc["model_type"] == "llama" and doc["num_key_value_heads"] == 4 and doc["head_dim"] == 8
    assert doc["torch_dtype"] == "bfloat16" and doc["tie_word_embeddings"] is False
    moe = hf.model_config_json("llama-moe", model_config("tiny-moe", vocab_size=98).to_json(), "float32")
    assert moe["architectures"] == ["MixtralForCausalLM"] and moe["num_local_experts"] == 8 and moe["num_experts_per_tok"] == 2
    assert "mlp_bias" not in moe and moe["sliding_window"] is None and moe["head_dim"] == 8
    tok = hf.tokenizer_config_json({"model": {"vocab": {"<unk>": 0, "<eos>": 1, "a": 2}}}, 256)
    assert tok == {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256, "unk_token": "<unk>", "eos_token": "<eos>"}
