"""The Hugging Face form of a checkpoint's model (pure): tensor runs, config files, shard plan.

Any checkpoint whose layout is a view of a canonical model (``models.model_of``: the reference
trainer's, Megatron-Core's GPT, a converted Hugging Face model's) exports through the model:
each Hugging Face tensor is runs of rows of the checkpoint's (`hf_runs`, by
``models.compose``): a rename for the reference Llama (the same half-split rotary convention, so
q and k need no permutation) and its mixture of experts (Mixtral's per-expert names on the
Hub), q, k, v and gate, up cut out of Megatron's fused tensors, and nothing at all for a
converted Hugging Face model, whose carried ``config.json`` is written back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import LayoutError, summarize
from ckptkit.layouts import Layout
from ckptkit.models.compose import Run, compose
from ckptkit.models.spec import ModelSpec
from ckptkit.models.view import View
from ckptkit_adapters.hf.view import hf_view


def hf_runs(tensors: Mapping[str, Any], spec: ModelSpec, view: View) -> dict[str, list[Run]]:
    """Where each Hugging Face tensor of a checkpoint of `spec` saved under `view` comes from
    (its model's tensors under ``model/``): runs of rows of the checkpoint's tensors.

    Raises:
        LayoutError: the checkpoint's model tensors the model has no place for, or ones it
            needs that are missing (all listed), or a view that cannot become Hugging Face's.
    """
    runs = compose(spec, view, hf_view(spec), prefix="model/")
    used = {r.fqn for rs in runs.values() for r in rs}
    model = [fqn for fqn in tensors if fqn.startswith("model/")]
    refuse_unmapped(sorted(set(model) - used), sorted(used - set(tensors)))
    return runs


def refuse_unmapped(extra: list[str], missing: list[str]) -> None:
    """Fail, listing them, when `extra` parameters have no place in the model config or the
    `missing` ones it needs are not in the checkpoint.

    Raises:
        LayoutError: any of them (all listed).
    """
    problems = []
    if extra:
        problems.append(f"{len(extra)} tensor(s) the model config has no place for (tie_embeddings, num_layers, "
                        f"num_experts): {', '.join(extra[:20])}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model config needs are missing: {', '.join(missing[:20])}")
    if problems:
        raise LayoutError("cannot export: " + summarize(problems))


def passthrough(layout: Layout) -> bool:
    """Whether the layout's tensors are already under their Hugging Face names (``model/<name>``,
    as the ``hf`` converter writes them: a Hugging Face view, ``hf-<model_type>``, or ``gpt2`` as
    checkpoints converted before the views recorded it): export renames nothing and writes back
    the carried config.json."""
    return layout.name.startswith("hf-") or layout.name == "gpt2"


def config_json(spec: ModelSpec, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of `spec`'s model (the Hugging Face config it was read from), its dtype set to `dtype`."""
    key = "dtype" if "dtype" in spec.config else "torch_dtype"
    return {**spec.config, key: dtype}


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
