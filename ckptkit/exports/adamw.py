"""A checkpoint's AdamW as the exports that resume training write it (pure but `torch_options`):
its recorded step and hyper-parameters, the learning rate of the next step under the reference
trainer's schedule, and the trainer's two parameter groups (weights of two or more dims decayed,
the rest not). The DCP fsdp2 form and the DeepSpeed universal checkpoint of a model that is not
DeepSpeed's both write their optimizer's groups from it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import LayoutError
from ..manifest import Manifest

NEEDED = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class AdamW:
    """A checkpoint's AdamW: the last step taken and its hyper-parameters (``lr`` the base rate)."""

    step: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    scheduler: dict[str, Any] | None  # the checkpoint's schedule record (info.scheduler)

    def next_lr(self) -> float:
        """The learning rate of the next step (`step` + 1) under the checkpoint's schedule."""
        return next_lr(self.scheduler, self.step + 1, self.lr)

    def torch_options(self) -> dict[str, Any]:
        """Every option of the installed torch's AdamW for these hyper-parameters (no ``params``)."""
        import torch

        dummy = torch.nn.Parameter(torch.zeros(1))
        options = dict(torch.optim.AdamW([dummy], lr=self.lr, betas=self.betas, eps=self.eps,
                                         weight_decay=self.weight_decay).param_groups[0])
        del options["params"]
        return options


def adamw_of(manifest: Manifest, where: str, needed_by: str) -> AdamW:
    """The AdamW the checkpoint records (``info.optimizer``).

    Raises:
        LayoutError: no AdamW with its step and lr, betas, eps, weight_decay recorded; the
            message says what needs it (`needed_by`).
    """
    info = manifest.info.optimizer
    hyper: dict[str, Any] = dict(info.hyperparameters) if info is not None else {}
    if info is None or info.type != "adamw" or info.step is None or any(k not in hyper for k in NEEDED):
        raise LayoutError(f"{where}: {needed_by} needs an AdamW with its step and {', '.join(NEEDED)} recorded in "
                          "info.optimizer, and the checkpoint records none")
    betas = hyper["betas"]
    return AdamW(step=int(info.step), lr=float(hyper["lr"]), betas=(float(betas[0]), float(betas[1])), eps=float(hyper["eps"]),
                 weight_decay=float(hyper["weight_decay"]), scheduler=manifest.info.scheduler)


def next_lr(scheduler: dict[str, Any] | None, step: int, base: float) -> float:
    """The learning rate of optimizer step `step` under the checkpoint's schedule: the reference
    trainer's ``warmup-cosine`` (linear warmup to ``lr``, cosine decay to ``min_lr`` at
    ``total_steps``), else `base`."""
    if not scheduler or scheduler.get("type") != "warmup-cosine":
        return base
    lr, low = float(scheduler["lr"]), float(scheduler["min_lr"])
    warmup, total = int(scheduler["warmup_steps"]), int(scheduler["total_steps"])
    if step <= warmup:
        return lr * step / max(warmup, 1)
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return low + 0.5 * (lr - low) * (1 + math.cos(math.pi * progress))


def decay_groups(params: Iterable[tuple[str, tuple[int, ...]]], weight_decay: float) -> list[tuple[list[str], float]]:
    """The trainer's parameter groups of `params` (name, shape), each with its weight decay: the
    parameters of two or more dims decayed, the rest not; an empty group left out."""
    listed = list(params)
    decayed = [name for name, shape in listed if len(shape) >= 2]
    rest = [name for name, shape in listed if len(shape) < 2]
    return [(names, decay) for names, decay in ((decayed, weight_decay), (rest, 0.0)) if names]


__all__ = ["AdamW", "adamw_of", "decay_groups", "next_lr"]
