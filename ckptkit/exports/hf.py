"""The Hugging Face form of a checkpoint's model (pure): tensor names, config files, shard plan.

The reference trainer saves unfused, unpadded logical tensors (``model/layers.3.attn.q.weight``),
so the Hugging Face Llama layout is a rename: same shapes, same bytes (its rotary embedding uses
the same half-split convention, so q and k need no permutation). Its mixture of experts (layout
``llama-moe``) is likewise a rename to ``MixtralForCausalLM``, under the per-expert names of the
Mixtral checkpoints on the Hub (`mixtral_name`). Megatron-Core's GPT (layout
``megatron-gpt``) fuses q, k, v per query group and gate, up: each Hugging Face tensor is then
runs of rows of a fused one (`Rows`), taken in order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError, summarize
from ..layouts import Layout
from ..layouts.names import LAYER_NAME, LLAMA_TO_HF_LAYER, LLAMA_TO_HF_TOP, MEGATRON_TO_HF_LAYER, MEGATRON_TO_HF_TOP, hf_name
from ..manifest import CheckpointInfo
from ..state.tree import unescape

# Rows [start, start + length) of a source tensor (dim 0), concatenated in order; None: all of it.
Rows = tuple[tuple[int, int], ...] | None
# A Hugging Face tensor's source: a checkpoint tensor (fqn) and which of its rows.
Piece = tuple[str, Rows]



# The reference Llama's mixture of experts (layout ``llama-moe``) under the names of the Mixtral
# checkpoints on the Hub: attention and norms as the Llama's, the router as the sparse block's
# ``gate``, each expert's gate, down and up as w1, w2 and w3. transformers 5 fuses the experts
# in memory (``experts.gate_up_proj``, ``experts.down_proj``) and converts these names when it
# loads; vLLM and older transformers read them as they are.
MIXTRAL_LAYER = {k: v for k, v in LLAMA_TO_HF_LAYER.items() if not k.startswith("mlp.")} | {
    "mlp.router.weight": "block_sparse_moe.gate.weight"}
MIXTRAL_EXPERT = {"gate.weight": "w1.weight", "down.weight": "w2.weight", "up.weight": "w3.weight"}
EXPERT_NAME = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")


def mixtral_name(logical: str) -> str | None:
    """Return the Hugging Face Mixtral name of a ``llama-moe`` parameter, or None if it has none."""
    if logical in LLAMA_TO_HF_TOP:
        return LLAMA_TO_HF_TOP[logical]
    match = LAYER_NAME.match(logical)
    if not match:
        return None
    layer, rest = match.groups()
    expert = EXPERT_NAME.match(rest)
    if expert and expert.group(2) in MIXTRAL_EXPERT:
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert.group(1)}.{MIXTRAL_EXPERT[expert.group(2)]}"
    return f"model.layers.{layer}.{MIXTRAL_LAYER[rest]}" if rest in MIXTRAL_LAYER else None


# How each reference family's parameters are named under Hugging Face.
RENAMES: dict[str, Callable[[str], str | None]] = {"llama": hf_name, "llama-moe": mixtral_name}


def name_map(tensors: Mapping[str, Any], expected: list[str], rename: Callable[[str], str | None] = hf_name) -> dict[str, str]:
    """Map every parameter (``model/<name>``) of a checkpoint to its Hugging Face name.

    Args:
        tensors: the checkpoint's tensors by fqn.
        expected: the logical parameter names the model config implies.
        rename: the family's name map (a logical name to its Hugging Face name, or None).

    Raises:
        LayoutError: a parameter has no Hugging Face name, the model config has no place for
            one (an ``lm_head`` with tied embeddings, an expert past ``num_experts``), or an
            expected one is missing; all of them are listed.
    """
    names = {fqn: rename(fqn.removeprefix("model/")) for fqn in sorted(tensors) if fqn.startswith("model/")}
    known = set(expected)
    refuse_unmapped([fqn for fqn, name in names.items() if name is None], tensors, expected,
                    [fqn for fqn, name in names.items() if name is not None and fqn.removeprefix("model/") not in known])
    return {fqn: name or "" for fqn, name in names.items()}


def refuse_unmapped(
    unmapped: list[str], tensors: Mapping[str, Any], expected: Iterable[str], extra: list[str] | None = None
) -> None:
    """Fail, listing them, when parameters have no Hugging Face name, `extra` ones have no place
    in the model config, or the `expected` ones (logical names, without ``model/``) are not all
    among `tensors`.

    Raises:
        LayoutError: any of them (all listed).
    """
    missing = sorted(f"model/{n}" for n in expected if f"model/{n}" not in tensors)
    problems = []
    if unmapped:
        problems.append(f"{len(unmapped)} tensor(s) with no Hugging Face name: {', '.join(unmapped[:20])}")
    if extra:
        problems.append(f"{len(extra)} tensor(s) the model config has no place for (tie_embeddings, num_layers, "
                        f"num_experts): {', '.join(extra[:20])}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model config needs are missing: {', '.join(missing[:20])}")
    if problems:
        raise LayoutError("cannot export: " + summarize(problems))


def megatron_map(tensors: Mapping[str, Any], layout: Layout) -> dict[str, Piece]:
    """Map a Megatron-Core GPT (layout ``megatron-gpt``) to Hugging Face Llama names: each HF
    name to its source tensor and rows. q, k and v are taken from ``linear_qkv`` group by group
    (each group: its heads' q rows, then one head's k rows, then v's); gate and up are the two
    halves of ``linear_fc1``.

    Raises:
        LayoutError: a parameter with no Hugging Face name (biases, an ungated MLP), or one
            the layout needs is missing; all are listed.
    """
    c = layout.config
    heads, h = int(c["num_attention_heads"]), int(c["hidden_size"])  # type: ignore[arg-type]
    groups = int(c.get("num_query_groups") or heads)  # type: ignore[arg-type]
    hd, f = int(c.get("kv_channels") or h // heads), int(c["ffn_hidden_size"])  # type: ignore[arg-type]
    per = heads // groups
    block = (per + 2) * hd
    out: dict[str, Piece] = {}
    unmapped = []
    for fqn in sorted(t for t in tensors if t.startswith("model/")):
        name = unescape(fqn.removeprefix("model/"))
        match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
        if name in MEGATRON_TO_HF_TOP:
            out[MEGATRON_TO_HF_TOP[name]] = (fqn, None)
        elif match and match.group(2) in MEGATRON_TO_HF_LAYER:
            out[f"model.layers.{match.group(1)}.{MEGATRON_TO_HF_LAYER[match.group(2)]}"] = (fqn, None)
        elif match and match.group(2) == "self_attention.linear_qkv.weight":
            p = f"model.layers.{match.group(1)}.self_attn."
            out[p + "q_proj.weight"] = (fqn, tuple((g * block, per * hd) for g in range(groups)))
            out[p + "k_proj.weight"] = (fqn, tuple((g * block + per * hd, hd) for g in range(groups)))
            out[p + "v_proj.weight"] = (fqn, tuple((g * block + (per + 1) * hd, hd) for g in range(groups)))
        elif match and match.group(2) == "mlp.linear_fc1.weight" and c.get("gated_linear_unit", True) is not False:
            p = f"model.layers.{match.group(1)}.mlp."
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = (fqn, ((0, f),)), (fqn, ((f, f),))
        else:
            unmapped.append(fqn)
    refuse_unmapped(unmapped, tensors, layout.tensors())
    return out


def megatron_config_json(layout: Layout, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of the LlamaForCausalLM a Megatron-Core GPT (RMSNorm, rotary, SwiGLU,
    no biases) is, from its layout's config (defaults: Megatron's)."""
    c = layout.config
    heads, h = int(c["num_attention_heads"]), int(c["hidden_size"])  # type: ignore[arg-type]
    model = {
        "vocab_size": c["vocab_size"], "hidden_size": h, "intermediate_size": c["ffn_hidden_size"],
        "num_layers": c["num_layers"], "num_heads": heads, "num_kv_heads": c.get("num_query_groups") or heads,
        "max_seq_len": c.get("max_sequence_length") or 4096, "norm_eps": c.get("layernorm_epsilon") or 1e-5,
        "rope_theta": c.get("rotary_base") or 10000, "tie_embeddings": bool(c.get("share_embeddings_and_output_weights")),
    }
    return {**config_json(model, dtype), "head_dim": int(c.get("kv_channels") or h // heads)}  # type: ignore[arg-type]


def passthrough(layout: Layout) -> bool:
    """Whether the layout's tensors are already under their Hugging Face names (``model/<name>``,
    as the ``hf`` converter writes them: a Hugging Face view, ``hf-<model_type>``, or ``gpt2`` as
    checkpoints converted before the views recorded it): export renames nothing and writes back
    the carried config.json."""
    return layout.name.startswith("hf-") or layout.name == "gpt2"


def passthrough_map(tensors: Mapping[str, Any], expected: list[str]) -> dict[str, str]:
    """Map every parameter (``model/<name>``) of a checkpoint in a `passthrough` layout to its
    Hugging Face name, ``<name>`` unescaped.

    Raises:
        LayoutError: an expected parameter is missing (all are listed).
    """
    missing = sorted(f"model/{n}" for n in expected if f"model/{n}" not in tensors)
    if missing:
        raise LayoutError(f"cannot export: {len(missing)} tensor(s) the layout needs are missing: {', '.join(missing[:20])}")
    return {fqn: unescape(fqn.removeprefix("model/")) for fqn in sorted(tensors) if fqn.startswith("model/")}


def carried_config(info: CheckpointInfo, layout: Layout, where: str, dtype: str) -> dict[str, Any]:
    """The ``config.json`` a converted checkpoint carries (``info.config``), its dtype set to `dtype`.

    Raises:
        LayoutError: the checkpoint carries none (it was not converted from Hugging Face).
    """
    carried = (info.config or {}).get("config.json")
    if not isinstance(carried, dict):
        raise LayoutError(f"{where}: the layout {layout.name!r} exports with the config.json the checkpoint carries "
                          f"(info.config, written by convert --from hf); this checkpoint has none")
    key = "dtype" if "dtype" in carried else "torch_dtype"
    return {**carried, key: dtype}


def sort_key(name: str) -> tuple[Any, ...]:
    """Order Hugging Face names as a model's modules come: embedding, layers by number, norm, head."""
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if match:  # numbers within a layer's names (experts) in numeric order
        rest = tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", match.group(2))))
        return (1, int(match.group(1)), rest)
    return ({"model.embed_tokens.weight": 0, "model.norm.weight": 2}.get(name, 3), 0, name)


@dataclass(frozen=True, slots=True)
class Shard:
    """One output file: its name and the tensors it holds, in order."""

    file: str
    names: tuple[str, ...]


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[Shard]:
    """Cut the tensors (in module order) into files of at most `max_shard_bytes` (a larger
    tensor gets a file of its own), named ``model-0000k-of-0000n.safetensors``."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in sorted(sizes, key=sort_key):
        if groups[-1] and size + sizes[name] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += sizes[name]
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
               "max_seq_len", "norm_eps", "rope_theta", "tie_embeddings")
# The config keys each reference family's export needs.
FAMILY_KEYS = {"llama": CONFIG_KEYS, "llama-moe": (*CONFIG_KEYS, "num_experts", "top_k", "aux_loss_coef")}


def llama_config(layout: Layout, where: str) -> dict[str, Any]:
    """Return the reference Llama's config (or its mixture of experts') a Hugging Face export
    needs, from the checkpoint's layout.

    Raises:
        LayoutError: the layout is neither ``llama`` nor ``llama-moe``, its config lacks a
            value, or its ``top_k`` is not between 1 and ``num_experts``.
    """
    if layout.name not in FAMILY_KEYS:
        raise LayoutError(f"{where}: the checkpoint's layout is {layout.name!r}; export --format hf maps the layouts "
                          + ", ".join(repr(f) for f in FAMILY_KEYS))
    missing = [k for k in FAMILY_KEYS[layout.name] if k not in layout.config]
    if missing:
        raise LayoutError(f"{where}: the {layout.name} layout's config lacks {', '.join(missing)}")
    c = dict(layout.config)
    top_k, experts = c.get("top_k"), c.get("num_experts")
    if layout.name == "llama-moe" and not (isinstance(top_k, int) and isinstance(experts, int) and 1 <= top_k <= experts):
        raise LayoutError(f"{where}: the llama-moe layout's config routes each token to top_k {c['top_k']} of "
                          f"{c['num_experts']} experts; top_k must be between 1 and num_experts")
    return c


def model_config_json(family: str, model: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a reference family's model: `config_json` or `mixtral_config_json`."""
    return mixtral_config_json(model, dtype) if family == "llama-moe" else config_json(model, dtype)


def config_json(model: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a LlamaForCausalLM with the reference trainer's model config."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["intermediate_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_heads"],
        "num_key_value_heads": model["num_kv_heads"],
        "head_dim": model["hidden_size"] // model["num_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": model["max_seq_len"],
        "rms_norm_eps": model["norm_eps"],
        "rope_theta": model["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": model["tie_embeddings"],
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def mixtral_config_json(model: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """The ``config.json`` of a MixtralForCausalLM with the reference trainer's mixture-of-experts
    config: the Llama's, with its experts, each token's ``top_k`` of them (renormalized, no
    jitter), full attention (no sliding window) and no biases."""
    llama = config_json(model, dtype)
    del llama["mlp_bias"], llama["attention_bias"], llama["rope_scaling"]
    return {
        **llama,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": model["num_experts"],
        "num_experts_per_tok": model["top_k"],
        "router_aux_loss_coef": model["aux_loss_coef"],
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def generation_config_json(eos_token_id: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"_from_model_config": True}
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    return out


def tokenizer_config_json(tokenizer: Mapping[str, Any], max_length: int) -> dict[str, Any]:
    """A ``tokenizer_config.json`` for a bare ``tokenizer.json``: the fast tokenizer class and its
    special tokens (``<unk>``, ``<eos>``, ``<bos>``, ``<pad>`` when the vocabulary has them)."""
    vocab = tokenizer.get("model", {}).get("vocab", {})
    specials = {"unk_token": "<unk>", "eos_token": "<eos>", "bos_token": "<bos>", "pad_token": "<pad>"}
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
    out.update({key: tok for key, tok in specials.items() if tok in vocab})
    return out
