"""How a model family's logical parameter names map to another tool's names (pure).

The reference trainer's Llama (layout ``llama``) is a Hugging Face ``LlamaForCausalLM`` under
other names: `hf_name` renames one parameter (exports write Hugging Face directories with it,
a weights-only start reads one back with it). Megatron-Core's GPT renames to both, fused
tensors aside; the reference mixture of experts renames to Megatron-Core's MoE layer.
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
# Its mixture of experts (layout ``llama-moe``) under the names of Megatron-Core's MoE layer
# (local spec, ``SequentialMLP`` experts): the pre-MLP norm (``pre_mlp_layernorm``) is saved
# under the dense layer's key, the router as it is; each expert is an MLP of its own, saved
# per layer and expert (``local_experts.<e>`` with e the global expert index, as at EP 1) and
# stacked by megatron-core under ``MEGATRON_EXPERTS`` on a (layer, expert) axis pair.
LLAMA_MOE_TO_MEGATRON_LAYER = {"attn_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
                               "attn.o.weight": "self_attention.linear_proj.weight",
                               "mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight", "mlp.router.weight": "mlp.router.weight"}
LLAMA_MOE_TO_MEGATRON_EXPERT = {"down.weight": "linear_fc2.weight"}  # gate, up: fused into linear_fc1
MEGATRON_LOCAL_EXPERTS = "mlp.experts.local_experts"
MEGATRON_EXPERTS = "mlp.experts.experts"
# The linear modules whose ``_extra_state`` megatron-core asks for (``None`` in the local spec).
MEGATRON_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
MEGATRON_MOE_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv")
MEGATRON_EXPERT_EXTRA_STATE = (f"{MEGATRON_EXPERTS}.linear_fc1", f"{MEGATRON_EXPERTS}.linear_fc2")


def hf_name(logical: str) -> str | None:
    """Return the Hugging Face Llama name of a logical parameter name, or None if it has none."""
    if logical in LLAMA_TO_HF_TOP:
        return LLAMA_TO_HF_TOP[logical]
    match = LAYER_NAME.match(logical)
    if match and match.group(2) in LLAMA_TO_HF_LAYER:
        return f"model.layers.{match.group(1)}.{LLAMA_TO_HF_LAYER[match.group(2)]}"
    return None


__all__ = ["LAYER_NAME", "LLAMA_MOE_TO_MEGATRON_EXPERT", "LLAMA_MOE_TO_MEGATRON_LAYER", "LLAMA_TO_HF_LAYER", "LLAMA_TO_HF_TOP",
           "LLAMA_TO_MEGATRON_LAYER", "LLAMA_TO_MEGATRON_TOP", "MEGATRON_EXPERTS", "MEGATRON_EXPERT_EXTRA_STATE", "MEGATRON_EXTRA_STATE",
           "MEGATRON_LOCAL_EXPERTS", "MEGATRON_MOE_EXTRA_STATE", "MEGATRON_TO_HF_LAYER", "MEGATRON_TO_HF_TOP", "hf_name"]
