"""The Hugging Face view of each canonical model (pure): the names ``save_pretrained`` writes.

One table of names for the Llama family, with each member's differences (its norms, its
mixture-of-experts names, Phi-3's fused ``qkv_proj`` and ``gate_up_proj``), and one each for
GPT-NeoX (per-head ``query_key_value``) and GPT-2 (``Conv1D`` matrices stored [in, out],
``c_attn`` fusing q, k, v). `hf_layout(config)` is the layout of a ``config.json``'s model under
these names: what ``convert --from hf`` records, so that the checkpoint reshards and exports
with no layout named. `module_view` is the names transformers' modules hold in memory (what an
FSDP2 job's state dict holds), where they are not the files'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckptkit.errors import LayoutError
from ckptkit.layouts.model import Layout
from ckptkit.models.hf_config import READERS, spec_from_config
from ckptkit.models.spec import ModelSpec
from ckptkit.models.view import Fuse, View, layout_of

_PROJ = {f"attn.{x}.{p}": f"self_attn.{x}_proj.{p}" for x in ("q", "k", "v", "o", "q_a", "q_b", "kv_b") for p in ("weight", "bias")}
_MLP = {f"mlp.{x}.{p}": f"mlp.{x}_proj.{p}" for x in ("gate", "up", "down") for p in ("weight", "bias")}
LLAMA_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    **_PROJ, **_MLP,
    "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn.kv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a.bias": "self_attn.kv_a_proj_with_mqa.bias", "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "mlp.router.weight": "mlp.gate.weight", "mlp.router.score_bias": "mlp.gate.e_score_correction_bias",
    **{f"mlp.shared.{x}.weight": f"mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")},
    "mlp.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
TIED_WEIGHTS = "hf/tied_weights"  # the value a converted model's tied tensors are recorded in (head -> embedding)
LLAMA_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
EXPERT_NAMES = {f"{x}.weight": f"{x}_proj.weight" for x in ("gate", "up", "down")}
# Each member's names where they are not the Llama's.
NORMS = {
    "gemma2": {"attn_out_norm.weight": "post_attention_layernorm.weight", "mlp_norm.weight": "pre_feedforward_layernorm.weight",
               "mlp_out_norm.weight": "post_feedforward_layernorm.weight"},
    "olmo2": {"attn_out_norm.weight": "post_attention_layernorm.weight", "mlp_out_norm.weight": "post_feedforward_layernorm.weight"},
    "deepseek_v3": {f"mlp.shared.{x}.weight": f"mlp.shared_experts.{x}_proj.weight" for x in ("gate", "up", "down")},
    "mixtral": {"mlp.router.weight": "block_sparse_moe.gate.weight"},
}
MIXTRAL_EXPERT = {"gate.weight": "w1.weight", "down.weight": "w2.weight", "up.weight": "w3.weight"}
PHI3_FUSED = (Fuse("self_attn.qkv_proj.weight", ("attn.q.weight", "attn.k.weight", "attn.v.weight")),
              Fuse("mlp.gate_up_proj.weight", ("mlp.gate.weight", "mlp.up.weight")))


def _llama(spec: ModelSpec) -> View:
    t = spec.architecture
    return View(name=f"hf-{t}", top=LLAMA_TOP, layer="model.layers.{layer}", names={**LLAMA_NAMES, **NORMS.get(t, {})},
                experts="block_sparse_moe.experts" if t == "mixtral" else "mlp.experts",
                expert_names=MIXTRAL_EXPERT if t == "mixtral" else EXPERT_NAMES, fused=PHI3_FUSED if t == "phi3" else ())


def _gpt_neox(spec: ModelSpec) -> View:
    heads = int(spec.config["num_attention_heads"])
    names = {f"{n}.{p}": f"{hf}.{p}" for n, hf in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
                                                    ("attn.o", "attention.dense"), ("mlp.up", "mlp.dense_h_to_4h"),
                                                    ("mlp.down", "mlp.dense_4h_to_h")) for p in ("weight", "bias")}
    fused = tuple(Fuse(f"attention.query_key_value.{p}", tuple(f"attn.{x}.{p}" for x in "qkv"), groups=heads) for p in ("weight", "bias"))
    top = {"embed.weight": "gpt_neox.embed_in.weight", "norm.weight": "gpt_neox.final_layer_norm.weight",
           "norm.bias": "gpt_neox.final_layer_norm.bias", "lm_head.weight": "embed_out.weight"}
    return View(name="hf-gpt_neox", top=top, layer="gpt_neox.layers.{layer}", names=names, fused=fused)


def _gpt2(spec: ModelSpec) -> View:
    names = {f"{n}.{p}": f"{hf}.{p}" for n, hf in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"), ("attn.o", "attn.c_proj"),
                                                    ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")) for p in ("weight", "bias")}
    fused = tuple(Fuse(f"attn.c_attn.{p}", tuple(f"attn.{x}.{p}" for x in "qkv")) for p in ("weight", "bias"))
    top = {"embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
           "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias", "lm_head.weight": "lm_head.weight"}
    return View(name="hf-gpt2", top=top, layer="transformer.h.{layer}", names=names, fused=fused, transposed=True)


# Where transformers' modules name a tensor otherwise than its files do (it renames them as it
# loads and saves): their in-memory names are what an FSDP2 job's state dict holds.
MODULE_NAMES: dict[str, dict[str, str]] = {"gpt_neox": {"embed_out.weight": "lm_head.weight"}}
# A mixture of experts in memory (transformers 5): each layer's experts stacked, ``[gate; up]`` of
# every expert in ``experts.gate_up_proj`` [experts, 2 x ffn, hidden], ``experts.down_proj``
# [experts, hidden, ffn]; Mixtral's sparse block is its ``mlp``.
STACKED_EXPERTS = (Fuse("gate_up_proj", ("gate.weight", "up.weight")), Fuse("down_proj", ("down.weight",)))


def module_names(config: Mapping[str, Any]) -> dict[str, str]:
    """The file names of a Hugging Face model whose modules name them otherwise, with those names."""
    return MODULE_NAMES.get(str(config.get("model_type")), {})


def module_view(spec: ModelSpec) -> View:
    """The names of `spec`'s tensors in transformers' modules (``model.state_dict()``), where they
    are not its files' (``hf_view``): a renamed head, a mixture of experts' stacked experts."""
    files = hf_view(spec)
    renames = module_names(spec.config)
    top = {name: renames.get(full, full) for name, full in files.top.items()}
    tied = {renames.get(h, h): renames.get(e, e) for h, e in tied_heads(spec.config).items()}
    modules = replace(files, name=f"{files.name}-modules", top=top, tied=tied)
    if not any(block.experts for block in spec.layers):
        return modules
    names = {k: v.replace("block_sparse_moe.", "mlp.") for k, v in files.names.items()}
    stacks = tuple(Fuse(f"mlp.experts.{f.name}", f.parts) for f in STACKED_EXPERTS)
    return replace(modules, names=names, expert_stacks=stacks)


def tied_heads(config: Mapping[str, Any]) -> dict[str, str]:
    """A tied model's head (its Hugging Face name, which ``save_pretrained`` does not store) with
    the embedding it shares; empty for an untied model or a model type with no canonical model.

    Raises:
        LayoutError: a config value the model needs is missing or wrong.
    """
    if str(config.get("model_type")) not in READERS:
        return {}
    spec = spec_from_config(config)
    view = hf_view(spec)
    return {view.rename("top", "lm_head.weight"): view.rename("top", "embed.weight")} if spec.tied else {}


def hf_view(spec: ModelSpec) -> View:
    """The Hugging Face view of `spec` (its names as ``save_pretrained`` writes them)."""
    make = {"gpt-neox": _gpt_neox, "gpt2": _gpt2}.get(spec.family, _llama)
    return make(spec)


def hf_layout(config: Mapping[str, Any]) -> Layout:
    """The layout of the model a Hugging Face ``config.json`` describes, under its Hugging Face names.

    Raises:
        LayoutError: a model type with no canonical model, or a config value missing or wrong.
    """
    spec = spec_from_config(config)
    return layout_of(spec, hf_view(spec))


def hf_llama(config: Mapping[str, Any]) -> Layout:
    """A Hugging Face ``LlamaForCausalLM`` (or another ``model_type`` the config names) under its
    Hugging Face names: the layout of its canonical model's Hugging Face view."""
    return hf_layout({"model_type": "llama", **config})


def gpt2(config: Mapping[str, Any]) -> Layout:
    """A Hugging Face ``GPT2LMHeadModel`` under its Hugging Face names (``Conv1D`` weights
    stored [in, out]; ``c_attn`` fuses q, k, v; the head is tied, so pp 1)."""
    return hf_layout({**config, "model_type": "gpt2"})


def hf_model(layout: Layout, carried: Mapping[str, Any] | None) -> tuple[ModelSpec, View]:
    """The canonical model of a checkpoint laid out as a Hugging Face view (``hf-<model_type>``,
    ``gpt2``), read from its ``config.json``: the layout's config (as `hf_layout` makes it),
    else the one the checkpoint carries (`carried`; a layout written by hand may say less).

    Raises:
        LayoutError: neither holds a config.json, or the model cannot be read from it.
    """
    config = layout.config if "model_type" in layout.config else carried
    if not isinstance(config, Mapping):
        raise LayoutError(f"the layout {layout.name!r} is a Hugging Face model's, read from its config.json, and neither "
                          "the layout's config nor the checkpoint (info.config) holds one")
    spec = spec_from_config(config)
    return spec, hf_view(spec)

