"""Megatron-Core's ``GPTModel`` as a view of a canonical model (pure), and its config both ways.

The names are those ``dist_checkpointing`` saves (its TransformerEngine spec's, which the local
spec maps its own to): per layer ``self_attention.linear_qkv`` fusing q, k and v interleaved per
query group (each group: its heads' q rows, then its k rows, then its v rows; biases alike),
the attention norm as ``linear_qkv``'s ``layer_norm_weight``, q/k norms per head
(``q_layernorm``, ``k_layernorm``), ``linear_proj``; a dense MLP's ``linear_fc1`` fusing ``[gate;
up]`` with its norm, ``linear_fc2``; a mixture of experts' ``mlp.router`` and each expert's
``mlp.experts.local_experts.<e>.linear_fc1`` / ``linear_fc2`` (``SequentialMLP``). The
vocabulary is stored padded to a multiple of the TP size where it is not one already (its
padding rows zero), as megatron-core's vocabulary-parallel embedding needs.

`megatron_config` is the ``megatron-gpt`` layout's config of a canonical model (what a
Megatron-Core job builds its ``TransformerConfig`` from); `hf_config_of_megatron` reads one
back as the Hugging Face config of the same model, so a Megatron GPT has a canonical model
too. An architecture megatron-core's GPT has no module for, or one whose Megatron names are not
written here yet, is refused, naming what it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptkit.errors import LayoutError
from ckptkit.models.hf_config import Config, spec_from_config
from ckptkit.models.spec import ModelSpec
from ckptkit.models.view import Fuse, View
from ckptkit_adapters.megatron.names import MEGATRON_LOCAL_EXPERTS

NAMES = {
    "attn_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "attn.o.weight": "self_attention.linear_proj.weight",
    "attn.q_norm.weight": "self_attention.q_layernorm.weight", "attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight", "mlp.down.weight": "mlp.linear_fc2.weight",
    "mlp.router.weight": "mlp.router.weight",
}
TOP = {"embed.weight": "embedding.word_embeddings.weight", "norm.weight": "decoder.final_layernorm.weight",
       "lm_head.weight": "output_layer.weight"}
FUSED = (*(Fuse(f"self_attention.linear_qkv.{p}", tuple(f"attn.{x}.{p}" for x in "qkv")) for p in ("weight", "bias")),
         Fuse("mlp.linear_fc1.weight", ("mlp.gate.weight", "mlp.up.weight")))
EXPERTS = MEGATRON_LOCAL_EXPERTS
# The Hugging Face model types megatron-core's GPTModel holds under this view; of the others,
# what megatron-core's GPTModel has no module for, and what this view does not write yet.
HELD = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe")
NO_MODULE = {
    "gemma": "embeddings scaled by sqrt(hidden) and (1 + w) norms",
    "gemma2": "norms on each sublayer's output and logit soft-capping",
    "olmo": "layer norms without weights",
    "olmo2": "norms on each sublayer's output alone",
    "gpt_neox": "attention and MLP in parallel on one residual",
}
NOT_WRITTEN = {
    "qwen2_moe": "its gated shared expert (moe_shared_expert_gate) and dense layers among MoE ones (moe_layer_freq)",
    "deepseek_v3": "multi-head latent attention (MLASelfAttention's names) and dense layers among MoE ones (moe_layer_freq)",
    "gpt2": "learned positions, biased linears and layer norms (position_embedding_type learned_absolute, add_bias_linear)",
}


def _held(spec: ModelSpec) -> None:
    t = spec.architecture
    if t in NO_MODULE:
        raise LayoutError(f"megatron-core's GPTModel has no module for a model of type {t}: it needs {NO_MODULE[t]}")
    if t not in HELD:
        what = NOT_WRITTEN.get(t, "its architecture")
        raise LayoutError(f"the Megatron-Core view of a model of type {t} is not written yet: {what}")
    rope = spec.config.get("rope_parameters") or spec.config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"
    if kind not in ("default", None):
        raise LayoutError(f"the Megatron-Core view of this {t} model is not written yet: its {kind!r} rotary scaling")
    window = spec.config.get("sliding_window")
    if t == "mistral" and window is not None and window < int(spec.config.get("max_position_embeddings") or 0):
        raise LayoutError(f"the Megatron-Core view of this mistral model is not written yet: its sliding-window attention "
                          f"(window {window})")
    act = spec.config.get("hidden_act", "silu")
    if act != "silu":
        raise LayoutError(f"the Megatron-Core view of this {t} model is not written yet: its MLP's {act!r} (the view's is SwiGLU)")


def padded_vocab(vocab: int, tp: int) -> int:
    """The rows a vocabulary is stored in at `tp`: the next multiple of `tp`."""
    return -(-vocab // tp) * tp


def megatron_view(spec: ModelSpec, vocab_rows: int = 0) -> View:
    """The Megatron-Core view of `spec`, its vocabulary stored in `vocab_rows` (0: unpadded).

    Raises:
        LayoutError: an architecture megatron-core's GPT does not hold (what it lacks named).
    """
    _held(spec)
    groups = int(spec.config.get("num_key_value_heads") or spec.config["num_attention_heads"])
    fused = tuple(Fuse(f.name, f.parts, groups) if f.name.startswith("self_attention.") else f for f in FUSED)
    return View(name="megatron-gpt", top=TOP, layer="decoder.layers.{layer}", names=NAMES, experts=EXPERTS,
                expert_names={"down.weight": "linear_fc2.weight"},
                expert_fused=(Fuse("linear_fc1.weight", ("gate.weight", "up.weight")),), fused=fused, vocab_rows=vocab_rows)


def _rope_theta(config: Mapping[str, Any]) -> Any:
    rope = config.get("rope_parameters")
    return rope.get("rope_theta") if isinstance(rope, Mapping) and "rope_theta" in rope else config.get("rope_theta", 10000.0)


def megatron_config(spec: ModelSpec, tp: int) -> dict[str, Any]:
    """The ``megatron-gpt`` layout's config of `spec` (Megatron-Core's names), its vocabulary
    padded for `tp` (the model's own in ``unpadded_vocab_size``).

    Raises:
        LayoutError: an architecture megatron-core's GPT does not hold.
    """
    _held(spec)
    c = Config(spec.config)
    heads, h, vocab = c.int("num_attention_heads"), c.int("hidden_size"), c.int("vocab_size")
    out: dict[str, Any] = {
        "num_layers": c.int("num_hidden_layers"), "hidden_size": h, "num_attention_heads": heads,
        "num_query_groups": c.int("num_key_value_heads", heads), "kv_channels": c.int("head_dim", h // heads),
        "ffn_hidden_size": c.int("intermediate_size"), "vocab_size": padded_vocab(vocab, tp), "unpadded_vocab_size": vocab,
        "gated_linear_unit": True, "share_embeddings_and_output_weights": spec.tied,
        "max_sequence_length": c.int("max_position_embeddings"), "layernorm_epsilon": spec.config.get("rms_norm_eps", 1e-6),
        "rotary_base": _rope_theta(spec.config),
    }
    names = {t.name for block in spec.layers for t in block.tensors}
    if "attn.q.bias" in names:
        out["add_qkv_bias"] = True
    if "attn.q_norm.weight" in names:
        out["qk_layernorm"] = True
    experts = max(block.experts for block in spec.layers)
    if experts:
        moe = next(b for b in spec.layers if b.experts).expert_tensors
        out |= {"num_moe_experts": experts, "moe_ffn_hidden_size": moe[0].shape[0], "moe_router_topk": c.int("num_experts_per_tok"),
                # Mixtral renormalizes the top k's weights (a softmax over them); Qwen3-MoE only if norm_topk_prob
                "moe_router_pre_softmax": spec.architecture == "qwen3_moe" and not spec.config.get("norm_topk_prob", False)}
    return out


# Megatron-LM's argument -> the megatron-gpt layout's config key (Megatron-Core's name), both ways.
ARGS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
        "ffn_hidden_size": "ffn_hidden_size", "padded_vocab_size": "vocab_size", "kv_channels": "kv_channels",
        "max_position_embeddings": "max_sequence_length", "norm_epsilon": "layernorm_epsilon", "rotary_base": "rotary_base",
        "num_query_groups": "num_query_groups", "num_experts": "num_moe_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
        "moe_router_topk": "moe_router_topk", "moe_router_pre_softmax": "moe_router_pre_softmax",
        "add_qkv_bias": "add_qkv_bias", "qk_layernorm": "qk_layernorm", "vocab_size": "unpadded_vocab_size"}


def megatron_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron-LM's arguments (``args`` in ``common.pt``) of the GPT a ``megatron-gpt`` layout's
    config describes: what a Megatron-LM job resumes with (``--use-checkpoint-args``), and what
    ``convert --from megatron`` reads the layout back from."""
    out = {theirs: config[mine] for theirs, mine in ARGS.items() if config.get(mine) is not None}
    heads = config.get("num_attention_heads")
    return {**out, "group_query_attention": config.get("num_query_groups", heads) != heads,
            "swiglu": config.get("gated_linear_unit", True) is not False, "add_bias_linear": False,
            "untie_embeddings_and_output_weights": not config.get("share_embeddings_and_output_weights"),
            "position_embedding_type": "rope", "normalization": "RMSNorm", "moe_grouped_gemm": False}


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_config_of_megatron(config: Mapping[str, Any]) -> dict[str, Any]:
    """The Hugging Face config (a ``config.json`` without its dtype) of the model a
    ``megatron-gpt`` layout's config describes: Llama, Qwen2 (q, k, v biases), Qwen3 (q/k norms),
    Mixtral or Qwen3-MoE (experts); the vocabulary unpadded.

    Raises:
        LayoutError: a value the model needs is missing, or a model no Hugging Face type is (an ungated MLP).
    """
    c = Config({"model_type": "megatron-gpt", **config})
    if config.get("gated_linear_unit", True) is False:
        raise LayoutError("this megatron-gpt model's MLP is not gated (gated_linear_unit false): no Hugging Face Llama-like model has one")
    heads, h = c.int("num_attention_heads"), c.int("hidden_size")
    experts, norms = c.int("num_moe_experts", 0), bool(config.get("qk_layernorm"))
    kind = ("qwen3_moe" if norms else "mixtral") if experts else "qwen3" if norms else "qwen2" if config.get("add_qkv_bias") else "llama"
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": c.int("unpadded_vocab_size", c.int("vocab_size")), "hidden_size": h,
        "intermediate_size": c.int("ffn_hidden_size"), "num_hidden_layers": c.int("num_layers"), "num_attention_heads": heads,
        "num_key_value_heads": c.int("num_query_groups", heads), "head_dim": c.int("kv_channels", h // heads), "hidden_act": "silu",
        "max_position_embeddings": c.int("max_sequence_length", 4096), "rms_norm_eps": config.get("layernorm_epsilon") or 1e-5,
        "rope_theta": config.get("rotary_base") or 10000.0, "tie_word_embeddings": bool(config.get("share_embeddings_and_output_weights")),
    }
    if kind == "llama":
        out |= {"attention_bias": False, "mlp_bias": False}
    if experts:
        f = c.int("moe_ffn_hidden_size", c.int("ffn_hidden_size"))
        out |= {"num_local_experts" if kind == "mixtral" else "num_experts": experts, "num_experts_per_tok": c.int("moe_router_topk", 2)}
        out |= {"intermediate_size": f} if kind == "mixtral" else {"moe_intermediate_size": f, "norm_topk_prob": not config.get("moe_router_pre_softmax")}
    return out


def megatron_model(config: Mapping[str, Any]) -> tuple[ModelSpec, View]:
    """The canonical model and Megatron view of a ``megatron-gpt`` layout's config."""
    spec = spec_from_config(hf_config_of_megatron(config))
    return spec, megatron_view(spec, int(config["vocab_size"]))


__all__ = ["ARGS", "hf_config_of_megatron", "megatron_args", "megatron_config", "megatron_model", "megatron_view", "padded_vocab"]
