"""The distributed optimizer's state of a Megatron-Core export from another tool's checkpoint
(pure): each parameter's fp32 master and Adam moments, fused as its parameter is, and the
optimizers' parameter groups.

The same runs of rows that make a Megatron tensor of the checkpoint's parameters
(``models.compose`` from the checkpoint's view to Megatron's) make its master, taken from the
parameters (which must be fp32), and its moments, from ``optimizer/exp_avg`` and
``optimizer/exp_avg_sq`` under the parameters' names (each expert's as its own).
"""

from __future__ import annotations

from typing import Any

from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.source import Source
from ckptkit.models.compose import Run, compose
from ckptkit.models.spec import ModelSpec
from ckptkit.models.view import View

STATES = (("param", "model/"), ("exp_avg", "optimizer/exp_avg/"), ("exp_avg_sq", "optimizer/exp_avg_sq/"))


def optimizer_sources(source: Source, spec: ModelSpec, view: View, target: View) -> dict[str, dict[str, list[Run]]]:
    """The distributed optimizer's state by Megatron state (``param``: the fp32 masters, the
    checkpoint's parameters; ``exp_avg``, ``exp_avg_sq``), each Megatron tensor's runs of rows.

    Raises:
        LayoutError: parameters that are not fp32, or moments missing.
    """
    tensors = source.manifest.tensors
    odd = sorted(f"{fqn} ({t.dtype})" for fqn, t in tensors.items() if fqn.startswith("model/") and t.dtype != "float32")
    if odd:
        raise LayoutError(f"{source.loc}: Megatron's fp32 masters are the checkpoint's parameters, and {len(odd)} are not "
                          "float32: " + summarize(odd))
    if not any(fqn.startswith("optimizer/exp_avg/") for fqn in tensors):
        raise LayoutError(f"{source.loc}: no optimizer/exp_avg tensors in the checkpoint, which --include-optimizer needs")
    return {state: compose(spec, view, target, prefix) for state, prefix in STATES}


def param_groups(source: Source, *, experts: bool = False) -> list[list[dict[str, Any]]]:
    """Megatron's parameter groups, one list per optimizer: the dense parameters' two (weight
    decay on, ``wd_mult`` 1, and off for norms and other 1-D parameters, ``wd_mult`` 0: AdamW as
    the reference trainer runs it decays 2-D weights only) and, with `experts`, the experts' own
    optimizer's one (``is_expert_parallel``; experts have 2-D weights only), as megatron-core's
    ``ChainedOptimizer`` keeps them; the recorded hyper-parameters and step; ``lr`` is the peak
    rate (Megatron's scheduler sets each step's).

    Raises:
        LayoutError: no AdamW hyper-parameters recorded in the checkpoint's info.
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


__all__ = ["optimizer_sources", "param_groups"]
