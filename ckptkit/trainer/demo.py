"""The demo job: train the tiny reference model on 8 local ranks (TP 2 x PP 2 x DP 2, ZeRO-1),
checkpoint it through ckptkit, then list, inspect, verify, compare and reload what it made."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .. import ShardedTensor, diff, inspect, list_checkpoints, load, verify

from .train import config_from, launch, prepare

STEPS = 20
SAVE_EVERY = 10


def run(out_dir: str, echo: Callable[[str], None]) -> bool:
    """Run the demo into `out_dir` (continuing a previous demo there); return True when every check passed."""
    run_dir = os.path.join(out_dir, "run")
    start = max((e.step or 0 for e in list_checkpoints(run_dir).checkpoints), default=0) if os.path.isdir(run_dir) else 0
    cfg = config_from(tp=2, pp=2, dp=2, zero=1, steps=start + STEPS, save_every=SAVE_EVERY, out=run_dir,
                      resume="latest" if start else None, log_jsonl=os.path.join(out_dir, "train.jsonl"), echo=True)
    echo(f"$ ckptkit train --tp 2 --pp 2 --dp 2 --zero 1 --steps {cfg.steps} --save-every {SAVE_EVERY} "
         f"--out {run_dir}{' --resume latest' if start else ''}")
    launch(cfg, prepare(cfg))
    listing = list_checkpoints(run_dir)
    echo(f"\n$ ckptkit ls {run_dir}")
    for e in listing.checkpoints:
        echo(f"  {e.name}  step {e.step}{'  <- latest' if e.name == listing.latest else ''}")
    latest = os.path.join(run_dir, listing.latest or listing.checkpoints[-1].name)
    previous = os.path.join(run_dir, listing.checkpoints[-2].name) if len(listing.checkpoints) > 1 else latest
    echo(f"\n$ ckptkit inspect {latest}\n" + inspect(latest).render())
    report = verify(latest)
    echo(f"\n$ ckptkit verify {latest}\n  {'sound' if report.ok else 'PROBLEMS'}: {report.files} files, "
         f"{report.bytes_read} bytes hashed, {len(report.findings)} findings")
    changed = diff(previous, latest)
    echo(f"\n$ ckptkit diff {previous} {latest}\n  {len(changed.differences)} of {changed.tensors} "
         "tensors changed between the two steps (training moved them)")
    same = _reload_with_other_sharding(latest, echo)
    echo("\nnext: ckptkit train --tp 2 --pp 2 --dp 2 --zero 1 --resume latest --out " + run_dir + f" --steps {cfg.steps + 10}"
         "\n      ckptkit verify --json " + latest + "\n      ckptkit diff " + previous + " " + latest)
    return bool(report.ok and same)


def _reload_with_other_sharding(path: str, echo: Callable[[str], None]) -> bool:
    """Load one tensor whole and as 4 row shards (it was saved as 2 TP shards); they must agree."""
    name = "layers.1.attn.q.weight"
    whole = load(path)["model"][name]
    rows = whole.shape[0] // 4
    pieces = [ShardedTensor(torch.empty(rows, whole.shape[1]), tuple(whole.shape), (i * rows, 0)) for i in range(4)]
    load(path, {"model": {name: pieces}})
    same = all(torch.equal(p.local, whole[i * rows : (i + 1) * rows]) for i, p in enumerate(pieces))
    echo(f"\nloaded model/{name} whole and as 4 row shards (it was saved as 2 TP shards on 2 DP replicas): "
         f"{'bitwise equal' if same else 'DIFFERENT'}")
    return same
