"""A megatron-core job on CPU (gloo ranks) that resumes training from ``torch_dist`` checkpoints
as Megatron-LM does: the GPTModel and its distributed optimizer (torch's Adam, fp32 masters)
built afresh at TP `tp` in the checkpoint's dtype, their sharded state dicts loaded in one ``dist_checkpointing.load``,
then ``load_state_dict`` on each, then one training step on fixed tokens. Rank 0 writes, for each
checkpoint, the loss of that step, the loss on the same tokens after it, and the optimizer's
step and learning rates (``resumed.json``). Used by ``tests/test_export_megatron.py``; needs
megatron-core, and the fixtures' stand-in ``make_megatron.torch_adam_resume_patches`` on a machine without TE or Apex."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .megatron_job import gpt_model
from .megatron_session import megatron_ranks

SEED = 7


def _resume(path: str, tp: int, config: dict[str, int], dtype: torch.dtype, sharding: str, bucket: int | None) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch.manual_seed(SEED)  # fresh weights, all overwritten by the load
    gpt = gpt_model(tp, dtype, config)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=bucket is not None, bucket_size=bucket)
    model = DistributedDataParallel(config=gpt.config, ddp_config=ddp, module=gpt)
    bf16 = dtype == torch.bfloat16
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1.0, use_distributed_optimizer=True, bf16=bf16, params_dtype=dtype),
                                 [model])
    tokens = torch.randint(0, config["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(SEED))
    positions = torch.arange(7).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(1, 1, 7, 7, dtype=torch.bool), diagonal=1)
    fresh = _eval_loss(gpt, model, tokens, positions, mask)  # before the load: what nothing loaded would give
    model_sd = gpt.sharded_state_dict()
    optim_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata={"distrib_optim_sharding_type": sharding})
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, path)
    gpt.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    resumed = _eval_loss(gpt, model, tokens, positions, mask)
    gpt.train()
    torch.manual_seed(SEED)  # the same dropout masks for every checkpoint
    loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    model.finish_grad_sync()
    opt.step()
    inners = getattr(opt, "chained_optimizers", [opt])
    return {"fresh_eval_loss": fresh, "loaded_eval_loss": resumed, "loss": loss.item(),
            "loss_after": _eval_loss(gpt, model, tokens, positions, mask),
            "steps": sorted({float(s["step"]) for o in inners for s in o.optimizer.state.values()}),
            "lrs": [g["lr"] for o in inners for g in o.optimizer.param_groups]}


def _eval_loss(gpt: Any, model: Any, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> float:
    gpt.eval()
    with torch.no_grad():
        return float(model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean())


def job(rank: int, tp: int, runs: list[tuple[str, str, int | None]], out: str, port: int, config: dict[str, int],
        dtype_name: str) -> None:
    """Resume from each of `runs` in turn: (path, the distributed optimizer's sharding type as
    saved, the DDP bucket size it was saved with: None for one bucket a buffer), this process
    being rank `rank` of `tp`; see the module."""
    with megatron_ranks(rank, tp, port, tp=tp):
        import make_megatron  # (on the path in megatron_ranks)

        make_megatron.torch_adam_resume_patches()
        results = {path: _resume(path, tp, config, getattr(torch, dtype_name), sharding, bucket) for path, sharding, bucket in runs}
        if rank == 0:
            with open(os.path.join(out, "resumed.json"), "w") as f:
                json.dump(results, f)
