"""An FSDP2 job on CPU (gloo ranks) of the DCP fixtures' model (``fixtures/make_dcp.py``: ``Tiny``,
torch's AdamW) that resumes from a DCP directory as the job that saved it would: the model built
(another init) and sharded with ``fully_shard``, ``get_state_dict`` -> ``dcp.load`` ->
``set_state_dict``, then one step on seeded data. Rank 0 writes what the test compares: the
optimizer's groups after the load, the step's loss and the loss after it, and every parameter and
moment, whole, after the step. Used by ``tests/converters/test_dcp.py``.
"""

from __future__ import annotations

import json
import os
import warnings

import torch

from .fixture_scripts import fixture_script


def job(rank: int, world: int, path: str, out: str) -> None:
    """Resume from `path` and take one step; see the module."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")  # FSDP2's and DCP's notes on CPU: not ours
    fx = fixture_script("make_dcp")
    torch.manual_seed(fx.SEED + 7)  # another init than the save's: the load must replace every value
    model = fx.Tiny()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)  # the load must bring the saved groups back
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    gen = torch.Generator().manual_seed(fx.SEED + 9)
    ids, target = torch.randint(0, 11, (4, 3), generator=gen), torch.randn(4, 3, 1, generator=gen)
    loss = ((model(ids) - target) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    tensors = {f"param/{n}": p.full_tensor() for n, p in model.named_parameters()}  # sharded between steps
    for n, p in model.named_parameters():
        tensors |= {f"{k}/{n}": opt.state[p][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")}
    with torch.no_grad():
        after = ((model(ids) - target) ** 2).mean()
    if rank == 0:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, os.path.join(out, "state.safetensors"))
        with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as f:
            json.dump({"groups": groups, "loss": loss.item(), "after": after.item()}, f, default=str)
