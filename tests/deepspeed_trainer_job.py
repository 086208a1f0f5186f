"""A DeepSpeed job on CPU (gloo ranks) that resumes the reference trainer's model from a ``ckptkit
export --format deepspeed`` of one of its checkpoints, as a DeepSpeed user of that model resumes:
the trainer's model as one plain module (``Stage`` at TP 1, one stage), torch's AdamW in the
trainer's two groups, wrapped by ``deepspeed.initialize`` at ZeRO `stage` over the ranks (each rank
its flat partition), ``"checkpoint": {"load_universal": true}``; then it trains the given steps on
the given global samples as the trainer does (each rank its share of the batch, DeepSpeed's
gradient clipping at the trainer's norm, the trainer's learning rate per step). Rank 0 writes what
the test compares: DeepSpeed's view of every parameter after the load, the learning rates and
weight decays of its groups, the counters, each step's loss. Used by ``tests/test_export_deepspeed.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from ckptkit.trainer.config import ModelConfig, TrainConfig  # noqa: E402

from .deepspeed_job import loaded_state, start  # noqa: E402


def job(rank: int, world: int, path: str, stage: int, cfg: TrainConfig, model_cfg: ModelConfig,
        steps: list[tuple[int, list[int]]], out: str, port: int) -> None:
    """Resume from the export at `path` at ZeRO `stage` and train `steps` ((step, global sample ids) each); see the module."""
    import deepspeed
    import torch.distributed as dist
    import torch.nn.functional as F
    from safetensors.torch import save_file

    from ckptkit.trainer.data import Tokenizer, load_dataset
    from ckptkit.trainer.engine import learning_rate
    from ckptkit.trainer.model import Stage
    from ckptkit.trainer.tp import TPContext

    from .fsdp2_job import optimizer

    start(rank, world, port)
    try:
        dataset, _ = load_dataset(cfg.corpus, Tokenizer(), cfg.seq_len, seed=cfg.seed)
        model = Stage(model_cfg, TPContext(1, 0), pp_rank=0, pp=1, seed=cfg.seed + 1)  # another init: the load must replace it
        per = len(steps[0][1]) // world
        config = {"train_micro_batch_size_per_gpu": per, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": stage}, "gradient_clipping": cfg.grad_clip,
                  "checkpoint": {"load_universal": True}}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer(model, cfg), config=config)
        load_path, _ = engine.load_checkpoint(path)
        assert load_path is not None, f"DeepSpeed loaded nothing from {path}"
        engine.optimizer._hp_optimizer_states_linked = False  # link each parameter to the loaded state (see deepspeed_job)
        engine.optimizer._lazy_init_hp_params_optimizer_state()
        loaded = loaded_state(model)
        groups = {"lr": [g["lr"] for g in engine.optimizer.param_groups],
                  "weight_decay": [g["weight_decay"] for g in engine.optimizer.param_groups]}
        counters = {"global_steps": engine.global_steps, "global_samples": engine.global_samples}
        losses = []
        for step, ids in steps:
            batch = torch.stack([dataset.sample(i) for i in ids[rank * per:(rank + 1) * per]])
            logits = engine(batch[:, :-1])
            local = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            engine.backward(local / batch[:, 1:].numel())  # a mean over this rank's tokens: DeepSpeed averages over the ranks
            for group in engine.optimizer.param_groups:
                group["lr"] = learning_rate(cfg, step)
            engine.step()
            total = local.detach().reshape(1)
            dist.all_reduce(total)
            losses.append(float(total.item()) / (len(ids) * cfg.seq_len))
        if rank == 0:
            save_file({k: v.contiguous() for k, v in loaded.items()}, os.path.join(out, "loaded.safetensors"))
            with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as f:
                json.dump({"groups": groups, "counters": counters, "losses": losses, "loaded_from": load_path}, f)
        dist.barrier()
        engine.destroy()
    finally:
        dist.destroy_process_group()


def run(world: int, path: str, stage: int, cfg: TrainConfig, model_cfg: ModelConfig, steps: list[tuple[int, list[int]]],
        out: str, port: int) -> dict[str, Any]:
    """Spawn the job over `world` ranks and return rank 0's result (its tensors under ``loaded``)."""
    from safetensors.torch import load_file

    from .ranks import run_ranks

    os.makedirs(out, exist_ok=True)
    run_ranks(job, (world, path, stage, cfg, model_cfg, steps, out, port), world)
    with open(os.path.join(out, "result.json"), encoding="utf-8") as f:
        result: dict[str, Any] = json.load(f)
    result["loaded"] = load_file(os.path.join(out, "loaded.safetensors"))
    return result
