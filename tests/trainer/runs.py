"""Run the reference trainer from tests: one run, its JSONL log read back."""

from __future__ import annotations

import json
from pathlib import Path

from ckptkit.trainer.train import config_from, launch, prepare


def train(out: Path, combo: tuple[int, int, int, int], steps: int, resume: str | None = None) -> list[dict]:
    """Train at (tp, pp, dp, zero) up to `steps`, saving every 4 steps and at the end; return the log."""
    tp, pp, dp, zero = combo
    log = out.with_suffix(".jsonl")
    cfg = config_from(tp=tp, pp=pp, dp=dp, zero=zero, steps=steps, save_every=4, out=str(out),
                      log_jsonl=str(log), resume=resume)
    prepare(cfg)
    launch(cfg)
    return [json.loads(line) for line in log.read_text().splitlines()]
