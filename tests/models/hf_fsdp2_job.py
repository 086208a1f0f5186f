"""An FSDP2 job on CPU (gloo ranks) that loads a ``ckptkit export --format dcp --dcp-form fsdp2``
of a converted Hugging Face checkpoint as an FSDP2 user of transformers does: the model built
from the export's ``config.json`` (another initialisation, which the load must replace), each
decoder layer and then the whole wrapped with ``fully_shard``, ``get_model_state_dict`` ->
``dcp.load`` -> ``set_model_state_dict``; then every rank runs the forward on the same ids.
Rank 0 writes the full state dict it gathers and the logits, for the test to compare. Used by
``tests/models/test_targets.py``.
"""

from __future__ import annotations

import warnings

import torch


def job(rank: int, world: int, exports: list[tuple[str, str, str]]) -> None:
    """For each (export, directory of its config.json, output file): `load`."""
    for path, config_dir, out in exports:
        load(rank, world, path, config_dir, out)


def load(rank: int, world: int, path: str, config_dir: str, out: str) -> None:
    """Load the export at `path` into the model of `config_dir`'s config.json; see the module."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")  # FSDP2's and DCP's notes on CPU: not ours
    config = transformers.AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.base_model.layers if hasattr(model.base_model, "layers") else model.base_model.h:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits.float()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        tensors = {k: v.clone().contiguous() for k, v in full.items()}  # tied tensors apart
        tensors["__logits__"] = logits.contiguous()
        save_file(tensors, out)
