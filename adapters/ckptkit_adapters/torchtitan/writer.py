"""The ``torchtitan`` export: a DCP save a torchtitan job of the model loads, as its
``CheckpointManager`` writes one (``checkpoint/step-N``).

Keys are those torchtitan's flattened state dict has:

- each parameter at the top under torchtitan's saved names (``tok_embeddings.weight``,
  ``layers.<i>.attention.qkv_linear.wq.weight``, ...), from any view of the model through the
  canonical model, q and k rows in torchtitan's rotary order (a tied head, ``enable_weight_tying``,
  under its own key too, as torchtitan saves it): what a job loads with
  ``checkpoint.initial_load_path`` and ``initial_load_model_only`` (a start from another tool's weights);
- with ``--include-optimizer``, what it resumes from: ``optimizer.state.<module>.exp_avg``,
  ``.exp_avg_sq`` and ``.step`` keyed by the names the modules hold (q, k and v as one
  ``wqkv``), ``optimizer.param_groups.<module>.<option>``, ``lr_scheduler.last_epoch`` and
  ``train_state.step`` / ``.ntokens_seen``. A checkpoint converted from torchtitan gives them
  back as it saved them (its values kept); any other, from the AdamW it records (every option of
  the installed torch's AdamW, ``lr`` the next step's rate under its schedule, ``initial_lr`` the
  base), its step and the tokens it has seen.

Planned before anything is written; each tensor is read only when the DCP writer asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.boxes import Box
from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.adamw import adamw_of
from ckptkit.exports.convert import output_dtype
from ckptkit.exports.source import ExportedTensor, Source, Writer, Written
from ckptkit.layouts import layout_for
from ckptkit.models import Run, compose, model_of, placed
from ckptkit.state.torch_io import torch_dtype
from ckptkit.storage import Storage
from ckptkit_adapters.common.dcp_read import dcp_key
from ckptkit_adapters.common.dcp_write import Stacked, StackingPlanner, save_dcp
from ckptkit_adapters.torchtitan.view import PREFIX, torchtitan_modules, torchtitan_view

MOMENTS = ("exp_avg", "exp_avg_sq")
# The values a torchtitan save holds beside the model (their ckptkit names' first part), given back as saved.
SAVED_VALUES = ("optimizer", "lr_scheduler", "train_state", "dataloader")
TUPLES = ("betas",)  # options torch's optimizers keep as tuples (a JSON list once converted)


@dataclass
class TorchtitanPlan:
    """Every key of the export: tensors made of the checkpoint's rows, values, the checkpoint's
    values given back, what is left out and what is said."""

    tensors: list[Stacked] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)
    carried: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)


def _stacked(key: str, runs: list[Run], shape: tuple[int, ...], source: Source, out_dtype: str | None, problems: list[str]) -> Stacked | None:
    entries = source.manifest.tensors
    missing = [r.fqn for r in runs if r.fqn not in entries]
    if missing:
        problems += missing
        return None
    pieces = tuple((r.fqn, Box((r.src_row, *(0 for _ in shape[1:])), (r.count, *shape[1:]))) for r in runs)
    return Stacked(key, shape, output_dtype(entries[runs[0].fqn].dtype, out_dtype), 0, pieces)


def plan_torchtitan(source: Source, out_dtype: str | None, include_optimizer: bool) -> TorchtitanPlan:
    """Map the checkpoint's model (and, with `include_optimizer`, its optimizer) onto torchtitan's keys.

    Raises:
        LayoutError: a model torchtitan's view does not hold, tensors missing, or (with
            `include_optimizer`) no AdamW recorded; every problem named.
    """
    manifest, where = source.manifest, str(source.loc)
    try:
        spec, view = model_of(layout_for(manifest, where=where), manifest.info.config)
        saved, modules = torchtitan_view(spec), torchtitan_modules(spec)
    except LayoutError as e:
        raise LayoutError(f"{where}: cannot export to torchtitan: {e}") from None
    plan, problems = TorchtitanPlan(), list[str]()
    shapes = placed(spec, saved).shapes
    runs_of = compose(spec, view, saved, "model/")
    for head, shared in saved.tied.items():  # a tied job (enable_weight_tying) loads the head's key too
        runs_of[head], shapes[head] = runs_of[shared], shapes[shared]
    for name, runs in runs_of.items():
        if (t := _stacked(name, runs, shapes[name], source, out_dtype, problems)) is not None:
            plan.tensors.append(t)
    if include_optimizer:
        module_shapes = placed(spec, modules).shapes
        for moment in MOMENTS:
            for name, runs in compose(spec, view, modules, f"optimizer/{moment}/").items():
                t = _stacked(f"optimizer.state.{name}.{moment}", runs, module_shapes[name], source, out_dtype, problems)
                if t is not None:
                    plan.tensors.append(t)
        if not problems:
            _optimizer_values(source, list(module_shapes), plan)
    if problems:
        raise LayoutError(f"{where}: cannot export to torchtitan: {len(problems)} tensor(s) missing: " + summarize(sorted(problems)))
    return plan


def _optimizer_values(source: Source, modules: list[str], plan: TorchtitanPlan) -> None:
    """The optimizer's steps and parameter groups, the scheduler's and the train state's values:
    a torchtitan save's own, else what the checkpoint's AdamW, step and data progress say."""
    manifest = source.manifest
    saved = {name: value for name, value in manifest.objects.items() if name.split("/")[0] in SAVED_VALUES}
    steps = [f"optimizer/state/{name.replace('.', '/')}/step" for name in modules]
    if layout_for(manifest, where=str(source.loc)).name.startswith(PREFIX) and "lr_scheduler/last_epoch" in saved:
        for name, value in saved.items():
            plan.values[dcp_key(name)] = tuple(value) if name.rpartition("/")[2] in TUPLES and isinstance(value, list) else value
        plan.carried |= set(saved)
        if all(s in manifest.tensors for s in steps):  # the optimizer's per-parameter steps, as saved
            for name, step in zip(modules, steps):
                plan.tensors.append(Stacked(f"optimizer.state.{name}.step", (), manifest.tensors[step].dtype, 0, ((step, Box((), ())),)))
            return
        taken = manifest.info.optimizer.step if manifest.info.optimizer and manifest.info.optimizer.step is not None else manifest.step
        plan.values |= {f"optimizer.state.{name}.step": torch.tensor(float(taken)) for name in modules}
        return
    adamw = adamw_of(manifest, str(source.loc), "the torchtitan export's optimizer state (export without --include-optimizer)")
    options = adamw.torch_options() | {"lr": adamw.next_lr(), "initial_lr": adamw.lr}
    for name in modules:
        plan.values[f"optimizer.state.{name}.step"] = torch.tensor(float(adamw.step))
        plan.values |= {f"optimizer.param_groups.{name}.{option}": value for option, value in options.items()}
    progress = manifest.info.data_progress
    plan.values |= {"lr_scheduler.last_epoch": adamw.step, "train_state.step": manifest.step,
                    "train_state.ntokens_seen": progress.consumed_tokens if progress else 0}
    plan.warnings.append("torchtitan's schedule is its job's config: the export's lr_scheduler.last_epoch is the optimizer's step "
                         f"({adamw.step}) and every parameter's lr the next step's rate ({options['lr']:g}) under the checkpoint's "
                         "schedule, one AdamW for all (a job that holds a dataloader loads with checkpoint.exclude_from_loading "
                         "= [\"dataloader\"])")


def torchtitan_writer(source: Source, out_dtype: str | None, include_optimizer: bool) -> Writer:
    """Plan the torchtitan export (failing before any write) and return its writer.

    Raises:
        LayoutError: see `plan_torchtitan`.
    """
    plan = plan_torchtitan(source, out_dtype, include_optimizer)

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        report: list[ExportedTensor] = []
        state: dict[str, Any] = {t.key: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in plan.tensors}
        state.update(plan.values)
        source.expect(dict.fromkeys(name for t in plan.tensors for name, _ in t.pieces))
        return save_dcp(state, StackingPlanner(source, tuple(plan.tensors), report), report, dst, tmp)

    return Writer(sorted(set(source.manifest.tensors) - {n for t in plan.tensors for n, _ in t.pieces}), write,
                  frozenset(plan.carried), {}, tuple(plan.warnings))


__all__ = ["TorchtitanPlan", "plan_torchtitan", "torchtitan_writer"]
