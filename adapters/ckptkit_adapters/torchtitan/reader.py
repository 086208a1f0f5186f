"""The ``torchtitan`` converter: a torchtitan checkpoint (``checkpoint/step-N``, a DCP save) read
as a ckptkit checkpoint of its Llama 3 or Qwen3, laid out by torchtitan's view of the canonical model.

The save is read as any DCP save is (``common.dcp_read``); what this adds is the model: its
config read from the tensors' shapes and what the user says (``--model-config
num_attention_heads=N`` for a Llama; torchtitan records no config), recorded with the
``torchtitan-llama`` (or ``torchtitan-qwen3``) layout so that the checkpoint reshards and exports (to Hugging Face, Megatron-Core, ...) with no
layout named; its parameters (at the top of a model-only save, as torchtitan writes its last
step) kind ``param``; its step the directory's (``step-3``).
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptkit.errors import IntegrityError
from ckptkit.layouts import Layout
from ckptkit.manifest import CheckpointInfo, DataProgress, ModelInfo, OptimizerInfo, ParamGroup
from ckptkit.models import ModelSpec, Run, View, compose, placed
from ckptkit.ops.convert import ConvertReport, Progress, TensorSpec
from ckptkit.state.tree import escape
from ckptkit_adapters.common.dcp_metadata import METADATA_NAME, DcpMetadata, read_metadata
from ckptkit_adapters.common.dcp_read import (
    Assembled,
    LayoutNaming,
    Plan,
    Planned,
    assemble,
    chunk_count,
    fqn_of,
    plan_conversion,
    write_plan,
)
from ckptkit_adapters.torchtitan.view import PREFIX, WQKV, config_of, torchtitan_layout, torchtitan_model, torchtitan_modules

NAME = "torchtitan"
MARK = "tok_embeddings.weight"  # the key of torchtitan's Llama's embedding, at the top of its saves
_STEP = re.compile(r"step-(\d+)")
STATE, GROUPS = "optimizer.state.", "optimizer.param_groups."  # torchtitan's flattened optimizer state dict, keyed by module names
MOMENTS = ("exp_avg", "exp_avg_sq")
MODELS = {"llama": "Llama 3", "qwen3": "Qwen3"}  # torchtitan's name of the model of each type


def _shapes(md: DcpMetadata) -> dict[str, tuple[int, ...]]:
    return {key: tuple(meta.shape) for key, meta in md.entries.items() if meta is not None}


def _step(src: str, objects: Mapping[str, Any]) -> int | None:
    """The step of the save: its ``train_state``'s, else its directory's (``step-3``), else None (the optimizer's)."""
    step = objects.get("train_state/step")
    if isinstance(step, int):
        return step
    named = _STEP.fullmatch(os.path.basename(os.path.normpath(src)))
    return int(named.group(1)) if named else None


def _progress(objects: Mapping[str, Any]) -> DataProgress | None:
    """The tokens the run has seen (``train_state.ntokens_seen``), where it says."""
    tokens = objects.get("train_state/ntokens_seen")
    return DataProgress(consumed_tokens=tokens) if isinstance(tokens, int) else None


def _moments(src: str, md: DcpMetadata, plan: Plan, spec: ModelSpec, saved: View) -> OptimizerInfo | None:
    """Bring the optimizer's moments in under the saved names, as the layout cuts them
    (``optimizer/exp_avg/<parameter>``): each of torchtitan's (keyed by the modules' names,
    ``wqkv`` fused) split into the parameters' through the canonical model, its rows as the
    parameters' are; and the optimizer it is (its parameter groups, step). None when the save
    holds no optimizer (a model-only save), or not every parameter's moments (kept as saved)."""
    modules = torchtitan_modules(spec) if any(k.startswith(STATE) and f".{WQKV}." in k for k in md.entries) else saved
    shapes, planned = placed(spec, modules).shapes, {t.key: t for t in plan.tensors}
    found = []
    for moment in MOMENTS:
        keys = {name: f"{STATE}{name}.{moment}" for name in shapes}
        if not all(k in planned and planned[k].spec.shape == shapes[n] for n, k in keys.items()):
            continue
        found.append(moment)
        plan.tensors = [t for t in plan.tensors if t.key not in set(keys.values())]
        stored = placed(spec, saved).shapes
        for name, runs in compose(spec, modules, saved).items():
            parts = [planned[keys[r.fqn]] for r in runs]
            tensor = TensorSpec(name=f"optimizer/{moment}/{escape(name)}", source=" + ".join(dict.fromkeys(p.key for p in parts)),
                                dtype=parts[0].spec.dtype, shape=stored[name], kind="optimizer")
            plan.assembled.append(Assembled(tensor, functools.partial(_rows, src, md, runs, parts),
                                            sum(chunk_count(p.meta, p.region) for p in dict((p.key, p) for p in parts).values())))
    if not found:
        return None
    groups: dict[str, dict[str, Any]] = {}  # each module parameter's options (torchtitan saves them per parameter)
    for name in shapes:
        prefix = fqn_of(f"{GROUPS}{name}") + "/"
        groups[name] = {k[len(prefix):]: v for k, v in plan.objects.items() if k.startswith(prefix)}
    options: list[tuple[dict[str, Any], list[str]]] = []
    for name, opts in groups.items():
        same = next((names for o, names in options if o == opts), None)
        if same is None:
            options.append((opts, [name]))
        else:
            same.append(name)
    first = options[0][0]
    steps = [planned[f"{STATE}{name}.step"] for name in shapes if f"{STATE}{name}.step" in planned]
    step = int(np.frombuffer(assemble(src, md, steps[0]).tobytes(), np.float32)[0]) if steps and steps[0].spec.dtype == "float32" else None
    return OptimizerInfo(type="adamw" if first.get("decoupled_weight_decay") else "adam", step=step,
                         hyperparameters={k: first.get("initial_lr", first.get("lr")) if k == "lr" else first.get(k)
                                          for k in ("lr", "betas", "eps", "weight_decay")},
                         param_groups=tuple(ParamGroup(params=tuple(names), options=o) for o, names in options))


def _rows(src: str, md: DcpMetadata, runs: list[Run], parts: list[Planned]) -> np.ndarray[Any, Any]:
    """The tensor made of `runs` of rows of the DCP entries `parts` (each read whole once), as flat bytes."""
    whole: dict[str, np.ndarray[Any, Any]] = {}
    out = []
    for run, part in zip(runs, parts):
        if part.key not in whole:
            rows = part.spec.shape[0] if part.spec.shape else 1
            whole[part.key] = assemble(src, md, part).reshape(rows, -1)
        out.append(whole[part.key][run.src_row:run.src_row + run.count])
    return np.concatenate(out).reshape(-1)


class TorchtitanConverter:
    """The ``torchtitan`` converter (the torchtitan adapter's reader)."""

    name = NAME
    description = "torchtitan checkpoint (a checkpoint/step-N DCP save of its Llama 3 or Qwen3)"
    refines = "dcp"  # a DCP save: where both detect it, this reader is chosen

    def detect(self, path: str) -> bool:
        """Whether `path` is a DCP save (``.metadata``) holding torchtitan's Llama embedding at its top."""
        if not os.path.isfile(os.path.join(path, METADATA_NAME)):
            return False
        try:
            return MARK in read_metadata(path).entries
        except Exception:  # noqa: BLE001 - detection never raises: the DCP reader says what is wrong with it
            return False

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None, config: Mapping[str, Any] | None = None) -> ConvertReport:
        """Convert the torchtitan save `src` into the committed ckptkit checkpoint `dst`, laid out
        by `layout` if given, else by the ``torchtitan-llama`` layout of the model read from its
        shapes and `config` (at least ``num_attention_heads``; with `layout`, the config it was built for).

        Raises:
            LayoutError: a model that is not torchtitan's Llama, no heads given, or a layout that
                does not fit the tensors (nothing written).
            ManifestError, IntegrityError, CheckpointExistsError, StorageError: as the ``dcp`` converter's.
        """
        started = time.perf_counter()
        if not os.path.isdir(src):
            raise IntegrityError(f"{src}: no such directory")
        md = read_metadata(src)
        assumed: list[str] = []
        if layout is None:
            model, assumed = config_of(_shapes(md), config or {})
            layout = torchtitan_layout(model)
        plan = plan_conversion(src, md, LayoutNaming(layout))
        info = None
        if layout.name.startswith(PREFIX):
            spec, saved = torchtitan_model(layout)
            info = CheckpointInfo(model=ModelInfo(family=layout.name, config=dict(layout.config)),
                                  optimizer=_moments(src, md, plan, spec, saved), data_progress=_progress(plan.objects))
        report = write_plan(NAME, src, dst, md, plan, allow_skip=allow_skip, progress=progress, started=started,
                            step=_step(src, plan.objects), info=info, layout=layout)
        if assumed:
            warning = (f"the model's {', '.join(assumed)} assumed, torchtitan's {MODELS[str(layout.config['model_type'])]} defaults "
                       "(a torchtitan checkpoint records no config): give --model-config KEY=VALUE where the job's differ")
            report = report.model_copy(update={"warnings": [*report.warnings, warning]})
        return report


CONVERTER = TorchtitanConverter()

__all__ = ["CONVERTER", "NAME", "TorchtitanConverter"]
