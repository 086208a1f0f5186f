"""How a model family's logical parameter names map to another tool's names (pure).

The reference trainer's Llama (layout ``llama``) is a Hugging Face ``LlamaForCausalLM`` under
other names: `hf_name` renames one parameter (exports write Hugging Face directories with it,
a weights-only start reads one back with it). Megatron-Core's GPT renames to both, fused
tensors aside.
"""

from __future__ import annotations

import re

LLAMA_TO_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
LLAMA_TO_HF_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")

# Megatron-Core's GPT (layout ``megatron-gpt``) under Hugging Face Llama names (fused q, k, v
# and gate, up are cut, not renamed: ``exports.hf.megatron_map``).
MEGATRON_TO_HF_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
MEGATRON_TO_HF_TOP = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                      "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}

# The reference trainer's Llama under Megatron-Core's names (q, k, v and gate, up are fused,
# not renamed: ``exports.megatron.fused_llama``).
LLAMA_TO_MEGATRON_LAYER = {"attn_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
                           "attn.o.weight": "self_attention.linear_proj.weight",
                           "mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight", "mlp.down.weight": "mlp.linear_fc2.weight"}
LLAMA_TO_MEGATRON_TOP = {"embed.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight",
                         "lm_head.weight": "output_layer.weight"}


def hf_name(logical: str) -> str | None:
    """Return the Hugging Face Llama name of a logical parameter name, or None if it has none."""
    if logical in LLAMA_TO_HF_TOP:
        return LLAMA_TO_HF_TOP[logical]
    match = LAYER_NAME.match(logical)
    if match and match.group(2) in LLAMA_TO_HF_LAYER:
        return f"model.layers.{match.group(1)}.{LLAMA_TO_HF_LAYER[match.group(2)]}"
    return None


__all__ = ["LAYER_NAME", "LLAMA_TO_HF_LAYER", "LLAMA_TO_HF_TOP", "LLAMA_TO_MEGATRON_LAYER", "LLAMA_TO_MEGATRON_TOP",
           "MEGATRON_TO_HF_LAYER", "MEGATRON_TO_HF_TOP", "hf_name"]
