"""A DeepSpeed job on CPU (gloo ranks, ``DS_ACCELERATOR=cpu``) that loads a checkpoint into the
DeepSpeed fixtures' model (``fixtures/make_deepspeed.py``: ``Tiny``, torch's AdamW in two groups,
WarmupLR, gradient clipping) and trains one more step, as a DeepSpeed user resumes: either a
DeepSpeed save as DeepSpeed saved it (``engine.load_checkpoint(DIR)`` at the save's own ZeRO stage
and data-parallel size), or a universal checkpoint (``"checkpoint": {"load_universal": true}``) at
another stage and size. The step's global batch is the same whatever the size (each rank its
rows of it). Rank 0 writes what the test compares: DeepSpeed's own view of every parameter right
after the load (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``, the module's
parameter), the loss of the step and the loss of the same batch after it, the counters and the
client state the load returned. Used by ``tests/test_export_deepspeed.py``.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from .fixture_scripts import fixture_script  # noqa: E402
from .ranks import run_ranks  # noqa: E402

BATCH_SEED = 97
GLOBAL_BATCH = 4


def fixture_module() -> ModuleType:
    """fixtures/make_deepspeed.py as a module (its model, groups and config)."""
    return fixture_script("make_deepspeed")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of the step: ids and targets of GLOBAL_BATCH rows."""
    gen = torch.Generator().manual_seed(BATCH_SEED)
    return torch.randint(0, 13, (GLOBAL_BATCH, 5), generator=gen), torch.randn(GLOBAL_BATCH, 5, 3, generator=gen)


def start(rank: int, world: int, port: int) -> None:
    """Join this rank to DeepSpeed's gloo process group of `world` ranks on `port`."""
    import deepspeed

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # not `import ... as`: deepspeed.comm.torch is also torch

    # On its CPU accelerator DeepSpeed JIT-builds a shared-memory all-reduce at init (g++, over a
    # minute on 2 cores, in every fresh environment); gloo's all-reduce makes the same sums, and
    # what is tested here (the checkpoint load and the step after it) does not depend on which.
    ds_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def loaded_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """DeepSpeed's own view of every parameter of `model` right after a load: the module's value,
    the fp32 master and both Adam moments, whole."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    loaded: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.numel():  # a ZeRO-3 module's own parameter is an empty placeholder outside its forward
            loaded[f"model/{name}"] = p.data.detach().clone()
        loaded[f"fp32/{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            loaded[f"{key}/{name}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    return loaded


def job(rank: int, world: int, path: str, stage: int, universal: bool, out: str, port: int) -> None:
    """Load `path` at ZeRO `stage` over `world` ranks, train one step; see the module."""
    import deepspeed
    import torch.distributed as dist
    from safetensors.torch import save_file

    start(rank, world, port)
    try:
        fx = fixture_module()
        cfg = fx.config(stage, "fp32")
        cfg["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world
        if universal:
            cfg["checkpoint"] = {"load_universal": True}
        torch.manual_seed(fx.SEED + 1)  # another init than the save's: the load must replace every value
        model = fx.Tiny()
        opt = torch.optim.AdamW(fx._groups(model), lr=0.02, betas=(0.9, 0.95))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        load_path, client = engine.load_checkpoint(path)
        assert load_path is not None, f"DeepSpeed loaded nothing from {path}"
        # Link each parameter to the optimizer's state as it now is (DeepSpeed links them at the
        # first step only; the fixtures' generator does the same): safe_get_full_optimizer_state
        # then reads what the optimizer will step from.
        if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO 1-2 (ZeRO-3 reads its partitions directly)
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        loaded = loaded_state(model)
        ids, target = batch()
        rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        ids, target = ids[rows], target[rows]
        loss = ((engine(ids) - target) ** 2).mean()
        engine.backward(loss)
        engine.step()
        with torch.no_grad():
            after = ((engine(ids) - target) ** 2).mean()
        losses = torch.stack([loss.detach(), after]).double()
        dist.all_reduce(losses)
        losses /= world  # every rank holds as many rows: the mean of the means is the batch's mean
        if rank == 0:
            save_file({k: v.contiguous() for k, v in loaded.items()}, os.path.join(out, "loaded.safetensors"))
            result = {
                "loss": losses[0].item(), "loss_after": losses[1].item(), "global_steps": engine.global_steps,
                "global_samples": engine.global_samples, "lr": [g["lr"] for g in engine.optimizer.param_groups],
                "weight_decay": [g["weight_decay"] for g in engine.optimizer.param_groups],
                "client": {k: v for k, v in (client or {}).items() if isinstance(v, (int, float, str, list, dict))},
                "loaded_from": load_path,
            }
            Path(out, "result.json").write_text(json.dumps(result, default=str) + "\n")
        dist.barrier()
        engine.destroy()
    finally:
        dist.destroy_process_group()


def run(world: int, path: str, stage: int, universal: bool, out: str, port: int) -> dict[str, Any]:
    """Spawn the job over `world` ranks and return rank 0's result (its tensors under ``loaded``)."""
    from safetensors.torch import load_file

    os.makedirs(out, exist_ok=True)
    run_ranks(job, (world, path, stage, universal, out, port), world)
    result: dict[str, Any] = json.loads(Path(out, "result.json").read_text())
    result["loaded"] = load_file(os.path.join(out, "loaded.safetensors"))
    return result
