"""The Hugging Face form of a checkpoint's model (pure): tensor names, config files, shard plan.

The reference trainer saves unfused, unpadded logical tensors (``model/layers.3.attn.q.weight``),
so the Hugging Face Llama layout is a rename: same shapes, same bytes (its rotary embedding uses
the same half-split convention, so q and k need no permutation). Megatron-Core's GPT (layout
``megatron-gpt``) fuses q, k, v per query group and gate, up: each Hugging Face tensor is then
runs of rows of a fused one (`Rows`), taken in order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError, summarize
from ..layouts import Layout
from ..layouts.names import MEGATRON_TO_HF_LAYER, MEGATRON_TO_HF_TOP, hf_name
from ..manifest import CheckpointInfo
from ..state.tree import unescape

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# Rows [start, start + length) of a source tensor (dim 0), concatenated in order; None: all of it.
Rows = tuple[tuple[int, int], ...] | None
# A Hugging Face tensor's source: a checkpoint tensor (fqn) and which of its rows.
Piece = tuple[str, Rows]



def name_map(tensors: Mapping[str, Any], expected: list[str]) -> dict[str, str]:
    """Map every parameter (``model/<name>``) of a checkpoint to its Hugging Face name.

    Args:
        tensors: the checkpoint's tensors by fqn.
        expected: the logical parameter names the model config implies.

    Raises:
        LayoutError: a parameter has no Hugging Face name, or an expected one is missing;
            all of them are listed.
    """
    params = sorted(fqn for fqn in tensors if fqn.startswith("model/"))
    refuse_unmapped([fqn for fqn in params if hf_name(fqn.removeprefix("model/")) is None], tensors, expected)
    return {fqn: hf_name(fqn.removeprefix("model/")) or "" for fqn in params}


def refuse_unmapped(unmapped: list[str], tensors: Mapping[str, Any], expected: Iterable[str]) -> None:
    """Fail, listing them, when parameters have no Hugging Face name or the `expected` ones
    (logical names, without ``model/``) are not all among `tensors`.

    Raises:
        LayoutError: either (both listed).
    """
    missing = sorted(f"model/{n}" for n in expected if f"model/{n}" not in tensors)
    problems = []
    if unmapped:
        problems.append(f"{len(unmapped)} tensor(s) with no Hugging Face name: {', '.join(unmapped[:20])}")
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


# Layouts whose tensors are already under their Hugging Face names (``model/<name>``, as the
# ``hf`` converter writes them): export renames nothing and writes back the carried config.json.
PASSTHROUGH = ("hf-llama", "gpt2")


def passthrough_map(tensors: Mapping[str, Any], expected: list[str]) -> dict[str, str]:
    """Map every parameter (``model/<name>``) of a checkpoint in a `PASSTHROUGH` layout to its
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
    if match:
        return (1, int(match.group(1)), match.group(2))
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


def llama_config(layout: Layout, where: str) -> dict[str, Any]:
    """Return the reference Llama config a Hugging Face export needs, from the checkpoint's layout.

    Raises:
        LayoutError: the layout is not the reference Llama's, or its config lacks a value.
    """
    if layout.name != "llama":
        raise LayoutError(f"{where}: the checkpoint's layout is {layout.name!r}; export --format hf maps the layout 'llama'")
    missing = [k for k in CONFIG_KEYS if k not in layout.config]
    if missing:
        raise LayoutError(f"{where}: the llama layout's config lacks {', '.join(missing)}")
    return dict(layout.config)


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
