"""The FSDP2 form of the DCP export: the state dict an FSDP2 job resumes from.

An FSDP2 job builds the reference trainer's model as one plain module (``ckptkit.trainer.model.Stage``
at TP 1 and one stage), or the transformers model of a converted Hugging Face checkpoint (its
layout a Hugging Face view: each key is the module's own name, fused tensors such as Phi-3's
``qkv_proj`` whole, a mixture of experts' experts stacked as transformers keeps them in memory),
wraps it with ``fully_shard`` at any world size, and loads the export with

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=DST)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

Keys are those DCP gives that state (checked against torch's own ``get_state_dict``):

- ``model.<fqn>``: each parameter under its module fqn: q, k and v stacked into
  ``layers.<i>.attn.qkv.weight``, gate and up into ``layers.<i>.mlp.gate_up.weight``,
  ``lm_head.weight`` as ``head.weight``, the rest as the checkpoint names them (the model has no
  persistent buffers: its rotary tables are computed);
- ``optim.state.<fqn>.exp_avg`` and ``.exp_avg_sq`` (stacked as the parameter) and ``.step`` (a
  float32 scalar, as torch's AdamW keeps it);
- ``optim.param_groups.<i>.<option>`` for every option of the installed torch's AdamW, and
  ``.params`` listing the fqns: group 0 the parameters of two or more dims (decayed), group 1 the
  rest (weight decay 0), as the trainer decays; ``lr`` is the learning rate of the next step under
  the checkpoint's schedule, ``initial_lr`` its base (what an LR scheduler adds).

Planned before anything is written; each tensor is read (its parts, one after the other) only
when the DCP writer asks for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ckptkit.boxes import Box
from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.adamw import adamw_of, decay_groups
from ckptkit.exports.convert import output_dtype
from ckptkit.exports.source import OPTIMIZER_PARTS, ExportedTensor, Source, Writer, Written
from ckptkit.layouts import Layout
from ckptkit.models import ModelSpec, View, compose, modules_of, placed
from ckptkit.state.torch_io import torch_dtype
from ckptkit.storage import Storage
from ckptkit_adapters.common.dcp_write import Stacked, StackingPlanner, save_dcp

MODEL = "model"
OPTIM = "optim"
MOMENTS = {"exp_avg": "optimizer/exp_avg", "exp_avg_sq": "optimizer/exp_avg_sq"}  # torch's name -> the checkpoint's prefix


@dataclass(frozen=True)
class Fsdp2Plan:
    """Every key of the export: the stacked tensors, and the values (steps, parameter groups)."""

    tensors: tuple[Stacked, ...]
    values: dict[str, Any]
    skipped: list[str]


def module_model(layout: Layout) -> tuple[ModelSpec, View, View]:
    """The canonical model of the layout's checkpoint, the view it is saved in, and the view of
    the modules an FSDP2 job builds (``models.modules_of``: the reference trainer's Llama, or
    transformers' model of a converted Hugging Face checkpoint).

    Raises:
        LayoutError: a layout whose modules no one declares.
    """
    found = modules_of(layout)
    if found is None:
        raise LayoutError(f"the fsdp2 form names parameters as the reference trainer's model (layout llama) or a "
                          f"Hugging Face model (layout hf-<model_type>) does, not {layout.name!r}; export with "
                          f"--dcp-form plain (the checkpoint's own names)")
    return found


def plan_fsdp2(source: Source, layout: Layout, include_optimizer: bool, out_dtype: str | None) -> Fsdp2Plan:
    """Map the checkpoint's logical tensors onto the FSDP2 keys (see the module docstring): each
    module parameter runs of rows of the checkpoint's tensors (``models.compose``), a tied head
    the embedding's again under its own key.

    Raises:
        LayoutError: an unknown layout, tensors missing, or (with `include_optimizer`) no AdamW
            step and hyper-parameters recorded; every problem named.
    """
    manifest = source.manifest
    try:
        spec, view, modules = module_model(layout)
    except LayoutError as e:
        raise LayoutError(f"{source.loc}: {e}") from None
    shapes = placed(spec, modules).shapes
    heads = dict(modules.tied)
    shapes |= {head: shapes[embedding] for head, embedding in heads.items() if embedding in shapes}
    states = {"": "model/"} | ({m: f"{p}/" for m, p in MOMENTS.items()} if include_optimizer else {})
    tensors, problems = [], []
    for moment, prefix in states.items():
        runs = compose(spec, view, modules, prefix)
        runs |= {head: runs[embedding] for head, embedding in heads.items() if embedding in runs}
        for fqn, rs in runs.items():
            key = f"{MODEL}.{fqn}" if not moment else f"{OPTIM}.state.{fqn}.{moment}"
            missing = [r.fqn for r in rs if r.fqn not in manifest.tensors]
            problems += missing
            if missing:
                continue
            pieces = tuple((r.fqn, _rows(manifest.tensors[r.fqn].shape, r.src_row, r.count)) for r in rs)
            dtypes = {manifest.tensors[r.fqn].dtype for r in rs}
            if len(dtypes) != 1 or sum(r.count for r in rs) != math.prod(shapes[fqn]) // math.prod(pieces[0][1].lengths[1:]):
                problems.append(f"{key}: its parts do not stack into {list(shapes[fqn])}")
                continue
            tensors.append(Stacked(key, shapes[fqn], output_dtype(dtypes.pop(), out_dtype), 0, pieces))
    if problems:
        raise LayoutError(f"cannot export the fsdp2 form: {len(problems)} tensor(s) missing or unlike the model: "
                          + summarize(sorted(problems)))
    values = optimizer_values(source, list(shapes.items())) if include_optimizer else {}
    chosen = {name for t in tensors for name, _ in t.pieces}
    return Fsdp2Plan(tuple(tensors), values, sorted(set(manifest.tensors) - chosen))


def _rows(shape: tuple[int, ...], row: int, count: int) -> Box:
    """Rows [row, row + count) of a tensor of `shape`, whole along its other dims."""
    return Box((row, *(0 for _ in shape[1:])), (count, *shape[1:]))


def optimizer_values(source: Source, params: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """Each parameter's AdamW step and the parameter groups, under their DCP keys.

    Raises:
        LayoutError: the checkpoint records no AdamW with its step and hyper-parameters.
    """
    adamw = adamw_of(source.manifest, str(source.loc), "the fsdp2 form's optimizer state (export without --include-optimizer)")
    options = adamw.torch_options() | {"lr": adamw.next_lr(), "initial_lr": adamw.lr}
    values: dict[str, Any] = {f"{OPTIM}.state.{fqn}.step": torch.tensor(float(adamw.step)) for fqn, _ in params}
    for i, (names, decay) in enumerate(decay_groups(params, options["weight_decay"])):
        for option, value in (options | {"weight_decay": decay, "params": names}).items():
            values[f"{OPTIM}.param_groups.{i}.{option}"] = value
    return values


def fsdp2_writer(source: Source, layout: Layout, out_dtype: str | None, include_optimizer: bool) -> Writer:
    """Plan the FSDP2 form (failing before any write) and return its writer.

    Raises:
        LayoutError: see `plan_fsdp2`.
    """
    plan = plan_fsdp2(source, layout, include_optimizer, out_dtype)

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        report: list[ExportedTensor] = []
        state: dict[str, Any] = {t.key: torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in plan.tensors}
        state.update(plan.values)
        source.expect(name for t in plan.tensors for name, _ in t.pieces)
        return save_dcp(state, StackingPlanner(source, plan.tensors, report), report, dst, tmp)

    # the fsdp2 form writes the optimizer's parameter groups again from the AdamW the checkpoint records
    again = "the fsdp2 form writes the parameter groups again from the checkpoint's AdamW (its two decay groups)"
    reasons = {k: again for k in source.manifest.objects if include_optimizer and k.split("/")[0] in OPTIMIZER_PARTS}
    return Writer(plan.skipped, write, frozenset(), reasons)


__all__ = ["Fsdp2Plan", "fsdp2_writer", "module_model", "plan_fsdp2"]
