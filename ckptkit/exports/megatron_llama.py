"""The reference trainer's Llama (layout ``llama``) and mixture of experts (``llama-moe``) as
Megatron-Core's GPT (pure): where each Megatron tensor's rows come from, the Megatron layout
the export is cut by, and the distributed optimizer's parameter groups.

Megatron fuses what the trainer keeps apart: q, k and v interleaved per query group into
``linear_qkv`` (each group: its heads' q rows, then its k rows, then v's), gate and up stacked
into ``linear_fc1`` (of the dense MLP, or of each expert). The same runs of rows serve the
parameters, their fp32 masters and their Adam moments (`fused_llama` with the state's prefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError, summarize
from ..layouts import Layout, builtin
from ..layouts.names import (
    LLAMA_MOE_TO_MEGATRON_EXPERT,
    LLAMA_MOE_TO_MEGATRON_LAYER,
    LLAMA_TO_MEGATRON_LAYER,
    LLAMA_TO_MEGATRON_TOP,
    MEGATRON_LOCAL_EXPERTS,
)
from .source import Source

@dataclass(frozen=True, slots=True)
class Run:
    """Rows [row, row + count) of a Megatron tensor are rows [src_row, src_row + count) of `fqn`."""

    row: int
    count: int
    fqn: str
    src_row: int


def megatron_gpt_of_llama(layout: Layout) -> Layout:
    """The ``megatron-gpt`` layout of the reference trainer's Llama, or of its mixture of experts
    (``num_moe_experts``: the MLP's linears replaced by the router and an expert unit of
    ``SequentialMLP`` experts), same sizes and options."""
    c = layout.config
    config: dict[str, Any] = {
        "num_layers": c["num_layers"], "hidden_size": c["hidden_size"], "num_attention_heads": c["num_heads"],
        "num_query_groups": c["num_kv_heads"], "ffn_hidden_size": c["intermediate_size"], "vocab_size": c["vocab_size"],
        "kv_channels": int(c["hidden_size"]) // int(c["num_heads"]),  # type: ignore[arg-type]
        "share_embeddings_and_output_weights": bool(c.get("tie_embeddings")),
        "max_sequence_length": c.get("max_seq_len"), "layernorm_epsilon": c.get("norm_eps"), "rotary_base": c.get("rope_theta"),
    }
    if layout.name == "llama-moe":
        config |= {"num_moe_experts": c["num_experts"], "moe_ffn_hidden_size": c["intermediate_size"], "moe_router_topk": c.get("top_k", 2)}
    return builtin("megatron-gpt", config)


def fused_llama(tensors: Any, layout: Layout, prefix: str = "model") -> dict[str, list[Run]]:
    """The reference trainer's Llama (or mixture of experts) tensors of state `prefix` (``model``,
    ``optimizer/exp_avg``, ...) as Megatron's: renamed, q, k and v interleaved per query group
    into ``linear_qkv``, gate and up stacked into ``linear_fc1`` (each expert's, in a mixture).

    Raises:
        LayoutError: a tensor missing.
    """
    c = layout.config
    heads, groups, h, f = (int(c[k]) for k in ("num_heads", "num_kv_heads", "hidden_size", "intermediate_size"))  # type: ignore[arg-type]
    hd, per = h // heads, heads // groups
    experts = int(c["num_experts"]) if layout.name == "llama-moe" else 0  # type: ignore[arg-type]
    out: dict[str, list[Run]] = {}
    for name, mine in LLAMA_TO_MEGATRON_TOP.items():
        out[mine] = [Run(0, int(c["vocab_size"]) if name != "norm.weight" else h, f"{prefix}/{name}", 0)]  # type: ignore[arg-type]
    if c.get("tie_embeddings"):
        del out["output_layer.weight"]
    for i in range(layout.num_layers):
        p, m = f"{prefix}/layers.{i}.", f"decoder.layers.{i}."
        for name, mine in (LLAMA_MOE_TO_MEGATRON_LAYER if experts else LLAMA_TO_MEGATRON_LAYER).items():
            out[m + mine] = [Run(0, experts if name == "mlp.router.weight" else h, p + name, 0)]
        out[m + "self_attention.linear_qkv.weight"] = [
            run for g in range(groups) for run in (Run(g * (per + 2) * hd, per * hd, p + "attn.q.weight", g * per * hd),
                                                     Run(g * (per + 2) * hd + per * hd, hd, p + "attn.k.weight", g * hd),
                                                     Run(g * (per + 2) * hd + (per + 1) * hd, hd, p + "attn.v.weight", g * hd))]
        mlps = [(f"{p}mlp.experts.{x}.", f"{m}{MEGATRON_LOCAL_EXPERTS}.{x}.") for x in range(experts)] if experts else [(p + "mlp.", m + "mlp.")]
        for src, dst in mlps:
            out[dst + "linear_fc1.weight"] = [Run(0, f, src + "gate.weight", 0), Run(f, f, src + "up.weight", 0)]
            for name, mine in (LLAMA_MOE_TO_MEGATRON_EXPERT if experts else {"down.weight": "linear_fc2.weight"}).items():
                out[dst + mine] = [Run(0, h, src + name, 0)]
    missing = sorted({r.fqn for runs in out.values() for r in runs} - set(tensors))
    if missing:
        raise LayoutError(f"cannot export to Megatron: {len(missing)} tensor(s) missing: " + summarize(missing))
    return out


def llama_optimizer(source: Source, layout: Layout) -> dict[str, dict[str, list[Run]]]:
    """The distributed optimizer's state of the reference Llama (or mixture of experts), by
    Megatron state: each parameter's fp32 master (``param``: the trainer's parameters, which are
    fp32) and its Adam moments, fused as the parameters are (each expert's as its own).

    Raises:
        LayoutError: parameters that are not fp32, or moments missing.
    """
    tensors = source.manifest.tensors
    odd = sorted(f"{fqn} ({t.dtype})" for fqn, t in tensors.items() if fqn.startswith("model/") and t.dtype != "float32")
    if odd:
        raise LayoutError(f"{source.loc}: Megatron's fp32 masters are the trainer's parameters, and {len(odd)} are not "
                          "float32: " + summarize(odd))
    if not any(fqn.startswith("optimizer/exp_avg/") for fqn in tensors):
        raise LayoutError(f"{source.loc}: no optimizer/exp_avg tensors in the checkpoint, which --include-optimizer needs")
    return {state: fused_llama(tensors, layout, prefix) for state, prefix in
            (("param", "model"), ("exp_avg", "optimizer/exp_avg"), ("exp_avg_sq", "optimizer/exp_avg_sq"))}


def llama_param_groups(source: Source, *, experts: bool = False) -> list[list[dict[str, Any]]]:
    """Megatron's parameter groups, one list per optimizer: the dense parameters' two (weight
    decay on, ``wd_mult`` 1, and off for norms and other 1-D parameters, ``wd_mult`` 0: the
    reference trainer's AdamW decays 2-D weights only) and, with `experts`, the experts' own
    optimizer's one (``is_expert_parallel``; experts have 2-D weights only), as megatron-core's
    ``ChainedOptimizer`` keeps them; the trainer's hyper-parameters and step; ``lr`` is the
    peak rate (Megatron's scheduler sets each step's).

    Raises:
        LayoutError: no optimizer recorded in the checkpoint's info.
    """
    info = source.manifest.info.optimizer
    hp = info.hyperparameters if info is not None else {}
    if info is None or not all(k in hp for k in ("lr", "betas", "eps", "weight_decay")):
        raise LayoutError(f"{source.loc}: no AdamW hyper-parameters (lr, betas, eps, weight_decay) recorded, which "
                          "Megatron's optimizer state needs")
    min_lr = (source.manifest.info.scheduler or {}).get("min_lr")
    betas = hp["betas"]
    base = {"is_expert_parallel": False, "default_config": True, "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False,
            "max_lr": hp["lr"], "min_lr": min_lr, "lr": hp["lr"], "betas": tuple(betas) if isinstance(betas, list) else betas,
            "eps": hp["eps"], "weight_decay": hp["weight_decay"], "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
            "step": float(info.step or 0)}
    dense = [base, {**base, "wd_mult": 0.0}]
    return [dense, [{**base, "is_expert_parallel": True}]] if experts else [dense]


__all__ = ["Run", "fused_llama", "llama_optimizer", "llama_param_groups", "megatron_gpt_of_llama"]
