"""A torchtitan job on CPU (one gloo rank, as under torchrun) for the torchtitan tests, built
from torchtitan's own classes as ``fixtures/make_torchtitan.py`` builds them:

- ``resume ROOT OUT``: the fixture's job (its Llama 3, AdamW and warmup-cosine schedule, train
  state) resumes from ``ROOT/checkpoint/step-2`` with torchtitan's ``CheckpointManager.load``,
  takes one more step (gradients from seed 2: flex attention has no backward on a CPU) and
  saves what the step gave (parameters, optimizer state, train state, schedule, learning
  rates) to ``OUT`` (``torch.save``);
- ``logits CHECKPOINT CONFIG IDS OUT``: torchtitan's Llama 3 (or Qwen3) of the Hugging Face config
  ``CONFIG`` loads the model-only save ``CHECKPOINT`` as a job starting from another's weights
  does (``initial_load_path``, ``initial_load_model_only``) and writes its forward of the ids in
  ``IDS`` (safetensors) to ``OUT``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _script():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(FIXTURES))
    import make_torchtitan

    return make_torchtitan


def resume(root: str, out: str) -> None:
    import torch

    mt = _script()
    job = mt.training()
    mt.checkpointer(Path(root), *job).load(step=2)
    mt.train_step(*job, seed=2)
    model, optimizers, schedulers, state = job
    torch.save({"model": model.state_dict(), "optimizer": optimizers.state_dict(), "train_state": state.state_dict(),
                "lr_scheduler": schedulers.state_dict(),
                "lr": [g["lr"] for o in optimizers.optimizers for g in o.param_groups]}, out)


def logits(checkpoint: str, config: str, ids: str, out: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from torchtitan.components.checkpoint import CheckpointManager

    mt = _script()
    model = mt.model_of(json.loads(Path(config).read_text()))
    with tempfile.TemporaryDirectory() as empty:  # a job's own folder, no checkpoint in it yet
        manager = CheckpointManager(CheckpointManager.Config(enable=True, folder="checkpoint", initial_load_path=checkpoint,
                                                             initial_load_model_only=True),
                                    dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None, states={},
                                    sd_adapter=None, base_folder=empty)
        assert manager.load(step=-1), "torchtitan loaded nothing"
    tokens = load_file(ids)["ids"]
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        save_file({"logits": model(tokens, positions, model.get_attention_masks(positions)).contiguous()}, out)


def main() -> None:
    import torch.distributed as dist

    with tempfile.NamedTemporaryFile() as rendezvous:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous.name}", rank=0, world_size=1)
        try:
            {"resume": resume, "logits": logits}[sys.argv[1]](*sys.argv[2:])
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
