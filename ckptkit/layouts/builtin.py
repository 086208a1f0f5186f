"""Built-in layouts, each made from a model config (pure): the reference trainer's Llama and its mixture of
experts (``FAMILIES``), and those the adapters declare (`ckptkit.adapters.Family`): any Hugging Face
model with a canonical model (``hf``, from its ``config.json``; ``hf-llama`` and ``gpt2`` name two of
them), Megatron-Core's GPT (``megatron-gpt``).

``builtin(family, config)`` returns one; `families` lists them. A checkpoint written before
layouts were recorded names its model in ``info.model`` (family and config): its layout is
the built-in one of that family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..errors import LayoutError
from ..adapters import families as declared_families
from ..adapters import layout_family
from .model import Constraint, Layout, Param, TensorPart, TPCut, Unit

L = "{layer}"


def param(name: str, parts: list[tuple[str, tuple[int, ...]]], dim: int | None = None, **cut: int) -> Param:
    """A parameter fusing whole tensors along `dim` (None: replicated over TP)."""
    tp = None if dim is None else TPCut(dim=dim, **cut)
    return Param(name=name, parts=tuple(TensorPart(tensor=t, shape=s) for t, s in parts), tp=tp)


def fused_param(name: str, tensor: str, shape: tuple[int, ...], dim: int, sizes: list[int]) -> Param:
    """A parameter that is one tensor fused of partitions of `sizes` along `dim` (GPT-2's c_attn)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    parts = tuple(TensorPart(tensor=tensor, shape=shape, start=a, length=n) for a, n in zip(starts, sizes))
    return Param(name=name, parts=parts, tp=TPCut(dim=dim))


def need(config: Mapping[str, Any], keys: tuple[str, ...], family: str) -> dict[str, Any]:
    missing = [k for k in keys if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if missing:
        raise LayoutError(f"the {family} layout needs integer config values {', '.join(missing)}")
    return dict(config)


LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def reference_llama(config: Mapping[str, Any]) -> Layout:
    """The reference trainer's Llama: ``model/<name>`` and both Adam moments; q, k, v fused per
    TP rank and gate, up likewise (each split evenly), vocabularies padded to a multiple of tp."""
    c = need(config, LLAMA_KEYS, "llama")
    h, f = c["hidden_size"], c["intermediate_size"]
    p = f"layers.{L}."
    layer = Unit(name=f"layers.{L}", place="layers", params=(
        *_llama_attention(c),
        param("mlp_norm.weight", [(p + "mlp_norm.weight", (h,))]),
        param("mlp.gate_up.weight", [(p + "mlp.gate.weight", (f, h)), (p + "mlp.up.weight", (f, h))], 0),
        param("mlp.down.weight", [(p + "mlp.down.weight", (h, f))], 1),
    ))
    return _decoder("llama", c, c["num_layers"], (layer,), ("embed", "embed.weight"), ("norm", "norm.weight"),
                    "lm_head.weight", bool(c.get("tie_embeddings")), c["num_kv_heads"])


def reference_llama_moe(config: Mapping[str, Any]) -> Layout:
    """The reference trainer's mixture of experts (Mixtral's structure): the Llama's layers with
    the MLP replaced by a router (``layers.<i>.mlp.router.weight`` [experts, hidden], replicated
    over TP) and ``num_experts`` SwiGLU experts (``layers.<i>.mlp.experts.<e>.{gate,up,down}.weight``,
    cut over TP as the dense MLP is, and over EP: an expert unit per layer)."""
    c = need(config, (*LLAMA_KEYS, "num_experts"), "llama-moe")
    h, f, experts = c["hidden_size"], c["intermediate_size"], c["num_experts"]
    p = f"layers.{L}."
    e = p + "mlp.experts.{expert}."
    layer = Unit(name=f"layers.{L}", place="layers", params=(
        *_llama_attention(c),
        param("mlp_norm.weight", [(p + "mlp_norm.weight", (h,))]),
        param("mlp.router.weight", [(p + "mlp.router.weight", (experts, h))]),
    ))
    moe = Unit(name=f"layers.{L}.experts", place="layers", experts=experts, params=(
        param("{expert}.gate_up.weight", [(e + "gate.weight", (f, h)), (e + "up.weight", (f, h))], 0),
        param("{expert}.down.weight", [(e + "down.weight", (h, f))], 1),
    ))
    return _decoder("llama-moe", c, c["num_layers"], (layer, moe), ("embed", "embed.weight"), ("norm", "norm.weight"),
                    "lm_head.weight", bool(c.get("tie_embeddings")), c["num_kv_heads"])


def _llama_attention(c: dict[str, Any]) -> tuple[Param, ...]:
    """The reference Llama's attention parameters of a layer: its norm, fused QKV and output."""
    h, heads, kv = c["hidden_size"], c["num_heads"], c["num_kv_heads"]
    hd = h // heads
    p = f"layers.{L}."
    return (
        param("attn_norm.weight", [(p + "attn_norm.weight", (h,))]),
        param("attn.qkv.weight", [(p + "attn.q.weight", (heads * hd, h)), (p + "attn.k.weight", (kv * hd, h)),
                                   (p + "attn.v.weight", (kv * hd, h))], 0),
        param("attn.o.weight", [(p + "attn.o.weight", (h, heads * hd))], 1),
    )


def _decoder(
    name: str, config: dict[str, Any], layers: int, layer: tuple[Unit, ...], embed: tuple[str, str], norm: tuple[str, str],
    head: str, tied: bool, kv: int,
) -> Layout:
    """A decoder-only layout: the (unit, tensor) of a vocabulary-parallel embedding first, the
    layer's units, the final norm and (unless tied to the embedding) a vocabulary-parallel head last."""
    v, h, heads = config["vocab_size"], config["hidden_size"], config.get("num_heads") or config["num_attention_heads"]
    units = [Unit(name=embed[0], place="first", params=(param("weight", [(embed[1], (v, h))], 0, pad_multiple=1),)),
             *layer, Unit(name=norm[0], place="last", params=(param("weight", [(norm[1], (h,))]),))]
    constraints = [Constraint(axis="tp", divides=heads, what="attention heads"),
                   Constraint(axis="tp", divides=kv, what="key/value heads")]
    if tied:
        constraints.append(Constraint(axis="pp", at_most=1, what="tied embeddings need the embedding and the head on one stage"))
    else:
        units.append(Unit(name="lm_head", place="last", params=(param("weight", [(head, (v, h))], 0, pad_multiple=1),)))
    return Layout(name=name, config=config, num_layers=layers, units=tuple(units), constraints=tuple(constraints))


FAMILIES: dict[str, Callable[[Mapping[str, Any]], Layout]] = {"llama": reference_llama, "llama-moe": reference_llama_moe}


def builtin(family: str, config: Mapping[str, Any]) -> Layout:
    """Return the built-in layout of `family` for a model `config`.

    Raises:
        LayoutError: an unknown family, or a config that lacks what the layout needs.
    """
    make = FAMILIES.get(family)
    if make is None:
        declared = layout_family(family)
        make = declared.layout if declared is not None else None
    if make is None:
        raise LayoutError(f"no built-in layout for model family {family!r}; built in: {', '.join(families())}")
    return make(config)


def families() -> list[str]:
    """The names of every built-in layout: the reference trainer's and the adapters'."""
    return sorted({*FAMILIES, *(f.name for f in declared_families() if f.layout is not None)})

