"""Export a DeepSpeed save as ZeRO-3's own per-rank files at a new data-parallel size: what a ZeRO-3
engine of N ranks writes with ``engine.save_checkpoint`` and loads back as its own save
(``engine.load_checkpoint(DIR)``, no ``load_universal``), every parameter group with its own
hyper-parameters (DeepSpeed 0.19's ZeRO-3 universal loader gives every group the first one's).

The files, as DeepSpeed 0.19 names them, ``torch.save`` archives but ``latest``:

- ``latest``: the tag, ``global_step<N>``;
- ``<tag>/zero_pp_rank_<r>_mp_rank_00_model_states.pt`` for each rank r < N: the model-states file
  a ZeRO-3 engine saves (its parameters placeholders, its buffers whole, DeepSpeed's counters and
  records with ``dp_world_size`` N, the scheduler, ``ds_config``, the client state), the same on
  every rank;
- ``<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``: ``{"optimizer_state_dict":
  {"zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "partition_count": N,
  "optimizer_state_dict": {"state": {<sub-group>: {"step", "exp_avg", "exp_avg_sq"}},
  "param_groups": [...]}, "fp32_flat_groups": [...]}, "ds_config", "ds_version"}``, named with
  ``bf16_`` when the save's ``ds_config`` enables bf16 (the name such an engine looks for).

Partitions, as ZeRO-3 cuts them: each parameter flattened and padded with zeros to a multiple of
N, rank r holding its elements [r p, (r + 1) p), p = ceil(numel / N); each optimizer group's
parameters, in order, split into sub-groups once they reach ``sub_group_size`` partition
elements (the save's ``ds_config`` ``zero_optimization``; DeepSpeed's default 10^9: one sub-group a
group below that), each sub-group one flat fp32 tensor per rank for the masters and one for each
moment; ``param_shapes`` lists the sub-groups, as such an engine records them. The loading engine
must cut its sub-groups alike (the same ``sub_group_size``).

The loss scaler and the ZeRO stage are DeepSpeed objects: they are pickled as references to
DeepSpeed's classes with the state the conversion recorded (``info.loss_scaler``), without
importing DeepSpeed. The source is a checkpoint converted from a DeepSpeed ZeRO-3 save (at any
data-parallel size): its records say the engine's precision, sub-groups, loss scaler and the
order of its parameters (a ZeRO-1/2 save orders them its own way). Frozen parameters, which a
ZeRO-3 engine saves as per-rank fragments, are refused. Rank by rank, only the rows of each
parameter that hold the rank's elements are read; a rank's file is built in memory (its 1/N of
the masters and moments, as the engine holds it).
"""

from __future__ import annotations

import copyreg
import math
import pickle
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptkit.boxes import Box
from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.source import Source, Writer, Written, exported
from ckptkit.state.torch_io import byte_view, torch_dtype
from ckptkit.storage import Storage
from ckptkit_adapters.deepspeed.writer import STATES, Files, UniversalPlan, plan_universal, put, universal_values

SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size when ds_config names none
SCALERS = ("LossScaler", "DynamicLossScaler")  # the classes of deepspeed.runtime.fp16.loss_scaler


@dataclass(frozen=True)
class Zero3Plan:
    """What the native ZeRO-3 export writes, besides the universal plan's records and groups."""

    plan: UniversalPlan
    dp: int
    tag: str
    sub_groups: list[tuple[int, list[str]]]  # (optimizer group, its parameters) per sub-group, in order
    prefix: str  # of the optimizer-states files' names: "bf16_" or ""
    scaler: dict[str, Any]  # the loss scaler's class name and state


def sub_groups(groups: list[list[str]], numels: dict[str, int], dp: int, size: int) -> list[tuple[int, list[str]]]:
    """ZeRO-3's sub-groups of the optimizer `groups` at `dp` ranks (pure): a group whole when its
    partitions hold at most `size` elements, else cut after each parameter that brings the
    running count to `size`, the last sub-group ending with the group."""
    out: list[tuple[int, list[str]]] = []
    for g, names in enumerate(groups):
        parts = [math.ceil(numels[n] / dp) for n in names]
        if size >= sum(parts):
            out.append((g, list(names)))
            continue
        current: list[str] = []
        count = 0
        for i, (name, part) in enumerate(zip(names, parts)):
            current.append(name)
            count += part
            if count >= size or i == len(names) - 1:
                out.append((g, current))
                current, count = [], 0
    return out


def plan_zero3(source: Source, dp: int) -> Zero3Plan:
    """Decide every file of the native ZeRO-3 export at `dp` ranks (pure but for the manifest).

    Raises:
        LayoutError: a source not converted from DeepSpeed, no loss scaler recorded, or
            anything the universal plan lacks; every finding listed.
    """
    manifest, where = source.manifest, str(source.loc)
    if "deepspeed/param_shapes" not in manifest.objects:
        raise LayoutError(f"{where}: --dp writes a ZeRO-3 save's own files, from a checkpoint converted from DeepSpeed (its "
                          "ds_config and records say the engine's precision, sub-groups and loss scaler); export any other "
                          "model without --dp, as the universal checkpoint")
    plan = plan_universal(manifest, where)
    stage = manifest.objects.get("deepspeed/optimizer/zero_stage")
    if stage != 3:
        raise LayoutError(f"{where}: --dp writes ZeRO-3's own files from a ZeRO-3 save, and this one is of ZeRO stage "
                          f"{stage} (its parameters in that stage's order); a ZeRO-3 engine loads its universal checkpoint "
                          "(export without --dp, load with load_universal)")
    buffers = set(plan.model_states.get("buffer_names") or [])
    frozen = sorted(set(plan.others) - buffers)
    if frozen:
        raise LayoutError(f"{where}: --dp does not write the per-rank fragments of frozen parameters a ZeRO-3 engine "
                          f"saves ({summarize(frozen)}); export the universal checkpoint (without --dp)")
    scaler = dict(manifest.info.loss_scaler or {})
    kind = str(scaler.pop("type", "")).rpartition(".")[2]
    if kind not in SCALERS:
        raise LayoutError(f"{where}: the ZeRO-3 files hold DeepSpeed's loss scaler, and the checkpoint records "
                          f"{'none' if not kind else repr(kind)} (info.loss_scaler; one of {', '.join(SCALERS)})")
    found: Any = (manifest.info.config or {}).get("ds_config")
    config: dict[str, Any] = found if isinstance(found, dict) else {}
    zero: dict[str, Any] = config["zero_optimization"] if isinstance(config.get("zero_optimization"), dict) else {}
    size = zero.get("sub_group_size", SUB_GROUP_SIZE)
    if not isinstance(size, (int, float)) or size < 0:
        raise LayoutError(f"{where}: ds_config's zero_optimization.sub_group_size is {size!r}, not a count of elements")
    bf16 = isinstance(config.get("bf16"), dict) and bool(config["bf16"].get("enabled"))
    numels = {name: math.prod(manifest.tensors[f"optimizer/fp32/{name}"].shape) for g in plan.groups for name in g}
    step = manifest.objects.get("deepspeed/global_steps", manifest.step)
    return Zero3Plan(plan=plan, dp=dp, tag=f"global_step{step}", sub_groups=sub_groups(plan.groups, numels, dp, int(size)),
                     prefix="bf16_" if bf16 else "", scaler={"class": kind, "state": scaler})


def zero3_writer(source: Source, dp: int) -> Writer:
    """Plan the native ZeRO-3 export at `dp` ranks (failing before any write) and return its writer.

    Raises:
        LayoutError: see `plan_zero3`.
    """
    zplan = plan_zero3(source, dp)
    plan = zplan.plan
    # the module's parameters are placeholders in a ZeRO-3 engine's files: the engine makes them
    # from the masters, which are written (its buffers are written whole)
    used = {f"optimizer/{s}/{n}" for _, names in zplan.sub_groups for n in names for s in STATES}
    used |= set(plan.module) | {fqn for _, fqn in plan.extra_tensors}

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        return _write(source, zplan, dst, tmp)

    # ZeRO-3's own records of the partitioning are made again for `dp` ranks
    remade = {f"deepspeed/optimizer/{key}" for key in ("dynamic_loss_scale", "partition_count", "zero_stage")}
    values = (universal_values(source.manifest.objects) - {"deepspeed/optimizer/clip_grad"}) | (remade & set(source.manifest.objects))
    return Writer(sorted(fqn for fqn in source.manifest.tensors if fqn not in used), write, values)


def _write(source: Source, zplan: Zero3Plan, dst: Storage, tmp: str) -> Written:
    plan, dp, tag = zplan.plan, zplan.dp, zplan.tag
    out = Files(source, plan, dst, tmp, pickler=_PICKLE)
    manifest = source.manifest
    buffers = set(plan.model_states.get("buffer_names") or [])
    path0 = f"{tag}/zero_pp_rank_0_mp_rank_00_model_states.pt"
    module = OrderedDict()
    for fqn in plan.module:
        name = fqn.removeprefix("model/")
        module[name] = out.read(fqn, f"module/{name}", path0) if name in buffers else \
            torch.empty(0, dtype=torch_dtype(manifest.tensors[fqn].dtype))
    # a ZeRO-3 engine saves its frozen parameters' fragments (none: an empty mapping) and its DP size
    shapes = {name: shape for group in plan.model_states.get("param_shapes") or [] for name, shape in group.items()}
    states: dict[str, Any] = {"module": module, "frozen_param_fragments": OrderedDict(), **plan.model_states, "dp_world_size": dp,
                              "param_shapes": [OrderedDict((n, shapes[n]) for n in names) for _, names in zplan.sub_groups]}
    for keys, fqn in plan.extra_tensors:
        put(states, keys, out.read(fqn, "/".join(keys), path0))
    scaler = _Instance(_Global("deepspeed.runtime.fp16.loss_scaler", zplan.scaler["class"]),
                       {k: getattr(torch, v.removeprefix("torch.")) if k == "dtype" and isinstance(v, str) else v
                        for k, v in zplan.scaler["state"].items()})
    groups = plan.optimizer_state.get("param_groups", [])
    config, version = states.get("ds_config"), states.get("ds_version")
    for rank in range(dp):
        out.save(f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt", states)
        flats: dict[str, list[torch.Tensor]] = {s: [] for s in STATES}
        path = f"{tag}/{zplan.prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        for i, (_, names) in enumerate(zplan.sub_groups):
            for state, parts in flats.items():
                parts.append(torch.cat([_partition(source, f"optimizer/{state}/{n}", rank, dp) for n in names])
                             if names else torch.empty(0, dtype=torch.float32))
                if names:
                    fqns = [f"optimizer/{state}/{n}" for n in names]
                    out.tensors.append(exported(source, f"{state}[{i}]", fqns[0], byte_view(parts[-1]), "float32", path,
                                                tuple(parts[-1].shape), " + ".join(fqns)))
        optimizer = {
            "state": {i: {"step": torch.tensor(plan.steps[g], dtype=torch.float32), "exp_avg": flats["exp_avg"][i],
                          "exp_avg_sq": flats["exp_avg_sq"][i]} for i, (g, _) in enumerate(zplan.sub_groups)},
            "param_groups": [{**group, "params": [i for i, (g, _) in enumerate(zplan.sub_groups) if g == k]}
                             for k, group in enumerate(groups)],
        }
        zero = {"zero_stage": _Call(_Global("deepspeed.runtime.zero.config", "ZeroStageEnum"), (3,)), "loss_scaler": scaler,
                "dynamic_loss_scale": bool(zplan.scaler["state"].get("dynamic", False)),
                "overflow": bool(plan.optimizer_state.get("overflow", False)), "partition_count": dp,
                "optimizer_state_dict": optimizer, "fp32_flat_groups": flats["fp32"]}
        out.save(path, {"optimizer_state_dict": zero, "ds_config": config, "ds_version": version})
    out.write("latest", tag.encode())  # DeepSpeed writes the tag alone, no newline
    return out.written()


def _partition(source: Source, fqn: str, rank: int, dp: int) -> torch.Tensor:
    """Rank `rank`'s elements of tensor `fqn` flattened and padded with zeros to a multiple of
    `dp`, reading only the rows that hold them."""
    entry = source.manifest.tensors[fqn]
    numel = math.prod(entry.shape)
    part = math.ceil(numel / dp)
    start, stop = min(rank * part, numel), min((rank + 1) * part, numel)
    out = torch.zeros(part, dtype=torch.float32)
    if stop > start and not entry.shape:  # a scalar: its one element
        out[0] = float(np.frombuffer(source.read(fqn), dtype=np.float32)[0])
    elif stop > start:
        row = math.prod(entry.shape[1:])
        first, last = start // row, (stop - 1) // row + 1
        box = Box((first, *(0 for _ in entry.shape[1:])), (last - first, *entry.shape[1:]))
        rows = np.frombuffer(source.read_box(fqn, box), dtype=np.float32)
        out[: stop - start] = torch.from_numpy(rows[start - first * row: stop - first * row].copy())
    return out


class _Global:
    """A class of another package, named in a pickle without importing it."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: Any) -> Any:  # what a pickle's reduce function is; never called here
        raise TypeError(f"{self.module}.{self.name} is only named")


class _Instance:
    """An instance of the class `cls` holding `state`, unpickled as pickle rebuilds one."""

    def __init__(self, cls: _Global, state: dict[str, Any]) -> None:
        self.cls, self.state = cls, state

    def __reduce_ex__(self, protocol: Any) -> Any:
        return copyreg._reconstructor, (self.cls, object, None), self.state  # type: ignore[attr-defined]


class _Call:
    """The value `cls(*args)` (an enum member), unpickled by calling the class."""

    def __init__(self, cls: _Global, args: tuple[Any, ...]) -> None:
        self.cls, self.args = cls, args

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.cls, self.args


_PythonPickler: Any = getattr(pickle, "_Pickler")  # the pure-Python pickler, whose save a subclass can extend


class _Pickler(_PythonPickler):  # type: ignore[misc]
    """Python's own pickler, writing each `_Global` as a GLOBAL opcode (module and name)."""

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, _Global):
            if id(obj) in self.memo:
                self.write(self.get(self.memo[id(obj)][0]))
                return
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
            self.memoize(obj)
            return
        super().save(obj, save_persistent_id)


_PICKLE = types.ModuleType("ckptkit_zero3_pickle")
_PICKLE.Pickler = _Pickler  # type: ignore[attr-defined]
