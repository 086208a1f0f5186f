"""Run the reference trainer from tests: one run, its JSONL log read back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckptkit.trainer.train import config_from, launch, prepare


def train(out: Path, combo: tuple[int, int, int, int], steps: int, resume: str | None = None, **options: object) -> list[dict]:
    """Train at (tp, pp, dp, zero) up to `steps`, saving every 4 steps and at the end; return the
    log's step records (`save_events` gives its save records)."""
    tp, pp, dp, zero = combo
    log = out.with_suffix(".jsonl")
    cfg = config_from(tp=tp, pp=pp, dp=dp, zero=zero, steps=steps, save_every=4, out=str(out),
                      log_jsonl=str(log), resume=resume, **options)
    launch(cfg, prepare(cfg))
    return [r for r in _records(log) if "event" not in r]


def save_events(out: Path) -> list[dict]:
    """The save records of the run's log: step, stall_s, background_s, sync."""
    return [r for r in _records(out.with_suffix(".jsonl")) if r.get("event") == "save"]


def _records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def trainer_logits(checkpoint: Path, ids: Any) -> Any:
    """The reference trainer's own forward (one process) with the checkpoint's parameters, every
    one of which must be a parameter of the trainer's model (dense or mixture of experts)."""
    import torch

    import ckptkit
    from ckptkit.trainer.config import ModelConfig
    from ckptkit.trainer.engine import module_params
    from ckptkit.trainer.model import Stage
    from ckptkit.trainer.tp import TPContext

    cfg = ModelConfig(**ckptkit.read_manifest(str(checkpoint)).info.model.config)  # type: ignore[union-attr]
    whole = ckptkit.load(str(checkpoint))["model"]
    stage = Stage(cfg, TPContext(1, 0), pp_rank=0, pp=1, seed=0)
    filled = set()
    with torch.no_grad():
        for module in stage.param_units():
            for _, param, parts in module_params(module):
                for part in parts:
                    param.data[part.row0 : part.row1] = whole[part.name].reshape(part.row1 - part.row0, *param.shape[1:])
                    filled.add(part.name)
        assert filled == set(whole)
        return stage(ids)
