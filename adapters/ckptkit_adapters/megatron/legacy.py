"""Convert a legacy Megatron-LM checkpoint (``--ckpt-format torch``: ``mp_rank_XX[_YYY]/model_optim_rng.pt``).

The iteration directory holds one ``mp_rank_{tp:02d}[_{pp:03d}]`` directory per model-parallel
rank, each with ``model_optim_rng.pt`` (the stage's TP-local state dict under stage-local layer
numbers, the optimizer, RNG states, Megatron-LM's arguments) and, with the distributed
optimizer, ``distrib_optim.pt`` (flat fp32 masters and Adam moments per grad buffer, gathered
over DP). Every file is read without torch through `LEGACY_ALLOWED`, one at a time; a tensor is
assembled from its TP pieces when its turn to be written comes (the files it needs open then).

Names are those of the ``torch_dist`` converter (``model/decoder.layers.<i>.self_attention.linear_qkv.weight``,
``optimizer/{fp32,exp_avg,exp_avg_sq}/<key>``): global layer numbers, the local spec's norms under
Megatron-Core's sharded names, TP pieces placed by the ``megatron-gpt`` layout built from the
saved arguments (`model_config`), or by the layout given. RNG states go to
``rng/<mp_rank dir>/<i>/<field>`` (tensors as uint8 tensors, the rest as values); each rank
file's other entries to ``megatron/<key>`` (the first rank file's; a rank whose copy differs
keeps its own under ``megatron/<mp_rank dir>/<key>``; the arguments compared without ``rank``
and ``local_rank``). Non-finite numbers in values are written as the strings ``inf``, ``-inf``, ``nan``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np
from pydantic import JsonValue

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout, builtin
from ckptkit.manifest import CheckpointInfo
from ckptkit.manifest.dtypes import itemsize
from ckptkit.manifest.model import ModelInfo, OptimizerInfo, ParamGroup
from ckptkit.ops.convert import ConvertReport, Progress, SkippedEntry, TensorSpec, refuse_skips, report_of, write_converted
from ckptkit.state.tree import escape, json_problems
from ckptkit_adapters.common.floats import cast_float32
from ckptkit_adapters.common.safepickle import Record
from ckptkit_adapters.common.torchsave import StoredTensor
from ckptkit_adapters.megatron.legacy_files import (
    MODEL_FILE,
    OPTIM_FILE,
    RankDir,
    RankFile,
    open_file,
    parse,
    rank_dirs,
    read_local,
)
from ckptkit_adapters.megatron.legacy_optim import Local, bucket_size, buffer_ranges, plain_ids
from ckptkit_adapters.megatron.legacy_plan import (
    Piece,
    Planned,
    box_of,
    coverage_problems,
    distributed_state,
    global_key,
    layout_index,
    local_params,
    place_model,
    place_state,
    stage_offsets,
    whole,
)
from ckptkit_adapters.megatron.legacy_values import as_json, refuse_unsupported
from ckptkit_adapters.megatron.reader import NAME, megatron_source, model_config

KNOWN = {"model", "optimizer", "rng_state"}
PER_RANK_ARGS = ("rank", "local_rank")


class _Conversion:
    """The state of one conversion while its rank files are planned."""

    def __init__(self, path: str, dirs: list[RankDir], files: list[RankFile], args: dict[str, Any], layout: Layout) -> None:
        self.path, self.dirs, self.files, self.args = path, dirs, files, args
        self.tp = 1 + max(d.tp for d in dirs)
        self.index = layout_index(layout)
        self.offsets = stage_offsets(files, dirs, layout.num_layers)
        self.planned = Planned()
        self.skipped: list[tuple[str, str]] = []
        self.objects: dict[str, JsonValue] = {}
        self.object_sources: dict[str, str] = {}
        self.first: dict[str, Any] = {}  # entry -> the first rank file's JSON of it
        self.steps: set[float] = set()

    def value(self, name: str, value: Any, source: str) -> None:
        """Record a value as an object, or as skipped if it is not JSON."""
        converted = as_json(value)
        problems = json_problems({name: converted})
        if problems:
            self.skipped.append((source, f"not a JSON value ({problems[0]})"))
            return
        self.objects[name], self.object_sources[name] = converted, source

    def shared(self, key: str, value: Any, d: RankDir, file: str, name: str) -> None:
        """An entry every rank saves: the first rank file's, or this rank's where it differs."""
        converted = as_json(value)
        compared = {k: v for k, v in converted.items() if k not in PER_RANK_ARGS} if key == "args" and isinstance(converted, dict) else converted
        if key not in self.first:
            self.first[key] = compared
            self.value(name, value, f"{d.name}/{file}:{key}")
        elif compared != self.first[key]:
            self.value(f"megatron/{escape(d.name)}/{name.removeprefix('megatron/')}", value, f"{d.name}/{file}:{key}")

    def stage(self, i: int, d: RankDir, f: RankFile) -> None:
        """Plan one rank file: model, optimizer, RNG, other entries."""
        tree = f.tree
        model = tree.get("model")
        if not isinstance(model, dict):
            raise IntegrityError(f"{f.path}: no model state dict")
        keys = place_model(self.planned, model, i, d, self.tp, self.offsets[d.pp], self.index, self.skipped)
        for key, value in model.items():
            if not isinstance(value, StoredTensor):
                gkey = global_key(str(key), self.offsets[d.pp], self.index)
                self.shared(f"model/{gkey}", value, d, MODEL_FILE, f"model/{escape(gkey)}")
        self.optimizer(i, d, f, keys)
        self.rng(i, d, tree.get("rng_state"))
        for name in sorted(set(os.listdir(d.path)) - {MODEL_FILE, OPTIM_FILE}):
            self.skipped.append((f"{d.name}/{name}", "a file this converter does not read"))
        for key, value in tree.items():
            if key not in KNOWN:
                self.shared(str(key), value, d, MODEL_FILE, f"megatron/{escape(str(key))}")

    def optimizer(self, i: int, d: RankDir, f: RankFile, keys: dict[str, str]) -> None:
        opt = f.tree.get("optimizer")
        optim_path = os.path.join(d.path, OPTIM_FILE)
        if opt is None:
            return
        if not isinstance(opt, dict):
            raise ManifestError(f"{f.path}: an optimizer state of several optimizers (a list), which this converter does not read")
        params = local_params(f.tree["model"])
        where = f"{d.name}/{MODEL_FILE}"
        if "state" in opt:  # FP32Optimizer: a torch optimizer's state dict
            self._plain(i, d, opt, params, keys, where)
            rest = {k: v for k, v in opt.items() if k != "state"}
        elif "fp32_from_fp16_params" in opt and isinstance(opt.get("optimizer"), dict) and "state" in opt["optimizer"]:
            ids = self._plain(i, d, opt["optimizer"], params, keys, where)
            self._masters(i, d, opt["optimizer"]["param_groups"], opt["fp32_from_fp16_params"], ids, keys, where)
            rest = {**{k: v for k, v in opt.items() if k not in ("optimizer", "fp32_from_fp16_params")},
                    "optimizer": {k: v for k, v in opt["optimizer"].items() if k != "state"}}
        elif self.args.get("use_distributed_optimizer") and isinstance(opt.get("optimizer"), dict):
            if not os.path.isfile(optim_path):
                raise IntegrityError(f"{optim_path}: missing (the distributed optimizer's state)")
            self._distributed(i, d, params, keys)
            rest = opt
        else:
            raise ManifestError(f"{f.path}: an optimizer state of a form this converter does not read ({', '.join(map(str, opt))})")
        for key, value in rest.items():
            self.value(f"megatron/{escape(d.name)}/optimizer/{escape(str(key))}", value, f"{where}:optimizer/{key}")

    def _plain(self, i: int, d: RankDir, opt: dict[str, Any], params: list[Any], keys: dict[str, str],
               where: str) -> dict[int, Local]:
        """Plan a torch optimizer state dict's tensors by parameter; return the id -> parameter map."""
        ids = plain_ids(params, opt.get("param_groups"), self.args, where)
        state = opt["state"]
        if not isinstance(state, dict) or set(state) - set(ids):
            raise IntegrityError(f"{where}: optimizer state for ids no parameter group holds")
        for pid, entry in state.items():
            local = ids[pid]
            for name, stored in (entry.items() if isinstance(entry, dict) else ()):
                source = f"{where}:optimizer/state/{pid}/{name}"
                if name == "step" and isinstance(stored, StoredTensor) and stored.shape == ():
                    self.steps.add(_scalar(self.files[i], stored))
                elif isinstance(stored, StoredTensor) and stored.shape == local.shape:
                    place_state(self.planned, str(name), local, stored, i, d, self.tp, keys[local.key], self.index, source)
                else:
                    raise IntegrityError(f"{source}: not a tensor of {local.key}'s shape {list(local.shape)} (the optimizer's "
                                         f"ids, assigned by Megatron's parameter groups, do not fit this file)")
        return ids

    def _masters(self, i: int, d: RankDir, groups: list[Any], masters: Any, ids: dict[int, Local], keys: dict[str, str],
                 where: str) -> None:
        """Plan the fp16/bf16 optimizer's fp32 copies: per group, one for each of its fp16/bf16
        parameters in the group's order (each checked against the model's tensor)."""
        if not isinstance(masters, list) or len(masters) != len(groups):
            raise IntegrityError(f"{where}: fp32_from_fp16_params is not a list per parameter group")
        model = self.files[i].tree["model"]
        for g, (group, copies) in enumerate(zip(groups, masters)):
            halves = [ids[pid] for pid in group["params"] if ids[pid].dtype in ("bfloat16", "float16")]
            if not isinstance(copies, list) or len(copies) != len(halves):
                raise IntegrityError(f"{where}: fp32_from_fp16_params[{g}] holds {len(copies) if isinstance(copies, list) else 0} "
                                     f"copies, its group {len(halves)} fp16/bf16 parameters")
            for n, (local, stored) in enumerate(zip(halves, copies)):
                if not isinstance(stored, StoredTensor) or stored.shape != local.shape or stored.dtype != "float32":
                    raise IntegrityError(f"{where}: fp32_from_fp16_params[{g}][{n}] is not a float32 copy of {local.key}")
                place_state(self.planned, "param", local, stored, i, d, self.tp, keys[local.key], self.index,
                            f"{where}:optimizer/fp32_from_fp16_params/{g}/{n}", check=(i, model[local.key]))

    def _distributed(self, i: int, d: RankDir, params: list[Any], keys: dict[str, str]) -> None:
        a = self.args
        where = f"{d.name}/{OPTIM_FILE}"
        if int(a.get("context_parallel_size") or 1) != 1 or int(a.get("num_distributed_optimizer_instances") or 1) != 1:
            raise ManifestError(f"{where}: the distributed optimizer over context-parallel ranks or several instances, "
                                f"which this converter does not lay out")
        buffers = buffer_ranges(params, grad_fp32=bool(a.get("accumulate_allreduce_grads_in_fp32")),
                                size=bucket_size(a, d.pp, where))
        optim = parse(os.path.join(d.path, OPTIM_FILE))
        self.files.append(optim)
        file = len(self.files) - 1
        by_key = {p.key: p for p in params}
        for buf, tensors in zip(buffers, distributed_state(optim.tree, buffers, where)):
            for key, (start, numel) in buf.ranges.items():
                local, model_stored = by_key[key], self.files[i].tree["model"][key]
                for state, stored in tensors.items():
                    check = (i, model_stored) if state == "param" else None
                    place_state(self.planned, state, local, stored, file, d, self.tp, keys[key], self.index,
                                f"{where}:{state}[{start}:{start + numel}]", (start, local.shape), check)

    def rng(self, i: int, d: RankDir, states: Any) -> None:
        if states is None:
            return
        where = f"{d.name}/{MODEL_FILE}:rng_state"
        if not isinstance(states, list) or not all(isinstance(s, dict) for s in states):
            self.skipped.append((where, "not a list of RNG states"))
            return
        for n, entry in enumerate(states):
            for key, value in entry.items():
                name = f"rng/{escape(d.name)}/{n}/{escape(str(key))}"
                tensors = value if isinstance(value, dict) and value and all(isinstance(v, StoredTensor) for v in value.values()) else None
                if isinstance(value, StoredTensor):
                    self.planned.add(name, "rng", f"{where}/{n}/{key}", Piece(i, value, whole(name, value.shape)))
                elif tensors is not None:
                    for k, v in tensors.items():
                        fqn = f"{name}/{escape(str(k))}"
                        self.planned.add(fqn, "rng", f"{where}/{n}/{key}/{k}", Piece(i, v, whole(fqn, v.shape)))
                else:
                    self.value(name, value, f"{where}/{n}/{key}")


def _scalar(f: RankFile, stored: StoredTensor) -> float:
    """The value of a 0-dim tensor (an optimizer's step)."""
    if stored.dtype not in ("float32", "float64", "int64", "int32"):
        raise IntegrityError(f"{f.path}: an optimizer step of dtype {stored.dtype}")
    with open_file(f) as archive:
        raw = read_local(archive, stored)
    return float(np.frombuffer(raw.tobytes(), dtype=np.dtype(stored.dtype).newbyteorder("<"))[0])


def _args(f: RankFile) -> dict[str, Any]:
    tree = f.tree
    if not isinstance(tree, dict):
        raise IntegrityError(f"{f.path}: not a dict of the rank's state")
    args = tree.get("args")
    if not isinstance(args, Record) or not isinstance(args.state, dict):
        raise ManifestError(f"{f.path}: no Megatron-LM arguments (args), which give the model's shape and parallelism")
    found: dict[str, Any] = as_json(args)
    return found


def _layout(args: dict[str, Any], given: Layout | None, path: str) -> tuple[Layout, dict[str, JsonValue] | None]:
    if given is not None:
        return given, None
    config = model_config(args)
    if config is None:
        raise ManifestError(f"{path}: the arguments describe a model the built-in megatron-gpt layout does not (biases, "
                            f"learned positions); give its layout with --layout FILE")
    return builtin("megatron-gpt", config), config


def convert_legacy(path: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                   layout: Layout | None = None, started: float | None = None) -> ConvertReport:
    """Convert the legacy Megatron-LM iteration directory `path` into the ckptkit checkpoint `dst`.

    Raises:
        ManifestError: a class outside the allowlist (named); a form this converter does not
            read (named: virtual pipeline stages, experts, the plain fp16/bf16 optimizer...);
            entries that cannot be converted, without `allow_skip`.
        IntegrityError: rank files missing, truncated or not fitting Megatron's layout rules.
        CheckpointExistsError, StorageError: as `ckptkit.ops.convert.write_converted`.
    """
    started = time.perf_counter() if started is None else started
    dirs = rank_dirs(path)
    files = [parse(os.path.join(d.path, MODEL_FILE)) for d in dirs]
    args = _args(files[0])
    refuse_unsupported(args, files[0].tree, path, tp=1 + max(d.tp for d in dirs), pp=1 + max(d.pp for d in dirs))
    layout, config = _layout(args, layout, path)
    conv = _Conversion(path, dirs, files, args, layout)
    for i, (d, f) in enumerate(zip(dirs, list(files))):
        conv.stage(i, d, f)
        if i:
            f.tree.clear()  # planned: its pieces keep what they read; the first file's values give the info
    broken = coverage_problems(conv.planned)
    if broken:
        raise IntegrityError(f"{path}: the rank files do not hold the whole of {len(broken)} tensor(s): {', '.join(broken[:10])}")
    skipped = [SkippedEntry(name=s, reason=r) for s, r in conv.skipped]
    refuse_skips(skipped, allow_skip=allow_skip, where=path)
    specs = [TensorSpec(name, conv.planned.sources[name], pieces[0].stored.dtype, pieces[0].part.global_shape,
                        conv.planned.kinds[name]) for name, pieces in conv.planned.pieces.items()]
    info, step = _info(args, files[0].tree, conv.steps, config)

    def read(spec: TensorSpec) -> memoryview:
        return _assemble(spec, conv.planned.pieces[spec.name], conv.files)

    committed = write_converted(dst, specs, read, objects=conv.objects, step=lambda: step, info=info, layout=layout,
                                progress=progress, source=megatron_source(path, args, None))
    return report_of(NAME, path, committed, [(s, len(conv.planned.pieces[s.name])) for s in specs], conv.object_sources,
                     skipped, started)


def _assemble(spec: TensorSpec, pieces: list[Piece], files: list[RankFile]) -> memoryview:
    """A global tensor's bytes from its pieces, each file opened once."""
    width = itemsize(spec.dtype)
    out = np.empty((*spec.shape, width), dtype=np.uint8)
    for file in sorted({p.file for p in pieces}):
        with open_file(files[file]) as archive:
            for p in (p for p in pieces if p.file == file):
                local = read_local(archive, p.stored, p.flat)
                if p.check is not None:
                    _check_master(local, p, files, spec.name)
                out[(*box_of(p.part).slices(), slice(None))] = local[(*p.part.local_box().slices(), slice(None))]
    return out.reshape(-1).data


def _check_master(master: np.ndarray[Any, Any], p: Piece, files: list[RankFile], name: str) -> None:
    """Refuse a master (fp32) that does not round to the model's tensor: its range in the
    flat buffer, derived from Megatron's bucketing, would then be wrong."""
    assert p.check is not None
    file, stored = p.check
    with open_file(files[file]) as archive:
        model = read_local(archive, stored)
    if stored.dtype not in ("float32", "bfloat16", "float16"):
        raise IntegrityError(f"{name}: a master for a {stored.dtype} parameter")
    rounded = cast_float32(master.view(np.float32).reshape(-1), stored.dtype).view(np.uint8)
    if not np.array_equal(rounded.reshape(-1), model.reshape(-1)):
        raise IntegrityError(f"{files[p.file].path}: the master of {name} does not round to the model's tensor: the parameter "
                             f"ranges derived from Megatron's bucketing do not fit this file")


def _info(args: dict[str, Any], tree: dict[str, Any], steps: set[float],
          config: dict[str, JsonValue] | None) -> tuple[CheckpointInfo, int]:
    fields: dict[str, Any] = {}
    if not json_problems({"args": args}):
        fields["config"] = {"args": args}
    scheduler = as_json(tree.get("opt_param_scheduler"))
    if isinstance(scheduler, dict) and not json_problems({"s": scheduler}):
        fields["scheduler"] = scheduler
    opt = tree.get("optimizer")
    groups = (opt.get("param_groups") or (opt.get("optimizer") or {}).get("param_groups")) if isinstance(opt, dict) else None
    optim_step = next(iter(steps)) if len(steps) == 1 else None
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        options = [{k: v for k, v in as_json(g).items() if k != "params"} for g in groups]
        group_steps = {g.get("step") for g in options}
        if optim_step is None and len(group_steps) == 1 and isinstance(next(iter(group_steps)), (int, float)):
            optim_step = float(next(iter(group_steps)))  # type: ignore[arg-type]
        if not json_problems({"g": options}):
            fields["optimizer"] = OptimizerInfo(
                type="megatron", param_groups=tuple(ParamGroup(params=(), options=o) for o in options),
                step=int(optim_step) if optim_step is not None and math.isfinite(optim_step) and optim_step.is_integer() else None)
    if config is not None:
        fields["model"] = ModelInfo(family="megatron-gpt", config=config)
    iteration = tree.get("iteration")
    if not isinstance(iteration, int) or iteration < 0:
        raise IntegrityError("the rank file holds no iteration")
    return CheckpointInfo(**fields), iteration


__all__ = ["convert_legacy"]
