"""models.compose (pure): one view's tensors as runs of rows of another's, through the canonical model."""

from __future__ import annotations

import pytest

from ckptkit.errors import LayoutError
from ckptkit.layouts import builtin
from ckptkit.models import REFERENCE, Run, compose, model_of, placed, spec_from_config
from ckptkit_adapters.hf.view import hf_view
from ckptkit_adapters.megatron.view import megatron_config, megatron_view

# Phi-3: 4 heads of 14 over 2 key/value heads, q, k, v fused one after another in qkv_proj
PHI3 = dict(model_type="phi3", vocab_size=101, hidden_size=56, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def test_phi3s_concatenated_qkv_becomes_megatrons_interleaved_one_group_by_group() -> None:
    spec = spec_from_config(PHI3)
    runs = compose(spec, hf_view(spec), megatron_view(spec, 102), prefix="model/")
    qkv = "model/model.layers.1.self_attn.qkv_proj.weight"
    # each query group: its 2 heads' q rows (28), then its k rows (14), then its v rows (14)
    assert runs["decoder.layers.1.self_attention.linear_qkv.weight"] == [
        Run(0, 28, qkv, 0), Run(28, 14, qkv, 56), Run(42, 14, qkv, 84),
        Run(56, 28, qkv, 28), Run(84, 14, qkv, 70), Run(98, 14, qkv, 98)]
    assert runs["decoder.layers.0.mlp.linear_fc1.weight"] == [Run(0, 160, "model/model.layers.0.mlp.gate_up_proj.weight", 0)]
    # the vocabulary stored in 102 rows: row 101 no run fills (padding)
    assert runs["embedding.word_embeddings.weight"] == [Run(0, 101, "model/model.embed_tokens.weight", 0)]
    assert placed(spec, megatron_view(spec, 102)).shapes["embedding.word_embeddings.weight"] == (102, 56)
    back = compose(spec, megatron_view(spec, 102), hf_view(spec))
    assert back["model.layers.1.self_attn.qkv_proj.weight"] == [
        Run(0, 28, "decoder.layers.1.self_attention.linear_qkv.weight", 0), Run(28, 28, "decoder.layers.1.self_attention.linear_qkv.weight", 56),
        Run(56, 14, "decoder.layers.1.self_attention.linear_qkv.weight", 28), Run(70, 14, "decoder.layers.1.self_attention.linear_qkv.weight", 84),
        Run(84, 14, "decoder.layers.1.self_attention.linear_qkv.weight", 42), Run(98, 14, "decoder.layers.1.self_attention.linear_qkv.weight", 98)]


def test_the_megatron_view_is_cut_as_the_builtin_megatron_layout_cuts_its_tensors() -> None:
    for config in (PHI3, dict(PHI3, model_type="qwen2"), dict(PHI3, model_type="qwen3"),
                   dict(PHI3, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)):
        spec = spec_from_config(config)
        layout = builtin("megatron-gpt", megatron_config(spec, 2))
        assert placed(spec, megatron_view(spec, int(layout.config["vocab_size"]))).shapes == layout.tensors(), config["model_type"]  # type: ignore[arg-type]


def test_the_reference_llama_is_its_canonical_names() -> None:
    layout = builtin("llama", dict(vocab_size=98, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4, num_kv_heads=2))
    spec, view = model_of(layout)
    assert view is REFERENCE and placed(spec, view).shapes == layout.tensors()
    assert compose(spec, view, view, "model/")["layers.1.attn.q.weight"] == [Run(0, 48, "model/layers.1.attn.q.weight", 0)]


def test_views_that_cannot_be_converted_are_refused_in_one_line() -> None:
    gpt2 = spec_from_config(dict(model_type="gpt2", vocab_size=101, n_embd=48, n_layer=2, n_head=4, n_positions=64))
    with pytest.raises(LayoutError, match="converting hf-gpt2 to reference would cut matrices stored transposed, which is not written yet"):
        compose(gpt2, hf_view(gpt2), REFERENCE)
    llama = spec_from_config(dict(PHI3, model_type="llama"))
    with pytest.raises(LayoutError, match=r"megatron-core's GPTModel has no module for a model of type gemma"):
        megatron_view(spec_from_config(dict(PHI3, model_type="gemma")))
    partial = hf_view(llama)
    partial = type(partial)(name="partial", top={}, layer=partial.layer, names=partial.names)
    with pytest.raises(LayoutError, match="the partial view has no name for the top tensor 'embed.weight'"):
        compose(llama, partial, REFERENCE)
