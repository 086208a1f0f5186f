"""An FSDP2 job on CPU (gloo ranks) that resumes from a ``ckptkit export --format dcp`` of a
reference-trainer checkpoint, as an FSDP2 user resumes: the trainer's model as one plain module
(``Stage`` at TP 1, one stage) wrapped with ``fully_shard`` (each layer, then the whole), torch's
AdamW in the trainer's two groups (2-D weights decayed, the rest not) with an LR scheduler
attached, ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``; then it trains the given
steps on the given global samples, as the trainer does (each rank its share of the batch,
gradients clipped by the global norm, the trainer's learning rate per step). Rank 0 writes what
the test compares: the DCP keys the job asked for, what it loaded, and each step's loss. Used by
``tests/test_export_fsdp2.py``.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckptkit.trainer.config import ModelConfig, TrainConfig
from ckptkit.trainer.data import Tokenizer, load_dataset
from ckptkit.trainer.engine import learning_rate
from ckptkit.trainer.model import Stage
from ckptkit.trainer.tp import TPContext


def optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """torch's AdamW with the trainer's hyper-parameters, decaying the weights of 2 or more dims only."""
    params = [p for _, p in model.named_parameters()]
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                             lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def job(rank: int, world: int, path: str, cfg: TrainConfig, model_cfg: ModelConfig, steps: list[tuple[int, list[int]]],
        out: str) -> None:
    """Resume from the export at `path` and train `steps` ((step, global sample ids) each); see the module."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")  # FSDP2's and DCP's notes on CPU and on single files: not ours
    dataset, _ = load_dataset(cfg.corpus, Tokenizer(), cfg.seq_len, seed=cfg.seed)
    model = Stage(model_cfg, TPContext(1, 0), pp_rank=0, pp=1, seed=cfg.seed + 1)  # another init: the load must replace it
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer(model, cfg)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)  # a scheduler adds initial_lr to the groups
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    asked = sorted(flatten_state_dict(state)[0])
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded: dict[str, Any] = {"lr": [g["lr"] for g in opt.param_groups], "weight_decay": [g["weight_decay"] for g in opt.param_groups],
                              "steps": sorted({float(s["step"]) for s in opt.state.values()})}
    losses = [_step(model, opt, cfg, dataset, step, ids, rank, world) for step, ids in steps]
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"asked": asked, "loaded": loaded, "losses": losses}, f)


def _step(model: Any, opt: torch.optim.Optimizer, cfg: TrainConfig, dataset: Any, step: int, ids: list[int], rank: int,
          world: int) -> float:
    """One training step on global samples `ids` (this rank takes its share); returns the global loss."""
    per = len(ids) // world
    batch = torch.stack([dataset.sample(i) for i in ids[rank * per:(rank + 1) * per]])
    logits = model(batch[:, :-1])
    local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
    (local / batch[:, 1:].numel()).backward()  # a mean over this rank's tokens: FSDP2 averages gradients over the ranks
    total = local.detach().reshape(1)
    dist.all_reduce(total)
    squares = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        squares += (p.grad.to_local().double() ** 2).sum()
    dist.all_reduce(squares)
    clip = min(1.0, cfg.grad_clip / (float(squares.sqrt().item()) + 1e-6))  # the trainer's global-norm clipping
    for p in model.parameters():
        p.grad.mul_(clip)
    for group in opt.param_groups:
        group["lr"] = learning_rate(cfg, step)
    opt.step()
    opt.zero_grad()
    return float(total.item()) / (len(ids) * cfg.seq_len)
