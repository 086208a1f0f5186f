"""A small Llama-shaped state as 4 ranks (TP 2 x DP 2, ZeRO-1) hold it, for multi-process tests.

The state is deterministic, so any process can rebuild the global tensors and check bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptkit.manifest import CheckpointInfo, DataProgress, ModelInfo, OptimizerInfo, ParamGroup, Topology
from ckptkit.ops.provenance import code_version
from ckptkit.state.sharded import ShardedTensor

CONFIG = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}
TP, DP = 2, 2
# Columns of the ZeRO-1 partition: rank d of DP owns this fraction of each TP-local flat buffer.
_ZERO_CUT = 0.45


def param_shapes(config: dict[str, int] = CONFIG) -> dict[str, tuple[tuple[int, ...], str]]:
    """Return name -> (global shape, TP split: 'col' (dim 0), 'row' (dim 1) or 'rep')."""
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = h * config["num_kv_heads"] // config["num_heads"]
    shapes: dict[str, tuple[tuple[int, ...], str]] = {"embed.weight": ((v, h), "col")}
    for i in range(config["num_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "attn_norm.weight": ((h,), "rep"),
            p + "attn.q.weight": ((h, h), "col"),
            p + "attn.k.weight": ((kv, h), "col"),
            p + "attn.v.weight": ((kv, h), "col"),
            p + "attn.o.weight": ((h, h), "row"),
            p + "mlp_norm.weight": ((h,), "rep"),
            p + "mlp.gate.weight": ((f, h), "col"),
            p + "mlp.up.weight": ((f, h), "col"),
            p + "mlp.down.weight": ((h, f), "row"),
        }
    shapes |= {"norm.weight": ((h,), "rep"), "lm_head.weight": ((v, h), "col")}
    return shapes


def global_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Return the deterministic global value of a demo tensor."""
    gen = torch.Generator().manual_seed(sum(name.encode()) * 7919 + len(name))
    return torch.randn(shape, generator=gen, dtype=torch.float32)


def global_state() -> dict[str, torch.Tensor]:
    """Return every demo tensor, whole, by fqn."""
    out = {}
    for name, (shape, _) in param_shapes().items():
        out[f"model/{name}"] = global_tensor(name, shape)
        out[f"optimizer/exp_avg/{name}"] = global_tensor("m." + name, shape)
        out[f"optimizer/exp_avg_sq/{name}"] = global_tensor("v." + name, shape).abs()
    return out


def tp_box(shape: tuple[int, ...], split: str, tp_rank: int, tp: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (offsets, lengths) of a TP rank's shard of a tensor."""
    if split == "rep":
        return (0,) * len(shape), shape
    dim = 0 if split == "col" else 1
    step = shape[dim] // tp
    offsets = [0] * len(shape)
    lengths = list(shape)
    offsets[dim], lengths[dim] = tp_rank * step, step
    return tuple(offsets), tuple(lengths)


def rank_state(rank: int, tp: int = TP, dp: int = DP) -> dict[str, Any]:
    """Return what rank `rank` (tp fastest, then dp) holds: TP shards of params, ZeRO-1 slices of moments."""
    tp_rank, dp_rank = rank % tp, rank // tp
    model: dict[str, Any] = {}
    optim: dict[str, dict[str, Any]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, (shape, split) in param_shapes().items():
        offsets, lengths = tp_box(shape, split, tp_rank, tp)
        full = global_tensor(name, shape)
        local = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].clone()
        model[name] = local if split == "rep" else ShardedTensor(local, shape, offsets)
        for moment, tag in (("exp_avg", "m."), ("exp_avg_sq", "v.")):
            g = global_tensor(tag + name, shape)
            g = g.abs() if moment == "exp_avg_sq" else g
            flat = g[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].reshape(-1)
            start, stop = _zero_range(flat.numel(), dp_rank, dp)
            optim[moment][name] = ShardedTensor.from_flat(
                flat[start:stop].clone(), shape, start, origin=offsets, extent=lengths
            )
    rng = torch.Generator().manual_seed(1000 + rank).get_state()
    return {
        "model": model,
        "optimizer": optim,
        "rng": {"torch_cpu": ShardedTensor(rng.unsqueeze(0), (tp * dp, rng.numel()), (rank, 0))},
        "scheduler": {"last_lr": 3e-4, "warmup_steps": 10},
    }


def _zero_range(n: int, dp_rank: int, dp: int) -> tuple[int, int]:
    cuts = [0] + [int(n * (_ZERO_CUT + (1 - _ZERO_CUT) * (i - 1) / max(dp - 1, 1))) for i in range(1, dp)] + [n]
    return cuts[dp_rank], cuts[dp_rank + 1]


def save_rank(rank: int, world_size: int, path: str, step: int, tokenizer: str) -> None:
    """Body of one demo rank: build its state and save collectively."""
    from ckptkit.ops.save import save

    params = sorted(f"model/{n}" for n in param_shapes())
    info = CheckpointInfo(
        optimizer=OptimizerInfo(
            type="adamw",
            hyperparameters={"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
            param_groups=(ParamGroup(params=tuple(params)),),
            step=step,
        ),
        data_progress=DataProgress(seed=1234, epoch=0, consumed_samples=step * 8, consumed_tokens=step * 8 * 128),
        model=ModelInfo(family="llama", config=dict(CONFIG)),
        code=code_version(),
    )
    save(
        rank_state(rank),
        path,
        step=step,
        topology=Topology(world_size=world_size, tp=TP, dp=DP, zero_stage=1),
        info=info,
        tokenizer=tokenizer,
    )
