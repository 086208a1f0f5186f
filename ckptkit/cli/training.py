"""The reference trainer's commands: train, demo."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

import ckptkit

from .base import cli


@cli.command("train")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1), help="Tensor-parallel degree.")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(1), help="Pipeline stages.")
@click.option("--dp", default=1, show_default=True, type=click.IntRange(1), help="Data-parallel degree.")
@click.option("--cp", default=1, show_default=True, type=click.IntRange(1),
              help="Context-parallel degree: each CP rank holds a slice of every sequence.")
@click.option("--ep", default=1, show_default=True, type=click.IntRange(1),
              help="Expert-parallel degree (a mixture of experts): experts split over EP ranks carved out of --dp.")
@click.option("--zero", default=0, show_default=True, type=click.IntRange(0, 3), help="ZeRO stage (0-3).")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]),
              help="Where to compute: cpu (gloo) or cuda (NCCL, one GPU per rank).")
@click.option("--precision", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16", "fp16"]),
              help="Compute dtype on fp32 master weights; fp16 with a dynamic loss scaler (checkpointed).")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(0), help="Global step to stop at.")
@click.option("--save-every", default=0, show_default=True, type=click.IntRange(0), help="Save every K steps and at the end (0: never).")
@click.option("--out", metavar="DIR", default="runs/train", show_default=True, help="Directory of the run's checkpoints.")
@click.option("--resume", metavar="PATH|latest", default=None, help="A checkpoint to resume from, or 'latest' (under --out); nothing to resume is an error.")
@click.option("--resume-if-present", is_flag=True, help="With --resume latest: start a new run (from --init-from if given) when --out holds no checkpoint yet.")
@click.option("--init-from", default=None, metavar="CKPT",
              help="Start a new run from the parameters of this checkpoint (any topology; a converted Hugging Face Llama too): "
                   "its model, a new optimizer, schedule, sampler and RNG, step 0.")
@click.option("--model", default=None, type=click.Choice(["tiny", "small", "base", "tiny-moe", "small-moe"]),
              help="Model size (default tiny; *-moe: a mixture of experts, 8 experts, top-2; with --init-from the "
                   "checkpoint's, which a given --model must match).")
@click.option("--seed", default=1234, show_default=True, type=int)
@click.option("--log-jsonl", metavar="FILE", default=None, help="Append one JSON object per step (and per save, with \"event\": \"save\") to this file.")
@click.option("--sync-save", is_flag=True, help="Save in the training loop instead of in the background (to compare stalls).")
@click.option("--incremental", is_flag=True,
              help="Write only the tensor boxes that changed since the previous save; the others are read from it "
                   "(found by their xxh3-128 digests; retention keeps what a kept checkpoint reads).")
@click.option("--memory-dir", metavar="DIR", default=None,
              help="A memory tier: snapshots in node-local shared memory under DIR (one folder per node, e.g. /dev/shm/JOB), "
                   "replicated to other nodes; --resume latest then restores the newest step from memory, a peer or --out.")
@click.option("--memory-every", default=0, show_default=True, type=click.IntRange(0), metavar="K",
              help="With --memory-dir: a memory snapshot every K steps (0: none).")
@click.option("--memory-keep", default=2, show_default=True, type=click.IntRange(1), metavar="N", help="Memory snapshots each node keeps.")
@click.option("--memory-replicas", default=1, show_default=True, type=click.IntRange(0), metavar="N",
              help="Other nodes holding a copy of each rank's memory snapshot.")
@click.option("--ranks-per-node", default=0, show_default=True, type=click.IntRange(0), metavar="N",
              help="Simulated nodes on one machine: rank r is on node r // N, each with its own folder under --memory-dir "
                   "(0: the node is $CKPTKIT_NODE, else the host name).")
@click.option("--freeze-layers", default=0, show_default=True, type=click.IntRange(0), metavar="N",
              help="Train neither the embedding nor the first N layers (a fine-tune of the top; 0: train everything).")
@click.option("--global-batch", default=8, show_default=True, type=click.IntRange(1), help="Samples per step.")
@click.option("--micro-batches", default=2, show_default=True, type=click.IntRange(1), help="Micro-batches per step and rank.")
@click.option("--seq-len", default=32, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=3e-3, show_default=True, type=float)
@click.option("--corpus", metavar="FILE", default=None, help="A text file to train on (default: the generated corpus).")
@click.option("--tie-embeddings", is_flag=True, help="Share the embedding and output head weights (pp 1 only).")
@click.option("--quiet", is_flag=True, help="Print nothing per step.")
def train_cmd(**options: Any) -> None:
    """Train the reference Llama-style model (or its mixture of experts) with TP x PP x CP x DP
    (ZeRO 0-3, EP within DP), checkpointing through ckptkit.

    A new run (no --resume) into an --out that holds checkpoints is refused before anything is
    written: continue that run with --resume latest, or choose another --out. --init-from starts
    a new run from another checkpoint's parameters alone.

    \b
    Examples:
      ckptkit train --tp 2 --pp 2 --dp 2 --zero 1 --steps 20 --save-every 10 --out run
      ckptkit train --tp 1 --pp 1 --dp 4 --zero 3 --steps 30 --save-every 10 --out run --resume latest
    """
    if not options["quiet"] and sys.stderr.isatty():  # before torch imports: a terminal never sits blank
        click.echo("ckptkit: train: starting", err=True)
    from ..trainer.train import config_from, launch, prepare

    if (options["memory_every"] or options["ranks_per_node"]) and not options["memory_dir"]:
        raise click.UsageError("--memory-every and --ranks-per-node need --memory-dir")
    if options["init_from"] and options["resume"] and not options["resume_if_present"]:
        raise click.UsageError("--init-from starts a new run and --resume continues one; give both only with "
                               "--resume-if-present (resume when --out holds a checkpoint, else start from --init-from)")
    quiet = options.pop("quiet")
    cfg = config_from(**options, echo=not quiet, phases=not quiet and sys.stderr.isatty())
    start = prepare(cfg)
    first = os.environ.get("RANK", "0") == "0"
    if cfg.memory_dir and cfg.resume == "latest":  # the ranks choose, from memory, peers and storage
        if first:
            click.echo(f"ckptkit: train: restoring the newest step of the memory tier {cfg.memory_dir} or {cfg.out}, "
                       "whichever has a good copy of it (a new run if neither has one)", err=True)
    elif (start.resume is not None or start.init_from is not None) and first:
        click.echo(f"ckptkit: train: {start.banner}", err=True)
    elif cfg.resume and first:  # --resume-if-present, and nothing there yet
        click.echo(f"ckptkit: train: nothing to resume under {cfg.out}; starting a new run (--resume-if-present)", err=True)
    if start.resume is not None and start.step >= cfg.steps:
        if first:
            click.echo(f"ckptkit: train: {start.resume} is at step {start.step}, which is --steps: nothing to train", err=True)
        return
    launch(cfg, start)


@cli.command("demo")
@click.argument("out_dir", default="demo-out", required=False)
def demo_cmd(out_dir: str) -> None:
    """Train the tiny model on 8 ranks (TP 2 x PP 2 x DP 2, ZeRO-1) into OUT_DIR, then list, inspect, verify, diff and reload what it saved.

    \b
    Examples:
      ckptkit demo
      ckptkit demo /tmp/demo
    """
    click.echo(f"ckptkit demo: training the tiny model on 8 ranks into {out_dir}, then checking what it saved")
    from ..trainer.demo import run

    ok = run(out_dir, click.echo)
    sys.exit(0 if ok else 1)
