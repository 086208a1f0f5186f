"""The state of Megatron's ``OptimizerParamScheduler`` for a checkpoint no Megatron job saved (pure).

Megatron-LM loads ``opt_param_scheduler`` from ``common.pt`` with the optimizer (and stops
without it). Its scheduler counts samples, not steps (``num_steps`` grows by the global batch
each iteration), and an iteration takes the rate of the count before it: its first step the
rate of count 0. So a checkpoint after step `s` of a run taking `G` samples a step resumes at
count ``(s + 1) * G``, where Megatron's next iteration takes the rate the checkpoint's schedule
gives its step ``s + 1``. The reference trainer's ``warmup-cosine`` (linear warmup from 0 to
``lr``, cosine decay to ``min_lr`` at ``total_steps``) is Megatron's ``cosine`` style exactly,
its steps times `G`; any other schedule is written as a constant rate, the next step's, and
said in a warning.
"""

from __future__ import annotations

from typing import Any

from ckptkit.exports.adamw import adamw_of
from ckptkit.manifest import Manifest


def opt_param_scheduler(manifest: Manifest, where: str) -> tuple[dict[str, Any], list[str]]:
    """The scheduler state Megatron-LM resumes the checkpoint's AdamW with, and warnings (what
    could only be approximated).

    Raises:
        LayoutError: no AdamW recorded (as `ckptkit.exports.adamw.adamw_of`).
    """
    adamw = adamw_of(manifest, where, "the megatron export's optimizer scheduler")
    warnings: list[str] = []
    samples = samples_per_step(manifest)
    schedule = adamw.scheduler or {}
    now = (adamw.step + 1) * (samples or 1)
    decay = {"start_wd": adamw.weight_decay, "end_wd": adamw.weight_decay, "wd_incr_style": "constant", "wd_incr_steps": now}
    if schedule.get("type") == "warmup-cosine":
        if samples is None:
            warnings.append(f"{where}: no samples per step recorded (data progress); Megatron's scheduler counts samples, "
                            "so its steps are written as steps of one sample (resume with --global-batch-size 1 or "
                            "--override-opt_param-scheduler)")
        g = samples or 1
        return {"max_lr": float(schedule["lr"]), "min_lr": float(schedule["min_lr"]),
                "lr_warmup_steps": int(schedule["warmup_steps"]) * g, "lr_decay_steps": int(schedule["total_steps"]) * g,
                "lr_decay_style": "cosine", "num_steps": now, **decay}, warnings
    lr = _next_rate(schedule, adamw.next_lr())
    kind = schedule.get("type") or ("a scheduler's state" if schedule else "none recorded")
    warnings.append(f"{where}: the learning-rate schedule ({kind}) is not one Megatron's scheduler holds; written as a "
                    f"constant rate {lr:g}, the next step's (Megatron-LM's --override-opt_param-scheduler sets another)")
    return {"max_lr": lr, "min_lr": lr, "lr_warmup_steps": 0, "lr_decay_steps": now, "lr_decay_style": "constant",
            "num_steps": now, **decay}, warnings


def samples_per_step(manifest: Manifest) -> int | None:
    """The samples each step of the run took (its data progress over its steps), or None when not recorded."""
    progress = manifest.info.data_progress
    consumed = progress.consumed_samples if progress is not None else None
    if not consumed or manifest.step <= 0 or consumed % manifest.step:
        return None
    return consumed // manifest.step


def _next_rate(schedule: dict[str, Any], fallback: float) -> float:
    """The next step's rate: a torch scheduler's ``_last_lr`` (what it set for the next step, a
    ``Trainer``'s ``scheduler.pt``), else `fallback`."""
    last = schedule.get("_last_lr")
    if isinstance(last, list) and last and isinstance(last[0], (int, float)) and not isinstance(last[0], bool):
        return float(last[0])
    return fallback


__all__ = ["opt_param_scheduler", "samples_per_step"]
