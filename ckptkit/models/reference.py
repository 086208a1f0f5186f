"""The reference trainer's view of a canonical model (pure), its config as a Hugging Face one,
and the canonical model and view of any checkpoint's layout (`model_of`, the tools' through
their adapters), with the names its modules hold (`modules_of`).

The reference trainer saves the canonical tensors under their canonical names (``model/`` +
``layers.3.attn.q.weight``): its view renames nothing and fuses nothing. Its Llama (layout
``llama``) is a Hugging Face ``LlamaForCausalLM`` and its mixture of experts (``llama-moe``) a
``MixtralForCausalLM``: `reference_hf_config` writes that config (rotary embeddings of the same
half-split convention, so q and k need no permutation), from which the canonical model is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..adapters import model_family
from ..errors import LayoutError
from ..layouts.model import Layout
from .hf_config import spec_from_config
from .spec import ModelSpec
from .view import Fuse, View


class _Same(dict[str, str]):
    """A name table that is the identity on every name."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str)

    def __getitem__(self, key: str) -> str:
        return key


REFERENCE = View(name="reference", top=_Same(), layer="layers.{layer}", names=_Same(), expert_names=_Same())
# The reference Llama's modules (``trainer.model.Stage`` at TP 1): q, k, v in one ``attn.qkv``, gate
# and up in one ``mlp.gate_up``, the head ``head``; what an FSDP2 job of the model holds.
REFERENCE_MODULES = View(name="reference-modules", top={"embed.weight": "embed.weight", "norm.weight": "norm.weight",
                                                        "lm_head.weight": "head.weight"},
                         layer="layers.{layer}", names=_Same(),
                         fused=(Fuse("attn.qkv.weight", ("attn.q.weight", "attn.k.weight", "attn.v.weight")),
                                Fuse("mlp.gate_up.weight", ("mlp.gate.weight", "mlp.up.weight"))))
KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
# The config keys each reference family's model needs; the others default as the trainer's model config does.
FAMILY_KEYS = {"llama": KEYS, "llama-moe": (*KEYS, "num_experts")}
DEFAULTS = {"max_seq_len": 256, "norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": False, "top_k": 2, "aux_loss_coef": 0.01}


def reference_hf_config(family: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The Hugging Face config (``config.json`` without its dtype) of the reference trainer's
    Llama (`family` ``llama``) or mixture of experts (``llama-moe``: Mixtral's, each token's
    ``top_k`` experts renormalized, no jitter, full attention, no biases).

    Raises:
        LayoutError: another family, a value missing, or ``top_k`` not between 1 and ``num_experts``.
    """
    if family not in FAMILY_KEYS:
        raise LayoutError(f"the reference trainer's families are {', '.join(FAMILY_KEYS)}, not {family!r}")
    missing = [k for k in FAMILY_KEYS[family] if k not in config]
    if missing:
        raise LayoutError(f"the {family} layout's config lacks {', '.join(missing)}")
    c = {**DEFAULTS, **config}
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c["vocab_size"],
        "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"], "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"], "num_key_value_heads": c["num_kv_heads"],
        "head_dim": c["hidden_size"] // c["num_heads"], "hidden_act": "silu", "max_position_embeddings": c["max_seq_len"],
        "rms_norm_eps": c["norm_eps"], "rope_theta": c["rope_theta"], "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": c["tie_embeddings"], "initializer_range": 0.02,
        "use_cache": True,
    }
    if family == "llama":
        return out
    top_k, experts = c["top_k"], c["num_experts"]
    if not (isinstance(top_k, int) and isinstance(experts, int) and 1 <= top_k <= experts):
        raise LayoutError(f"the llama-moe layout's config routes each token to top_k {top_k} of {experts} experts; "
                          "top_k must be between 1 and num_experts")
    for key in ("mlp_bias", "attention_bias", "rope_scaling"):
        del out[key]
    return {**out, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
            "num_experts_per_tok": top_k, "router_aux_loss_coef": c["aux_loss_coef"], "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def model_of(layout: Layout, carried: Mapping[str, Any] | None = None) -> tuple[ModelSpec, View]:
    """The canonical model of a checkpoint's layout and the view its tensors are saved in: the
    reference trainer's (``llama``, ``llama-moe``), or the view of the adapter whose family the
    layout is (`ckptkit.adapters.model_family`: Megatron-Core's ``megatron-gpt``, a Hugging Face
    ``hf-<model_type>`` or ``gpt2``, read from the `carried` ``config.json``, ...).

    Raises:
        LayoutError: a layout of no known tool, or a config the model cannot be read from (the
            value named).
    """
    if layout.name in FAMILY_KEYS:
        return spec_from_config(reference_hf_config(layout.name, layout.config)), REFERENCE
    family = model_family(layout.name)
    if family is None or family.model is None:
        raise LayoutError(f"the layout {layout.name!r} is no tool's view of a canonical model (known: llama, llama-moe, "
                          "megatron-gpt, hf-<model_type>)")
    return family.model(layout, carried)


def modules_of(layout: Layout, carried: Mapping[str, Any] | None = None) -> tuple[ModelSpec, View, View] | None:
    """The canonical model of a checkpoint's layout, the view its tensors are saved in, and the
    view of the names a job of the model holds in its modules (the keys an FSDP2 job's state dict
    gives): the reference trainer's Llama ``Stage`` (`REFERENCE_MODULES`), or the adapter's; None where
    no one declares the modules (the reference mixture of experts').

    Raises:
        LayoutError: as `model_of`.
    """
    spec, view = model_of(layout, carried)
    if layout.name == "llama":
        return spec, view, REFERENCE_MODULES
    if layout.name in FAMILY_KEYS:  # the mixture of experts' modules (its experts' own) are not declared
        return None
    family = model_family(layout.name)
    return (spec, view, family.modules(spec)) if family is not None and family.modules is not None else None


__all__ = ["FAMILY_KEYS", "REFERENCE", "REFERENCE_MODULES", "model_of", "modules_of", "reference_hf_config"]
