"""A weights-only start (``--init-from``): the model another checkpoint holds, as the trainer builds it.

The model config comes from the source: the trainer's own checkpoints record theirs
(``info.model``, family ``llama``); a Hugging Face Llama converted by ``ckptkit convert``
records its ``config.json`` (family ``hf-llama``). A source the trainer cannot build (biases,
another activation, scaled rotary embeddings, a vocabulary smaller than its tokenizer), or
one that is not the model asked for (``--model``, ``--tie-embeddings``), is refused with every
reason in one line. Loading the parameters is ``ckptkit.load_weights`` (names mapped there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from .. import Manifest, RunError
from .config import MODELS, ModelConfig, TrainConfig

# What the trainer builds, and the Hugging Face config values that mean the same.
_HF_FIXED = {"model_type": "llama", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
_SIZE_KEYS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
_MOE_KEYS = ("num_experts", "top_k", "aux_loss_coef")  # a dense model's config does not record them


def source_model(cfg: TrainConfig, manifest: Manifest, where: str, *, min_vocab: int) -> ModelConfig:
    """Return the model the checkpoint at `where` holds, as the trainer builds it.

    Args:
        min_vocab: the trainer's tokenizer size; the source's vocabulary must hold its ids.

    Raises:
        RunError: the checkpoint names no model the trainer builds, or not the one `cfg` asks
            for (every reason listed).
    """
    info = manifest.info.model
    if info is None or info.family not in ("llama", "llama-moe", "hf-llama"):
        family = "none (no info.model)" if info is None else repr(info.family)
        raise RunError(f"{where}: --init-from needs a Llama checkpoint (the trainer's own, or a Hugging Face Llama "
                       f"converted by ckptkit convert); its model family is {family}")
    config = dict(info.config)
    values, problems = _from_hf(config) if info.family == "hf-llama" else _from_llama(config)
    model = ModelConfig(**values) if not problems else None
    if model is not None:
        problems += _asked(cfg, model, min_vocab)
    if problems or model is None:
        raise RunError(f"{where}: cannot start from its weights: " + "; ".join(problems))
    return model


def _from_llama(config: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The trainer's own model config (``info.model.config`` of family ``llama`` or ``llama-moe``)."""
    names = [f.name for f in fields(ModelConfig)]
    missing = [n for n in names if n not in config and n not in _MOE_KEYS]
    return {n: config[n] for n in names if n in config}, [f"its model config lacks {', '.join(missing)}"] if missing else []


def recorded_model(config: Mapping[str, Any]) -> ModelConfig | None:
    """The model a trainer checkpoint records (``info.model.config``), or None if incomplete."""
    values, problems = _from_llama(config)
    return None if problems else ModelConfig(**values)


def _from_hf(c: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A Hugging Face Llama ``config.json`` as the trainer's model config (transformers' defaults
    for absent keys), and what in it the trainer does not build."""
    problems = [f"{key} {c[key]!r} (the trainer builds {want!r})" for key, want in _HF_FIXED.items() if c.get(key, want) != want]
    rope = c.get("rope_parameters") or {}  # transformers 5; 4 has rope_theta and rope_scaling
    if c.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        problems.append("scaled rotary embeddings (the trainer builds plain ones)")
    hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads and c.get("head_dim") not in (None, hidden // heads):
        problems.append(f"head_dim {c['head_dim']} (the trainer's is hidden_size / num_attention_heads = {hidden // heads})")
    values = {
        "vocab_size": c.get("vocab_size"), "hidden_size": hidden, "intermediate_size": c.get("intermediate_size"),
        "num_layers": c.get("num_hidden_layers"), "num_heads": heads, "num_kv_heads": c.get("num_key_value_heads") or heads,
        "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))), "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)), "max_seq_len": c.get("max_position_embeddings", 2048),
    }
    odd = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "max_seq_len")
           if not isinstance(values[k], int) or isinstance(values[k], bool) or values[k] < 1]
    problems += [f"config.json lacks a positive integer for {k}" for k in odd]
    return values, problems


def _asked(cfg: TrainConfig, model: ModelConfig, min_vocab: int) -> list[str]:
    """What keeps the trainer from building `model` as `cfg` asks."""
    problems = []
    if cfg.model is not None:
        if cfg.model not in MODELS:
            problems.append(f"unknown --model {cfg.model!r}")
        else:
            named = MODELS[cfg.model]
            diff = [f"{k} {getattr(model, k)} (--model {cfg.model}: {named.get(k, 0)})" for k in (*_SIZE_KEYS, "num_experts")
                    if getattr(model, k) != named.get(k, 0)]
            if diff:
                problems.append("its model is not --model " + cfg.model + ": " + ", ".join(diff) + "; drop --model to train the checkpoint's")
    if cfg.tie_embeddings and not model.tie_embeddings:
        problems.append("--tie-embeddings, but its embedding and output head are separate")
    if model.hidden_size % model.num_heads or model.num_heads % model.num_kv_heads:
        problems.append(f"{model.num_heads} heads and {model.num_kv_heads} key/value heads do not divide hidden size "
                        f"{model.hidden_size} and the heads evenly")
    if model.vocab_size < min_vocab:
        problems.append(f"its vocabulary ({model.vocab_size} tokens) is smaller than the trainer's tokenizer ({min_vocab}), "
                        "whose token ids it must hold")
    return problems


def parent(where: str, manifest: Manifest) -> dict[str, Any]:
    """The lineage a run started from `where` records in its checkpoints (``info.config.parent``)."""
    family = manifest.info.model.family if manifest.info.model is not None else None
    return {"path": where, "checkpoint_id": manifest.checkpoint_id, "step": manifest.step, "family": family}


def describe(model: ModelConfig) -> str:
    """A model in a few words: its size and shape."""
    return (f"hidden {model.hidden_size}, {model.num_layers} layers, {model.num_heads} heads ({model.num_kv_heads} kv), "
            f"vocabulary {model.vocab_size}{', tied embeddings' if model.tie_embeddings else ''}")
