"""Export to a DeepSpeed universal checkpoint: what ``ds_to_universal`` writes, which a DeepSpeed
engine with ``"checkpoint": {"load_universal": true}`` loads at another data-parallel size and
ZeRO stage (1, 2 or 3).

The files, as DeepSpeed 0.19's ``ds_to_universal`` writes them and its loader reads them
(``engine.load_checkpoint`` -> ``load_hp_checkpoint_state_from_checkpoint_dir``), all
``torch.save`` archives but ``latest_universal``:

- ``latest_universal``: the tag, ``global_step<N>_universal``;
- ``<tag>/mp_rank_00_model_states.pt``: the module's state dict (its saved dtype), DeepSpeed's
  counters and records (``global_steps``, ``param_shapes``, ``dp_world_size``...), the LR
  scheduler, ``ds_config`` and the client state, as DeepSpeed saved them (``ds_to_universal``
  copies this file);
- ``<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt``: the same for a ZeRO-3 engine, which reads
  this name, with each parameter a placeholder (an empty tensor of its dtype) as ZeRO-3 saves it;
- ``<tag>/zero/<param>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt``: ``{"cat_dim": 0, "param":
  tensor}``, the whole fp32 master and moments; ``step.pt``: the group's step (a float32 scalar
  tensor, as torch's AdamW keeps it); a buffer or a frozen parameter has only ``fp32.pt``
  (``{"param": tensor}``, its module value in fp32);
- ``<tag>/zero/optimizer_state.pt``: what DeepSpeed's universal loader reads of it: the
  parameter groups, ``ds_version``, ``clip_grad``, ``overflow``. The loss scaler (a DeepSpeed
  object) is not written: the loading engine keeps the one its config makes.

The source is a checkpoint converted from a DeepSpeed save (``deepspeed/param_shapes`` and the
other ``deepspeed/...`` records: `plan_universal`), or one of a model DeepSpeed did not save whose
modules are known (`plan_module`: each parameter under the module's name, the DeepSpeed view of a
canonical model being its modules' view, ``models.modules_of``). Everything is
planned before anything is written; tensors stream one at a time, except the module's, which
DeepSpeed keeps in one pickle.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.source import ExportedFile, ExportedTensor, Source, Writer, Written, exported
from ckptkit.io.checksum import checksum_of
from ckptkit.manifest import Manifest
from ckptkit.models.compose import Run
from ckptkit.state.torch_io import byte_view, torch_dtype
from ckptkit.storage import Storage

STATES = ("fp32", "exp_avg", "exp_avg_sq")  # the per-parameter states of a universal checkpoint
LATEST = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # what a ZeRO-3 engine loads a universal checkpoint from
# The model-states keys DeepSpeed's loader reads (the rest come back to the caller as client state).
REQUIRED = ("global_steps", "skipped_steps", "dp_world_size", "mp_world_size", "ds_version")
# Keys of the model-states file in the order DeepSpeed 0.19 writes them; its other records follow.
ORDER = ("buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
         "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
         "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version")
# Values of DeepSpeed's ZeRO optimizer file that its universal loader reads (``_load_global_state``);
# the loss scaler, a DeepSpeed object, is left to the loading engine's own config.
OPTIMIZER_VALUES = ("overflow", "clip_grad")
FRAGMENTS = "deepspeed/frozen_param_fragments/"
DS_VERSION = "0.19.8"  # the DeepSpeed whose universal checkpoint a model DeepSpeed did not save is written as


@dataclass(frozen=True)
class UniversalPlan:
    """What a universal export writes: the tag, the trainable parameters by group, the other module
    tensors, the values of the two small files, the tensors of the model-states file."""

    tag: str
    groups: list[list[str]]  # trainable parameter names, optimizer group by group
    steps: list[float]  # each group's step
    others: list[str]  # module entries (buffers, frozen parameters) with only an fp32.pt
    module: list[str]  # model/<name> tensors of the module state dict
    model_states: dict[str, Any]  # the model-states file's values, without its tensors
    extra_tensors: list[tuple[tuple[str, ...], str]]  # (where in the model-states file, fqn): fragments, client tensors
    optimizer_state: dict[str, Any]
    # where the tensors of a model that is not DeepSpeed's come from: each one the _write reads by its
    # DeepSpeed-side key (optimizer/<state>/<name>, model/<name>) made of runs of the checkpoint's rows
    runs: dict[str, list[Run]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def deepspeed_writer(source: Source) -> Writer:
    """Plan the universal checkpoint (failing before any write) and return its writer.

    Raises:
        LayoutError: the checkpoint records no DeepSpeed parameter names, or lacks what DeepSpeed
            needs (a parameter's master or moments, the step, the parameter groups, a counter);
            every finding is listed.
    """
    manifest, where = source.manifest, str(source.loc)
    plan = plan_universal(manifest, where) if "deepspeed/param_shapes" in manifest.objects else plan_module(manifest, where)

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        return _write(source, plan, dst, tmp)

    used = {r.fqn for key in _wanted(plan) for r in _runs(plan, source.manifest, key)}
    carried = universal_values(manifest.objects) if "deepspeed/param_shapes" in manifest.objects else frozenset()
    return Writer(sorted(fqn for fqn in source.manifest.tensors if fqn not in used), write, carried)


def universal_values(objects: dict[str, Any]) -> frozenset[str]:
    """The values of a DeepSpeed save the universal checkpoint carries: the model states file's
    records, the optimizer file's values its universal loader reads, the client state."""
    optimizer = {f"deepspeed/optimizer/{key}" for key in (*OPTIMIZER_VALUES, "param_groups", "ds_version", "step")}
    return frozenset(key for key in objects if key in optimizer or key.startswith("client/")
                     or (key.startswith("deepspeed/") and "/" not in key[len("deepspeed/"):]))


def _wanted(plan: UniversalPlan) -> list[str]:
    """Every checkpoint tensor the universal checkpoint is made of, by the key the plan reads it under."""
    return ([f"optimizer/{s}/{n}" for g in plan.groups for n in g for s in STATES]
            + [f"model/{n}" for n in plan.others] + plan.module + [fqn for _, fqn in plan.extra_tensors])


def _runs(plan: UniversalPlan, manifest: Manifest, key: str) -> list[Run]:
    """The runs of checkpoint rows a key of the plan is read from (a tensor whole, unless the plan cuts it)."""
    return plan.runs.get(key) or [Run(0, (manifest.tensors[key].shape or (1,))[0], key, 0)]


def plan_universal(manifest: Manifest, where: str) -> UniversalPlan:
    """Decide every file and value of the universal checkpoint of `manifest` (pure).

    Raises:
        LayoutError: see `deepspeed_writer`.
    """
    objects: dict[str, Any] = manifest.objects
    shapes = _param_shapes(objects, where)
    groups = [list(g) for g in shapes]
    problems = _state_problems(manifest, shapes)
    module, others = _module_entries(manifest, {n for g in groups for n in g}, problems)
    steps = _steps(manifest, len(groups), problems)
    optimizer_state = _optimizer_state(manifest, len(groups), problems)
    model_states = _model_states(manifest, problems)
    if problems:
        raise LayoutError(f"{where}: cannot write a DeepSpeed universal checkpoint: " + summarize(problems))
    names = sorted(manifest.tensors)
    extra: list[tuple[tuple[str, ...], str]] = [(("frozen_param_fragments", fqn[len(FRAGMENTS):]), fqn)
                                                for fqn in names if fqn.startswith(FRAGMENTS)]
    extra += [(tuple(fqn.split("/")[1:]), fqn) for fqn in names if fqn.startswith("client/")]
    return UniversalPlan(tag=f"global_step{model_states['global_steps']}_universal", groups=groups, steps=steps,
                         others=others, module=module, model_states=model_states, extra_tensors=extra,
                         optimizer_state=optimizer_state)


def plan_module(manifest: Manifest, where: str) -> UniversalPlan:
    """The universal checkpoint of a model DeepSpeed did not save (the reference trainer's, a
    converted Hugging Face one), as a DeepSpeed engine wrapping that model's module would hold it
    (pure): each parameter under the module's name (``models.modules_of``: the reference
    trainer's ``Stage``, transformers' model), its fp32 master the checkpoint's parameter and its
    moments the checkpoint's, composed as the module fuses them (``models.compose``); the
    module's state dict the same parameters (a tied head under its own name too); the
    trainer's two AdamW groups (weights of two or more dims decayed, the rest not), at the
    learning rate of the next step; the counters of the checkpoint's step.

    Raises:
        LayoutError: no layout, a model whose modules are not known, no AdamW recorded,
            parameters that are not fp32, moments missing; every finding listed.
    """
    from ckptkit.exports.adamw import adamw_of, decay_groups
    from ckptkit.layouts import layout_for
    from ckptkit.models import compose, modules_of, placed

    layout = layout_for(manifest, where=where)
    found = modules_of(layout, manifest.info.config)
    if found is None:
        raise LayoutError(f"{where}: a universal checkpoint names each parameter as the module DeepSpeed wraps does, and the "
                          f"{layout.name} layout's modules are not known (the reference trainer's and Hugging Face models' are)")
    spec, view, modules = found
    adamw = adamw_of(manifest, where, "a DeepSpeed universal checkpoint (the masters and moments DeepSpeed resumes from)")
    shapes = placed(spec, modules).shapes
    params = list(shapes.items())
    held = {name: name for name in shapes} | {h: s for h, s in modules.tied.items() if s in shapes}  # module tensor -> its parameter
    prefixes = {"fp32": "model/", "exp_avg": "optimizer/exp_avg/", "exp_avg_sq": "optimizer/exp_avg_sq/"}
    runs = {f"optimizer/{state}/{name}": rs for state, prefix in prefixes.items()
            for name, rs in compose(spec, view, modules, prefix).items()}
    runs |= {f"model/{tensor}": runs[f"optimizer/fp32/{param}"] for tensor, param in held.items()}
    keyed = {f"optimizer/{state}/{name}": name for state in prefixes for name in shapes} | {f"model/{t}": p for t, p in held.items()}
    problems = sorted({f"{r.fqn} is missing" for rs in runs.values() for r in rs if r.fqn not in manifest.tensors})
    problems += sorted({f"{r.fqn} is {manifest.tensors[r.fqn].dtype}, not the float32 DeepSpeed keeps masters and moments in"
                        for rs in runs.values() for r in rs
                        if r.fqn in manifest.tensors and manifest.tensors[r.fqn].dtype != "float32"})
    problems += [f"{name!r} is not a plain file name" for name in shapes if not _plain(name)]
    if problems:
        raise LayoutError(f"{where}: cannot write a DeepSpeed universal checkpoint: " + summarize(problems))
    options = adamw.torch_options() | {"lr": adamw.next_lr()}
    groups = decay_groups(params, adamw.weight_decay)
    progress = manifest.info.data_progress
    records: dict[str, Any] = {
        "buffer_names": [], "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(shapes[n])) for n in names) for names, _ in groups],
        "frozen_param_shapes": OrderedDict(), "shared_params": {}, "frozen_param_fragments": OrderedDict(),
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": manifest.step,
        "global_samples": progress.consumed_samples if progress is not None else 0, "dp_world_size": 1, "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1}, "ds_version": DS_VERSION,
    }
    optimizer_state = {"ds_version": DS_VERSION, "param_groups": [
        {**options, "weight_decay": decay, "params": [i]} for i, (_, decay) in enumerate(groups)]}
    return UniversalPlan(tag=f"global_step{manifest.step}_universal", groups=[names for names, _ in groups],
                         steps=[float(adamw.step)] * len(groups), others=[], module=[f"model/{t}" for t in held],
                         model_states=records, extra_tensors=[], optimizer_state=optimizer_state, runs=runs,
                         shapes={key: shapes[param] for key, param in keyed.items()})


def _param_shapes(objects: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """DeepSpeed's record of each optimizer group's parameters (names and shapes).

    Raises:
        LayoutError: none recorded, or a save this export does not write (stage 0, model-parallel).
    """
    shapes = objects.get("deepspeed/param_shapes")
    if "deepspeed/param_shapes" in objects and not shapes:
        raise LayoutError(f"{where}: a ZeRO stage 0 save names its optimizer state by index only (no deepspeed/param_shapes); "
                          "a universal checkpoint holds each parameter's master and moments by name: convert a ZeRO 1-3 save")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise LayoutError(f"{where}: records no DeepSpeed parameter names (deepspeed/param_shapes, kept by `ckptkit convert "
                          "--from deepspeed`); a universal checkpoint names each parameter as the DeepSpeed module does")
    if objects.get("deepspeed/mp_world_size", 1) != 1:
        raise LayoutError(f"{where}: a model-parallel save (mp_world_size {objects.get('deepspeed/mp_world_size')}) is not "
                          "written as a universal checkpoint yet; only mp_world_size 1")
    return shapes


def _state_problems(manifest: Manifest, shapes: list[dict[str, Any]]) -> list[str]:
    """What is missing or odd among the masters and moments of the parameters of `shapes`."""
    tensors = manifest.tensors
    problems: list[str] = []
    for name, shape in ((n, s) for g in shapes for n, s in g.items()):
        if not _plain(name):
            problems.append(f"{name!r} is not a plain file name")
        for state in STATES:
            entry = tensors.get(f"optimizer/{state}/{name}")
            if entry is None:
                problems.append(f"optimizer/{state}/{name} is missing")
            elif entry.dtype != "float32" or list(entry.shape) != list(shape):
                problems.append(f"optimizer/{state}/{name} is {entry.dtype} {list(entry.shape)}, DeepSpeed's {shape} in float32")
    extra = sorted({f.split("/")[1] for f in tensors if f.startswith("optimizer/") and f.split("/")[1] not in STATES})
    if extra:
        problems.append(f"optimizer state {', '.join(extra)} has no place in a universal checkpoint (only {', '.join(STATES)})")
    return problems


def _module_entries(manifest: Manifest, trainable: set[str], problems: list[str]) -> tuple[list[str], list[str]]:
    """The module's tensors (``model/<name>``) and the names among them that have no optimizer
    state (buffers, frozen parameters); what DeepSpeed would not know is added to `problems`."""
    objects: dict[str, Any] = manifest.objects
    tensors = manifest.tensors
    module = sorted(fqn for fqn, t in tensors.items() if fqn.startswith("model/") and t.kind in ("param", "buffer"))
    known = (trainable | set(_list(objects.get("deepspeed/buffer_names")))
             | set(_dict(objects.get("deepspeed/frozen_param_shapes"))))
    unknown = [fqn for fqn in module if fqn[len("model/"):] not in known]
    if unknown:
        problems.append("module tensors DeepSpeed does not name (not in param_shapes, buffer_names or frozen_param_shapes): "
                        + ", ".join(unknown[:10]))
    problems += [f"model/{n} is missing" for n in sorted(trainable) if f"model/{n}" not in tensors]
    others = [fqn[len("model/"):] for fqn in module if fqn[len("model/"):] not in trainable]
    problems += [f"{n!r} is not a plain file name" for n in others if not _plain(n)]
    return module, others


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..") and "\0" not in name


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _steps(manifest: Manifest, n: int, problems: list[str]) -> list[float]:
    """Each group's step: DeepSpeed's own record, else the optimizer's step."""
    recorded: Any = manifest.objects.get("deepspeed/optimizer/step")
    if isinstance(recorded, list) and len(recorded) == n and all(isinstance(s, (int, float)) for s in recorded):
        return [float(s) for s in recorded]
    info = manifest.info.optimizer
    if info is not None and info.step is not None:
        return [float(info.step)] * n
    problems.append("no optimizer step recorded (deepspeed/optimizer/step or info.optimizer.step)")
    return []


def _optimizer_state(manifest: Manifest, n: int, problems: list[str]) -> dict[str, Any]:
    """``zero/optimizer_state.pt``: what DeepSpeed's universal loader reads of it."""
    objects: dict[str, Any] = manifest.objects
    groups: Any = objects.get("deepspeed/optimizer/param_groups")
    if not isinstance(groups, list):
        info = manifest.info.optimizer
        groups = [dict(g.options) for g in info.param_groups] if info is not None else []
    if len(groups) != n or not all(isinstance(g, dict) for g in groups):
        problems.append(f"{len(groups)} optimizer parameter groups recorded, DeepSpeed's param_shapes has {n}")
        return {}
    version = objects.get("deepspeed/optimizer/ds_version", objects.get("deepspeed/ds_version"))
    out: dict[str, Any] = {key: objects[f"deepspeed/optimizer/{key}"] for key in OPTIMIZER_VALUES
                           if f"deepspeed/optimizer/{key}" in objects}
    out["ds_version"] = version
    # torch's optimizers keep betas as a tuple (JSON made it a list); "params" as a ZeRO-1/2
    # base optimizer holds them: one flat tensor per group
    out["param_groups"] = [{**{k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in g.items()}, "params": [i]}
                           for i, g in enumerate(groups)]
    return out


def _model_states(manifest: Manifest, problems: list[str]) -> dict[str, Any]:
    """The values of ``mp_rank_00_model_states.pt`` (its tensors are added when written)."""
    objects: dict[str, Any] = manifest.objects
    records: dict[str, Any] = {key[len("deepspeed/"):]: value for key, value in objects.items()
               if key.startswith("deepspeed/") and "/" not in key[len("deepspeed/"):]}
    if "global_samples" not in records and manifest.info.data_progress is not None:
        records["global_samples"] = manifest.info.data_progress.consumed_samples
    records["lr_scheduler"] = manifest.info.scheduler
    ds_config = (manifest.info.config or {}).get("ds_config")
    if ds_config is not None:
        records["ds_config"] = ds_config
    problems += [f"deepspeed/{key} is not recorded" for key in REQUIRED if key not in records]
    records["optimizer"] = None  # a ZeRO engine keeps its optimizer state in the zero files
    records["param_shapes"] = [OrderedDict((n, torch.Size(s)) for n, s in g.items()) for g in _list(records.get("param_shapes"))]
    if isinstance(records.get("frozen_param_shapes"), dict):  # None as some saves record it (a bf16 run's) stays None
        records["frozen_param_shapes"] = OrderedDict((n, torch.Size(s)) for n, s in records["frozen_param_shapes"].items())
    if isinstance(records.get("frozen_param_fragments"), dict) or any(f.startswith(FRAGMENTS) for f in manifest.tensors):
        records["frozen_param_fragments"] = OrderedDict()  # its tensors are added when written
    out = {key: records.pop(key) for key in ORDER if key in records}
    out.update(records)
    client = {key[len("client/"):]: value for key, value in objects.items() if key.startswith("client/")}
    clashes = sorted(set(client) & set(out))
    if clashes:
        problems.append(f"client state keys that are DeepSpeed's own: {', '.join(clashes)}")
    out.update(client)
    return out


class Files:
    """What a DeepSpeed export writes under `tmp`, and its report: `read` a tensor of the plan,
    `save` a ``torch.save`` archive (`pickler`: the pickle module it is written with)."""

    def __init__(self, source: Source, plan: UniversalPlan, dst: Storage, tmp: str, pickler: Any = None) -> None:
        self.source, self.plan, self.dst, self.tmp, self.pickler = source, plan, dst, tmp, pickler
        self.tensors: list[ExportedTensor] = []
        self.files: list[ExportedFile] = []

    def save(self, path: str, value: Any) -> None:
        out = io.BytesIO()
        torch.save(value, out) if self.pickler is None else torch.save(value, out, pickle_module=self.pickler)
        self.write(path, out.getvalue())

    def write(self, path: str, data: bytes) -> None:
        self.dst.write(f"{self.tmp}/{path}", [data])
        self.files.append(ExportedFile(path=path, size=len(data), checksum=checksum_of(data)))

    def read(self, key: str, name: str, path: str, dtype: str | None = None) -> torch.Tensor:
        """The plan's tensor `key` (in `dtype`; default its saved one), reported as `name` in `path`."""
        manifest = self.source.manifest
        runs = _runs(self.plan, manifest, key)
        entry = manifest.tensors[runs[0].fqn]
        shape = self.plan.shapes.get(key, entry.shape)
        saved = torch.from_numpy(self.source.read_runs(runs)).view(torch_dtype(entry.dtype)).reshape(shape)
        tensor = saved if dtype is None else saved.to(torch_dtype(dtype))
        fqns = list(dict.fromkeys(r.fqn for r in runs))
        self.tensors.append(exported(self.source, name, fqns[0], byte_view(tensor), dtype or entry.dtype, path, shape, " + ".join(fqns)))
        return tensor

    def expect(self) -> None:
        """Tell the source every tensor the plan reads, in order (its read-ahead)."""
        self.source.expect(r.fqn for key in _wanted(self.plan) for r in self.plan.runs.get(key, [Run(0, 0, key, 0)]))

    def written(self) -> Written:
        return Written(self.tensors, self.files)


def _write(source: Source, plan: UniversalPlan, dst: Storage, tmp: str) -> Written:
    """Write the plan's files under `tmp`; the export report's tensors and files."""
    out = Files(source, plan, dst, tmp)
    save, read = out.save, out.read
    zero = f"{plan.tag}/zero"
    out.expect()
    for group, step in zip(plan.groups, plan.steps):
        for name in group:
            for state in STATES:
                path = f"{zero}/{name}/{state}.pt"
                save(path, {"cat_dim": 0, "param": read(f"optimizer/{state}/{name}", path, path)})
            save(f"{zero}/{name}/step.pt", torch.tensor(step, dtype=torch.float32))
    for name in plan.others:  # buffers and frozen parameters: their module value, in fp32 (ds_to_universal's own fallback)
        path = f"{zero}/{name}/fp32.pt"
        save(path, {"param": read(f"model/{name}", path, path, "float32")})
    save(f"{zero}/optimizer_state.pt", _with_zero3_view(plan))
    states_path = f"{plan.tag}/{MODEL_STATES}"
    names = [fqn[len("model/"):] for fqn in plan.module]
    states = {"module": OrderedDict((name, read(f"model/{name}", f"module/{name}", states_path)) for name in names),
              **plan.model_states}
    for keys, fqn in plan.extra_tensors:
        put(states, keys, read(fqn, "/".join(keys), states_path))
    save(states_path, states)
    # A ZeRO-3 engine reads rank 0's file of its own name, its parameters placeholders as it saves them
    # (their values come from zero/); its buffers whole. A ZeRO-1/2 engine reads MODEL_STATES.
    save(f"{plan.tag}/{ZERO3_MODEL_STATES}", zero3_model_states(plan, states))
    out.write(LATEST, plan.tag.encode())  # DeepSpeed writes the tag alone, no newline
    return out.written()


def zero3_model_states(plan: UniversalPlan, states: dict[str, Any]) -> dict[str, Any]:
    """The model-states file as a ZeRO-3 engine saves it: its parameters placeholders (empty
    tensors of their dtype; their values are in the optimizer's partitions), its buffers whole."""
    buffers = set(_list(plan.model_states.get("buffer_names")))
    placeheld = OrderedDict((name, tensor if name in buffers else tensor.new_empty(0)) for name, tensor in states["module"].items())
    return {**states, "module": placeheld}


def _with_zero3_view(plan: UniversalPlan) -> dict[str, Any]:
    """``zero/optimizer_state.pt`` with what a ZeRO-3 engine's universal loader reads of it as
    well: ``optimizer_state_dict``, the first group's step and the groups (it gives every group
    the first one's step and hyper-parameters)."""
    if not plan.steps:
        return plan.optimizer_state
    groups = plan.optimizer_state.get("param_groups", [])
    return {**plan.optimizer_state, "optimizer_state_dict": {
        "state": {0: {"step": torch.tensor(plan.steps[0], dtype=torch.float32)}}, "param_groups": groups}}


def put(tree: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value

