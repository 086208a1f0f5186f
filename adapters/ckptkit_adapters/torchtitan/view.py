"""torchtitan's Llama 3 as a view of a canonical model (pure), and the model read from its tensors.

torchtitan (0.3) saves its ``Llama3Model``'s flattened state dict under the module's names:
``tok_embeddings.weight``, per layer ``attention_norm``, ``attention.qkv_linear.wq`` / ``wk`` /
``wv`` (saved apart even where the module fuses them in memory), ``attention.wo``,
``ffn_norm``, ``feed_forward.w1`` (gate), ``w3`` (up), ``w2`` (down); ``norm.weight`` and
``lm_head.weight``. Its q and k rows are in the original Llama's rotary order (each head's
rotary pairs side by side, as its complex rotary embedding takes them), where the canonical
model, as Hugging Face's, keeps each head's two halves one after the other: the view says
so (``View.rotary``), and every conversion reorders those rows. Its optimizer's state is keyed
by the names the modules hold (`torchtitan_modules`): q, k and v as one ``wqkv`` per layer.

A torchtitan checkpoint records no model config: `config_of` reads the sizes from the
tensors' shapes and takes from the user what shapes cannot say (the attention heads), the
rotary base and the norm's epsilon defaulting to torchtitan's Llama 3's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptkit.errors import LayoutError
from ckptkit.layouts import Layout
from ckptkit.models.hf_config import spec_from_config
from ckptkit.models.spec import ModelSpec
from ckptkit.models.view import Fuse, View, layout_of

PREFIX = "torchtitan-"  # a torchtitan view's layout: torchtitan-<model type>
NAME = "torchtitan-llama"
TOP = {"embed.weight": "tok_embeddings.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
NAMES = {"attn_norm.weight": "attention_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
         **{f"attn.{x}.weight": f"attention.qkv_linear.w{x}.weight" for x in "qkv"}, "attn.o.weight": "attention.wo.weight",
         "mlp.gate.weight": "feed_forward.w1.weight", "mlp.down.weight": "feed_forward.w2.weight",
         "mlp.up.weight": "feed_forward.w3.weight"}
WQKV = "attention.qkv_linear.wqkv.weight"  # q, k and v fused, as the module holds them (relative to the layer)
QK_NORMS = {"attn.q_norm.weight": "attention.q_norm.weight", "attn.k_norm.weight": "attention.k_norm.weight"}  # Qwen3's
# The model types torchtitan has a model of its own for (its names not written here yet), and that model.
OWN_MODELS = {"qwen3_moe": "Qwen3 (mixture of experts, its experts stacked)", "deepseek_v3": "DeepSeek-V3"}
# What shapes do not say, as torchtitan's Llama 3 has it unless its config says otherwise.
DEFAULTS = {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192}
QWEN3_DEFAULTS = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}  # torchtitan's Qwen3's
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def torchtitan_view(spec: ModelSpec) -> View:
    """torchtitan's view of `spec`: its Llama 3 (q and k in the original Llama's rotary order) or
    its Qwen3 (q/k norms; cos/sin rotary embeddings, Hugging Face's half-split order), named
    ``torchtitan-<model type>``.

    Raises:
        LayoutError: a model of another type, or with biases (torchtitan's other models' names
            are not written here yet).
    """
    t = spec.architecture
    if t in OWN_MODELS:
        raise LayoutError(f"the torchtitan view of a model of type {t} is not written yet: torchtitan's {OWN_MODELS[t]} model's names")
    if t not in ("llama", "qwen3") or any(x.name.endswith(".bias") for b in spec.layers for x in b.tensors):
        raise LayoutError(f"torchtitan has no model for a model of type {t}"
                          f"{' with biases' if t == 'llama' else ''}: its Llama 3 holds a Llama without biases, its Qwen3 a dense Qwen3")
    heads = int(spec.config["num_attention_heads"])
    head = int(spec.config.get("head_dim") or int(spec.config["hidden_size"]) // heads)
    tied = {TOP["lm_head.weight"]: TOP["embed.weight"]} if spec.tied else {}  # a tied job saves the shared weight under both
    if t == "qwen3":
        return View(name=f"{PREFIX}qwen3", top=TOP, layer="layers.{layer}", names={**NAMES, **QK_NORMS}, tied=tied)
    return View(name=NAME, top=TOP, layer="layers.{layer}", names=NAMES, rotary={"attn.q.weight": head, "attn.k.weight": head},
                tied=tied)


def torchtitan_modules(spec: ModelSpec) -> View:
    """The names torchtitan's Llama holds in memory, which its optimizer's state is keyed by:
    q, k and v fused per key/value group in ``attention.qkv_linear.wqkv`` (``FusedQKVLinear``,
    torchtitan's Llama 3 default: each group its heads' q rows, then its k rows, then its v
    rows; q and k in rotary order), the rest as saved.

    Raises:
        LayoutError: as `torchtitan_view`.
    """
    saved = torchtitan_view(spec)
    groups = int(spec.config.get("num_key_value_heads") or spec.config["num_attention_heads"])
    return replace(saved, name=f"{saved.name}-modules", fused=(Fuse(WQKV, ("attn.q.weight", "attn.k.weight", "attn.v.weight"), groups),))


def torchtitan_layout(config: Mapping[str, Any]) -> Layout:
    """The ``torchtitan-<model type>`` layout of a Hugging Face Llama or Qwen3 config (``ckptkit
    layout builtin torchtitan-llama``; a config without ``model_type`` is a Llama's).

    Raises:
        LayoutError: a config the canonical model cannot read, or of a model torchtitan's view does not hold.
    """
    spec = spec_from_config({"model_type": "llama", **config})
    return layout_of(spec, torchtitan_view(spec))


def torchtitan_model(layout: Layout) -> tuple[ModelSpec, View]:
    """The canonical model and torchtitan view of a ``torchtitan-<model type>`` layout (its config the model's)."""
    spec = spec_from_config({"model_type": layout.name.removeprefix(PREFIX), **layout.config})
    return spec, torchtitan_view(spec)


_LAYER = re.compile(r"layers\.(\d+)\.")


def config_of(shapes: Mapping[str, tuple[int, ...]], given: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The Hugging Face config of the torchtitan Llama whose tensors have `shapes` (their
    torchtitan names), with what the user `given` over what shapes and defaults say; and the
    values assumed (torchtitan's defaults, none given).

    Raises:
        LayoutError: tensors that are not torchtitan's Llama's or Qwen3's, no attention heads given for a Llama
            (shapes cannot tell heads from their size), heads that do not divide q's rows, or a
            size given that the shapes contradict (the tensor named).
    """
    need = ("tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight", "layers.0.attention.qkv_linear.wk.weight",
            "layers.0.feed_forward.w1.weight")
    missing = [n for n in need if n not in shapes]
    if missing:
        older = "layers.0.attention.wq.weight" in shapes
        raise LayoutError(f"not torchtitan's Llama 3 or Qwen3 (0.3): no {', '.join(missing)}"
                          + (" (attention.wq without qkv_linear: torchtitan before 0.3, whose names are not written here yet)"
                             if older else ""))
    vocab, hidden = shapes["tok_embeddings.weight"]
    q, k = shapes["layers.0.attention.qkv_linear.wq.weight"][0], shapes["layers.0.attention.qkv_linear.wk.weight"][0]
    norm = shapes.get("layers.0.attention.q_norm.weight")  # Qwen3's q/k norms: their size is the heads'
    if norm is None and "num_attention_heads" not in given:
        raise LayoutError("a torchtitan checkpoint does not record its attention heads: give --model-config num_attention_heads=N "
                          "(and rope_theta, rms_norm_eps where not torchtitan's)")
    heads = int(given["num_attention_heads"]) if norm is None else q // norm[0]
    if heads <= 0 or q % heads:
        raise LayoutError(f"num_attention_heads {heads} does not divide the {q} rows of layers.0.attention.qkv_linear.wq.weight")
    head = q // heads
    kind, defaults = ("llama", DEFAULTS) if norm is None else ("qwen3", QWEN3_DEFAULTS)
    inferred = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": vocab, "hidden_size": hidden,
                "intermediate_size": shapes["layers.0.feed_forward.w1.weight"][0],
                "num_hidden_layers": len({m.group(1) for n in shapes if (m := _LAYER.match(n))}),
                "num_attention_heads": heads, "num_key_value_heads": k // head, "head_dim": head, "hidden_act": "silu",
                "tie_word_embeddings": "lm_head.weight" not in shapes, "attention_bias": False,
                **({"mlp_bias": False} if kind == "llama" else {})}
    shown = {"vocab_size": "tok_embeddings.weight", "hidden_size": "tok_embeddings.weight",
             "intermediate_size": "layers.0.feed_forward.w1.weight", "num_key_value_heads": "layers.0.attention.qkv_linear.wk.weight",
             "head_dim": "layers.0.attention.qkv_linear.wq.weight", "num_hidden_layers": "layers.<i>",
             "num_attention_heads": "layers.0.attention.q_norm.weight", "model_type": "layers.0.attention.q_norm.weight"}
    for key, where in shown.items():
        if key in given and given[key] != inferred[key]:
            raise LayoutError(f"--model-config {key}={given[key]}: the save's {where} says {inferred[key]}")
    if given.get("tie_word_embeddings") and "lm_head.weight" in shapes:  # a tied job (enable_weight_tying) saves the head too
        raise LayoutError("--model-config tie_word_embeddings=true: the save holds lm_head.weight, and is read as an untied model "
                          "whose head holds the embedding's values")
    assumed = [f"{key} {value}" for key, value in defaults.items() if key not in given]
    return {**inferred, **defaults, **given}, assumed


__all__ = ["DEFAULTS", "NAME", "PREFIX", "QWEN3_DEFAULTS", "WQKV", "config_of", "torchtitan_layout", "torchtitan_model", "torchtitan_modules", "torchtitan_view"]
