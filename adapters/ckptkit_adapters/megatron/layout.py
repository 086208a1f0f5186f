"""Megatron-Core's GPT as a ckptkit layout (pure): the ``megatron-gpt`` built-in family, the layout the
megatron reader records and the megatron writer cuts by."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptkit.errors import LayoutError
from ckptkit.layouts.builtin import L, fused_param, need, param
from ckptkit.layouts.model import DEFAULT_STATES, Constraint, Layout, Param, StateGroup, Unit
from ckptkit_adapters.megatron.names import MEGATRON_LOCAL_EXPERTS

MEGATRON_GPT_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size")


def megatron_gpt(config: Mapping[str, Any]) -> Layout:
    """A Megatron-Core ``GPTModel`` (local or TransformerEngine layer spec, no biases but q, k, v's) under
    Megatron's names, layers split per layer (``decoder.layers.<i>.…``, as the ``megatron``
    converter writes them): ``linear_qkv`` fused and interleaved per query group (so a TP rank
    holds a run of whole groups: a dim-0 cut), ``linear_fc1`` of a gated MLP ``[gate; up]`` (each
    cut over TP), row-parallel ``linear_proj`` and ``linear_fc2`` cut on dim 1, the vocabulary
    (already padded by Megatron) cut on dim 0; fp32 masters and both Adam moments.

    Config: Megatron's names (``num_layers``, ``hidden_size``, ``num_attention_heads``,
    ``ffn_hidden_size``, ``vocab_size``; optional ``num_query_groups``, ``kv_channels``,
    ``gated_linear_unit`` (default true), ``share_embeddings_and_output_weights`` (default false),
    ``add_qkv_bias`` (``linear_qkv.bias``, interleaved as its weight), ``qk_layernorm`` (per-head
    ``q_layernorm``, ``k_layernorm``), ``unpadded_vocab_size`` (the model's vocabulary, when
    ``vocab_size`` holds padding rows),
    ``num_moe_experts`` with ``moe_ffn_hidden_size`` (default ``ffn_hidden_size``) for a mixture
    of experts, and for export ``max_sequence_length``, ``layernorm_epsilon``, ``rotary_base``,
    ``moe_router_topk``).

    A mixture of experts (megatron-core's MoE layer, ``SequentialMLP`` experts): each layer's MLP
    is its router (``mlp.router.weight`` [experts, hidden], replicated over TP) and an expert unit
    of ``num_moe_experts`` MLPs, ``decoder.layers.<i>.mlp.experts.local_experts.<e>.linear_fc1`` /
    ``linear_fc2`` (e the global expert: as megatron-core saves them at any EP), cut over TP as
    the dense MLP's and over EP by expert; the pre-MLP norm keeps the dense key."""
    c = need(config, MEGATRON_GPT_KEYS, "megatron-gpt")
    experts = c.get("num_moe_experts")
    if experts is not None and (not isinstance(experts, int) or isinstance(experts, bool) or experts < 1):
        raise LayoutError(f"the megatron-gpt layout needs num_moe_experts a positive integer, not {experts!r}")
    h, f, v, heads = c["hidden_size"], c["ffn_hidden_size"], c["vocab_size"], c["num_attention_heads"]
    groups = c.get("num_query_groups") or heads
    hd = c.get("kv_channels") or h // heads
    gated = c.get("gated_linear_unit", True) is not False
    p = f"decoder.layers.{L}."
    qkv = (heads + 2 * groups) * hd
    layer = Unit(name=f"decoder.layers.{L}", place="layers", params=(
        param("self_attention.linear_qkv.layer_norm_weight", [(p + "self_attention.linear_qkv.layer_norm_weight", (h,))]),
        param("self_attention.linear_qkv.weight", [(p + "self_attention.linear_qkv.weight", (qkv, h))], 0),
        *((param("self_attention.linear_qkv.bias", [(p + "self_attention.linear_qkv.bias", (qkv,))], 0),)
          if c.get("add_qkv_bias") else ()),
        *(param(f"self_attention.{x}_layernorm.weight", [(f"{p}self_attention.{x}_layernorm.weight", (hd,))])
          for x in ("q", "k") if c.get("qk_layernorm")),
        param("self_attention.linear_proj.weight", [(p + "self_attention.linear_proj.weight", (h, heads * hd))], 1),
        param("mlp.linear_fc1.layer_norm_weight", [(p + "mlp.linear_fc1.layer_norm_weight", (h,))]),
        *(_megatron_mlp("mlp.", p + "mlp.", h, f, gated) if experts is None else
          (param("mlp.router.weight", [(p + "mlp.router.weight", (experts, h))]),)),
    ))
    moe = () if experts is None else (Unit(name=p + "mlp.experts", place="layers", experts=experts, params=_megatron_mlp(
        "{expert}.", f"{p}{MEGATRON_LOCAL_EXPERTS}.{{expert}}.", h, c.get("moe_ffn_hidden_size") or f, gated)),)
    units = [Unit(name="embedding", place="first", params=(param("word_embeddings.weight", [("embedding.word_embeddings.weight", (v, h))], 0),)),
             layer, *moe,
             Unit(name="decoder.final_layernorm", place="last", params=(param("weight", [("decoder.final_layernorm.weight", (h,))]),))]
    constraints = [Constraint(axis="tp", divides=groups, what="query groups (a TP rank holds whole groups of the fused QKV)"),
                   Constraint(axis="tp", divides=v, what="rows of the (padded) vocabulary")]
    if c.get("share_embeddings_and_output_weights"):
        constraints.append(Constraint(axis="pp", at_most=1, what="tied embeddings need the embedding and the head on one stage"))
    else:
        units.append(Unit(name="output_layer", place="last", params=(param("weight", [("output_layer.weight", (v, h))], 0),)))
    states = (DEFAULT_STATES[0], StateGroup(prefix="optimizer/fp32", role="optimizer"), *DEFAULT_STATES[1:])
    return Layout(name="megatron-gpt", config=c, num_layers=c["num_layers"], units=tuple(units), states=states,
                  constraints=tuple(constraints))


def _megatron_mlp(name: str, tensor: str, h: int, f: int, gated: bool) -> tuple[Param, ...]:
    """Megatron's MLP (a dense layer's, or one expert's): ``linear_fc1`` (``[gate; up]`` when
    gated, each cut over TP) and the row-parallel ``linear_fc2``, as params `name`* of tensors `tensor`*."""
    fc1 = (fused_param(name + "linear_fc1.weight", tensor + "linear_fc1.weight", (2 * f, h), 0, [f, f]) if gated
           else param(name + "linear_fc1.weight", [(tensor + "linear_fc1.weight", (f, h))], 0))
    return fc1, param(name + "linear_fc2.weight", [(tensor + "linear_fc2.weight", (h, f))], 1)
