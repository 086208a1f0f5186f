"""Built-in layouts: the reference trainer's Llama and its mixture of experts, any Hugging Face model with a
canonical model (``hf``, from its ``config.json``; ``hf-llama`` and ``gpt2`` name two of them), and
Megatron-Core's GPT, each made from a model config (pure).

``builtin(family, config)`` returns one; ``FAMILIES`` lists them. A checkpoint written before
layouts were recorded names its model in ``info.model`` (family and config): its layout is
the built-in one of that family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import LayoutError
from .names import MEGATRON_LOCAL_EXPERTS
from .model import DEFAULT_STATES, Constraint, Layout, Param, StateGroup, TensorPart, TPCut, Unit

L = "{layer}"


def _param(name: str, parts: list[tuple[str, tuple[int, ...]]], dim: int | None = None, **cut: int) -> Param:
    """A parameter fusing whole tensors along `dim` (None: replicated over TP)."""
    tp = None if dim is None else TPCut(dim=dim, **cut)
    return Param(name=name, parts=tuple(TensorPart(tensor=t, shape=s) for t, s in parts), tp=tp)


def _fused(name: str, tensor: str, shape: tuple[int, ...], dim: int, sizes: list[int]) -> Param:
    """A parameter that is one tensor fused of partitions of `sizes` along `dim` (GPT-2's c_attn)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = tuple(TensorPart(tensor=tensor, shape=shape, start=a, length=n) for a, n in zip(starts, sizes))
    return Param(name=name, parts=parts, tp=TPCut(dim=dim))


def _need(config: Mapping[str, Any], keys: tuple[str, ...], family: str) -> dict[str, Any]:
    missing = [k for k in keys if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if missing:
        raise LayoutError(f"the {family} layout needs integer config values {', '.join(missing)}")
    return dict(config)


LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def reference_llama(config: Mapping[str, Any]) -> Layout:
    """The reference trainer's Llama: ``model/<name>`` and both Adam moments; q, k, v fused per
    TP rank and gate, up likewise (each split evenly), vocabularies padded to a multiple of tp."""
    c = _need(config, LLAMA_KEYS, "llama")
    h, f = c["hidden_size"], c["intermediate_size"]
    p = f"layers.{L}."
    layer = Unit(name=f"layers.{L}", place="layers", params=(
        *_llama_attention(c),
        _param("mlp_norm.weight", [(p + "mlp_norm.weight", (h,))]),
        _param("mlp.gate_up.weight", [(p + "mlp.gate.weight", (f, h)), (p + "mlp.up.weight", (f, h))], 0),
        _param("mlp.down.weight", [(p + "mlp.down.weight", (h, f))], 1),
    ))
    return _decoder("llama", c, c["num_layers"], (layer,), ("embed", "embed.weight"), ("norm", "norm.weight"),
                    "lm_head.weight", bool(c.get("tie_embeddings")), c["num_kv_heads"])


def reference_llama_moe(config: Mapping[str, Any]) -> Layout:
    """The reference trainer's mixture of experts (Mixtral's structure): the Llama's layers with
    the MLP replaced by a router (``layers.<i>.mlp.router.weight`` [experts, hidden], replicated
    over TP) and ``num_experts`` SwiGLU experts (``layers.<i>.mlp.experts.<e>.{gate,up,down}.weight``,
    cut over TP as the dense MLP is, and over EP: an expert unit per layer)."""
    c = _need(config, (*LLAMA_KEYS, "num_experts"), "llama-moe")
    h, f, experts = c["hidden_size"], c["intermediate_size"], c["num_experts"]
    p = f"layers.{L}."
    e = p + "mlp.experts.{expert}."
    layer = Unit(name=f"layers.{L}", place="layers", params=(
        *_llama_attention(c),
        _param("mlp_norm.weight", [(p + "mlp_norm.weight", (h,))]),
        _param("mlp.router.weight", [(p + "mlp.router.weight", (experts, h))]),
    ))
    moe = Unit(name=f"layers.{L}.experts", place="layers", experts=experts, params=(
        _param("{expert}.gate_up.weight", [(e + "gate.weight", (f, h)), (e + "up.weight", (f, h))], 0),
        _param("{expert}.down.weight", [(e + "down.weight", (h, f))], 1),
    ))
    return _decoder("llama-moe", c, c["num_layers"], (layer, moe), ("embed", "embed.weight"), ("norm", "norm.weight"),
                    "lm_head.weight", bool(c.get("tie_embeddings")), c["num_kv_heads"])


def _llama_attention(c: dict[str, Any]) -> tuple[Param, ...]:
    """The reference Llama's attention parameters of a layer: its norm, fused QKV and output."""
    h, heads, kv = c["hidden_size"], c["num_heads"], c["num_kv_heads"]
    hd = h // heads
    p = f"layers.{L}."
    return (
        _param("attn_norm.weight", [(p + "attn_norm.weight", (h,))]),
        _param("attn.qkv.weight", [(p + "attn.q.weight", (heads * hd, h)), (p + "attn.k.weight", (kv * hd, h)),
                                   (p + "attn.v.weight", (kv * hd, h))], 0),
        _param("attn.o.weight", [(p + "attn.o.weight", (h, heads * hd))], 1),
    )


def _decoder(
    name: str, config: dict[str, Any], layers: int, layer: tuple[Unit, ...], embed: tuple[str, str], norm: tuple[str, str],
    head: str, tied: bool, kv: int,
) -> Layout:
    """A decoder-only layout: the (unit, tensor) of a vocabulary-parallel embedding first, the
    layer's units, the final norm and (unless tied to the embedding) a vocabulary-parallel head last."""
    v, h, heads = config["vocab_size"], config["hidden_size"], config.get("num_heads") or config["num_attention_heads"]
    units = [Unit(name=embed[0], place="first", params=(_param("weight", [(embed[1], (v, h))], 0, pad_multiple=1),)),
             *layer, Unit(name=norm[0], place="last", params=(_param("weight", [(norm[1], (h,))]),))]
    constraints = [Constraint(axis="tp", divides=heads, what="attention heads"),
                   Constraint(axis="tp", divides=kv, what="key/value heads")]
    if tied:
        constraints.append(Constraint(axis="pp", at_most=1, what="tied embeddings need the embedding and the head on one stage"))
    else:
        units.append(Unit(name="lm_head", place="last", params=(_param("weight", [(head, (v, h))], 0, pad_multiple=1),)))
    return Layout(name=name, config=config, num_layers=layers, units=tuple(units), constraints=tuple(constraints))


def hf_llama(config: Mapping[str, Any]) -> Layout:
    """A Hugging Face ``LlamaForCausalLM`` (or another ``model_type`` the config names) under its
    Hugging Face names: the layout of its canonical model's Hugging Face view."""
    return hf({"model_type": "llama", **config})


def gpt2(config: Mapping[str, Any]) -> Layout:
    """A Hugging Face ``GPT2LMHeadModel`` under its Hugging Face names (``Conv1D`` weights
    stored [in, out]; ``c_attn`` fuses q, k, v; the head is tied, so pp 1)."""
    return hf({**config, "model_type": "gpt2"})


def hf(config: Mapping[str, Any]) -> Layout:
    """The model a Hugging Face ``config.json`` describes (any ``model_type`` with a canonical
    model, ``ckptkit.models``) under its Hugging Face names."""
    from ..models.hf_view import hf_layout  # models build layouts: imported when first asked, not with this package

    return hf_layout(config)


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
    c = _need(config, MEGATRON_GPT_KEYS, "megatron-gpt")
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
        _param("self_attention.linear_qkv.layer_norm_weight", [(p + "self_attention.linear_qkv.layer_norm_weight", (h,))]),
        _param("self_attention.linear_qkv.weight", [(p + "self_attention.linear_qkv.weight", (qkv, h))], 0),
        *((_param("self_attention.linear_qkv.bias", [(p + "self_attention.linear_qkv.bias", (qkv,))], 0),)
          if c.get("add_qkv_bias") else ()),
        *(_param(f"self_attention.{x}_layernorm.weight", [(f"{p}self_attention.{x}_layernorm.weight", (hd,))])
          for x in ("q", "k") if c.get("qk_layernorm")),
        _param("self_attention.linear_proj.weight", [(p + "self_attention.linear_proj.weight", (h, heads * hd))], 1),
        _param("mlp.linear_fc1.layer_norm_weight", [(p + "mlp.linear_fc1.layer_norm_weight", (h,))]),
        *(_megatron_mlp("mlp.", p + "mlp.", h, f, gated) if experts is None else
          (_param("mlp.router.weight", [(p + "mlp.router.weight", (experts, h))]),)),
    ))
    moe = () if experts is None else (Unit(name=p + "mlp.experts", place="layers", experts=experts, params=_megatron_mlp(
        "{expert}.", f"{p}{MEGATRON_LOCAL_EXPERTS}.{{expert}}.", h, c.get("moe_ffn_hidden_size") or f, gated)),)
    units = [Unit(name="embedding", place="first", params=(_param("word_embeddings.weight", [("embedding.word_embeddings.weight", (v, h))], 0),)),
             layer, *moe,
             Unit(name="decoder.final_layernorm", place="last", params=(_param("weight", [("decoder.final_layernorm.weight", (h,))]),))]
    constraints = [Constraint(axis="tp", divides=groups, what="query groups (a TP rank holds whole groups of the fused QKV)"),
                   Constraint(axis="tp", divides=v, what="rows of the (padded) vocabulary")]
    if c.get("share_embeddings_and_output_weights"):
        constraints.append(Constraint(axis="pp", at_most=1, what="tied embeddings need the embedding and the head on one stage"))
    else:
        units.append(Unit(name="output_layer", place="last", params=(_param("weight", [("output_layer.weight", (v, h))], 0),)))
    states = (DEFAULT_STATES[0], StateGroup(prefix="optimizer/fp32", role="optimizer"), *DEFAULT_STATES[1:])
    return Layout(name="megatron-gpt", config=c, num_layers=c["num_layers"], units=tuple(units), states=states,
                  constraints=tuple(constraints))


def _megatron_mlp(name: str, tensor: str, h: int, f: int, gated: bool) -> tuple[Param, ...]:
    """Megatron's MLP (a dense layer's, or one expert's): ``linear_fc1`` (``[gate; up]`` when
    gated, each cut over TP) and the row-parallel ``linear_fc2``, as params `name`* of tensors `tensor`*."""
    fc1 = (_fused(name + "linear_fc1.weight", tensor + "linear_fc1.weight", (2 * f, h), 0, [f, f]) if gated
           else _param(name + "linear_fc1.weight", [(tensor + "linear_fc1.weight", (f, h))], 0))
    return fc1, _param(name + "linear_fc2.weight", [(tensor + "linear_fc2.weight", (h, f))], 1)


FAMILIES: dict[str, Callable[[Mapping[str, Any]], Layout]] = {
    "llama": reference_llama, "llama-moe": reference_llama_moe, "hf": hf, "hf-llama": hf_llama, "gpt2": gpt2,
    "megatron-gpt": megatron_gpt,
}


def builtin(family: str, config: Mapping[str, Any]) -> Layout:
    """Return the built-in layout of `family` for a model `config`.

    Raises:
        LayoutError: an unknown family, or a config that lacks what the layout needs.
    """
    make = FAMILIES.get(family)
    if make is None:
        raise LayoutError(f"no built-in layout for model family {family!r}; built in: {', '.join(sorted(FAMILIES))}")
    return make(config)

