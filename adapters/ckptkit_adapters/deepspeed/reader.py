"""Convert a DeepSpeed ``engine.save_checkpoint`` directory into a ckptkit checkpoint.

The source is a save directory whose ``latest`` file names the tag directory, or a tag
directory itself (``global_step3/``). Its files are ``torch.save`` archives, read without torch
and without running any code of DeepSpeed's (`ALLOWED`: the tensor classes of `torchsave`,
``torch.Size``, and stand-ins for DeepSpeed's ``LossScaler``, ``DynamicLossScaler``,
``ZeroStageEnum`` and ``fragment_address``). Each pickle is read once (a few KiB: the tensors'
bytes stay in the files); each tensor is then assembled from its byte ranges when its turn
comes, so memory stays about one tensor.

- ``mp_rank_00_model_states.pt`` (stages 0-2) or ``zero_pp_rank_<d>_mp_rank_00_model_states.pt``
  (stage 3, one per data-parallel rank): the module's state dict (``module``), the parameter
  names and shapes of each optimizer group (``param_shapes``), the scheduler, counters, config
  and the client state (every key DeepSpeed does not define).
- ``[bf16_]zero_pp_rank_<d>_mp_rank_00_optim_states.pt`` (stages 1-3, one per rank): each
  rank's flat partition of every group's fp32 master weights and optimizer state.

Stages 1 and 2 cut each group's flat buffer (the group's parameters in ``param_shapes`` order,
each followed by its ``param_alignment_paddings``) into equal partitions, rank after rank; a
rank's saved fp32 partition leaves out its padding (``group_paddings``). Stage 3 cuts every
parameter into ``ceil(numel / dp)`` elements per rank (the last padded), and a rank's flat
buffer holds its piece of each parameter in order. Padding is never read.

Names (``<name>`` is DeepSpeed's, e.g. ``blocks.0.fc1.weight``):

- ``model/<name>``: each entry of the module's state dict as saved (parameters and buffers).
  ZeRO-3 saves no 16-bit parameters (its module file holds empty placeholders): each is the
  fp32 master cast to the placeholder's dtype (round to nearest even), the value DeepSpeed
  copies into the module after every step.
- ``optimizer/fp32/<name>``, ``optimizer/<state>/<name>`` (``exp_avg``, ``exp_avg_sq``, any
  other per-element state) for stages 1-3. Each group's scalar ``step`` and the rest of the
  optimizer files' values are kept as JSON under ``deepspeed/optimizer/`` (one value when
  every rank saved the same, else a list by rank).
- Stage 0 saves the optimizer's own state dict, which names parameters by index only: its
  tensors keep those names (``optimizer/state/<i>/exp_avg``, ``optimizer/fp32_groups/<g>/<j>``).
- ``client/<key>``: the client state (tensors as tensors, JSON values as objects);
  ``deepspeed/<key>``: DeepSpeed's other values (counters, ``param_shapes``, ``buffer_names``...).
- ``info``: the scheduler (``lr_scheduler``), the loss scaler, ``ds_config`` (as
  ``info.config.ds_config``), the optimizer's groups and step, ``global_samples`` as consumed
  samples; the manifest's step is ``global_steps``. A layout is recorded (every parameter
  replicated over TP, one pipeline stage, ZeRO flattening by stage) so that the result
  reshards to another data-parallel size and ZeRO stage without ``--layout``.

Model parallelism (``mp_rank_XX`` files of several ranks, as Megatron-DeepSpeed saves): each
rank is planned as above, its tensors TP-local; DeepSpeed records no split dimension per
parameter, so the model's layout (given) joins them (`tp`). The result records that
layout. Values (counters, client state, ``deepspeed/...``) are model-parallel rank 0's.

Refused (one line, nothing written): a pipeline-parallel save (``layer_*`` files), several
model-parallel ranks without a layout or not fitting it, missing rank files, partitions that do
not add up, a class outside `ALLOWED`. Skipped with a reason (fails without
``allow_skip``): values that are neither tensors nor JSON.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
from pydantic import JsonValue

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout
from ckptkit.layouts.model import Constraint, Param, StateGroup, TensorPart, Unit, Zero
from ckptkit.manifest import CheckpointInfo, Topology
from ckptkit.manifest.dtypes import itemsize
from ckptkit.manifest.model import DataProgress, OptimizerInfo, ParamGroup
from ckptkit.ops.convert import (
    ConvertReport,
    Progress,
    SkippedEntry,
    TensorSpec,
    refuse_skips,
    report_of,
    source_info,
    write_converted,
)
from ckptkit.state.tree import escape, json_problems
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.files import read_small
from ckptkit_adapters.common.floats import cast_float32
from ckptkit_adapters.common.safepickle import Record, record_type
from ckptkit_adapters.common.torchsave import (
    STATE_DICT_ALLOWED,
    Archive,
    StoredTensor,
    copy_flat,
    copy_tensor,
    open_archive,
    plain,
    stored_object,
)
from ckptkit_adapters.deepspeed.tp import Joined, join_model_parallel

NAME = "deepspeed"
LATEST = "latest"
MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
Z3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
PIPELINE_FILE = re.compile(r"^layer_\d+-model_.*states\.pt$")
# Keys DeepSpeed writes into the model-states file; every other key is the client state.
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version",
})
FP32_KEYS = ("single_partition_of_fp32_groups", "fp32_flat_groups")  # stages 1-2, stage 3


_TENSOR_TYPE = object()  # torch.Tensor, as _rebuild_from_type_v2 names it


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """A tensor pickled with attributes (ZeRO-3 tags its flat groups with ``ds_id``): the
    tensor itself; the attributes say nothing about its values."""
    if new_type is not _TENSOR_TYPE or not isinstance(args, tuple):
        raise ValueError("a tensor subclass")
    return func(*args)


ALLOWED: dict[tuple[str, str], Any] = {
    **STATE_DICT_ALLOWED,
    ("torch", "Size"): tuple,
    ("torch", "Tensor"): _TENSOR_TYPE,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): int,
    **{("deepspeed.runtime.fp16.loss_scaler", n): record_type(f"deepspeed.runtime.fp16.loss_scaler.{n}")
       for n in ("LossScaler", "DynamicLossScaler")},
    ("deepspeed.utils.tensor_fragment", "fragment_address"): record_type("deepspeed.utils.tensor_fragment.fragment_address"),
}


def _has_tensor(value: Any) -> bool:
    if isinstance(value, StoredTensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, start + count) of a flat stored tensor in file `path`."""

    path: str
    tensor: StoredTensor
    start: int
    count: int


@dataclass(frozen=True, slots=True)
class Recipe:
    """How to assemble one tensor: a whole stored tensor, or flat pieces in order (cast from
    `source_dtype` to the spec's dtype when they differ)."""

    whole: tuple[str, StoredTensor] | None
    pieces: tuple[Piece, ...] = ()
    source_dtype: str = ""


@dataclass
class _Plan:
    tensors: list[tuple[TensorSpec, Recipe]] = field(default_factory=list)
    objects: dict[str, JsonValue] = field(default_factory=dict)
    object_sources: dict[str, str] = field(default_factory=dict)
    skipped: list[SkippedEntry] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    layout: Layout | None = None
    version: object = None  # the DeepSpeed version that saved it (ds_version)
    topology: Topology | None = None  # the sizes it was saved at

    def tensor(self, name: str, source: str, kind: str, shape: tuple[int, ...], dtype: str, recipe: Recipe) -> None:
        self.tensors.append((TensorSpec(name=name, source=source, dtype=dtype, shape=shape, kind=kind), recipe))

    def value(self, name: str, source: str, value: Any) -> None:
        """Keep a non-tensor value as JSON, or list it as skipped."""
        converted = plain(value)
        problems = json_problems({name: converted})
        if problems:
            self.skipped.append(SkippedEntry(name=source, reason=f"not a tensor or a JSON value ({problems[0]})"))
            return
        self.objects[name] = converted
        self.object_sources[name] = source

    def walk(self, value: Any, name: str, source: str, path: str, kind: str) -> None:
        """Convert `value`: tensors as tensors (named by their keys), the rest as JSON objects."""
        if isinstance(value, StoredTensor):
            self.tensor(name, source, kind, value.shape, value.dtype, Recipe(whole=(path, value)))
        elif isinstance(value, dict) and _has_tensor(value):
            for k, v in value.items():
                self.walk(v, f"{name}/{escape(str(k))}", f"{source}.{k}", path, kind)
        elif isinstance(value, (list, tuple)) and _has_tensor(value):
            for i, v in enumerate(value):
                self.walk(v, f"{name}/{i}", f"{source}.{i}", path, kind)
        else:
            self.value(name, source, value)


class _Files:
    """The source's archives, each one's zip directory read once; at most `MAX_OPEN` files are
    open at a time (a save over thousands of ranks has more files than a process may open), the
    least recently used closed first and reopened when needed. Use an `Archive` from `archive`
    at once: its file descriptor is closed when it is evicted."""

    MAX_OPEN = 128

    def __init__(self) -> None:
        self.known: dict[str, Archive] = {}
        self.open: OrderedDict[str, int] = OrderedDict()

    def archive(self, path: str) -> Archive:
        if path in self.open:
            self.open.move_to_end(path)
            return self.known[path]
        if len(self.open) >= self.MAX_OPEN:
            _, fd = self.open.popitem(last=False)
            os.close(fd)
        fd, size = open_regular(path)
        try:
            known = self.known.get(path)
            if known is None:
                known = open_archive(fd, 0, size, path)
            elif size != known.start + known.length:
                raise IntegrityError(f"{path}: {size} bytes now, {known.length} when it was first read (changed meanwhile?)")
            self.known[path] = replace(known, fd=fd)
        except BaseException:
            os.close(fd)
            raise
        self.open[path] = fd
        return self.known[path]

    def load(self, path: str) -> Any:
        return stored_object(self.archive(path), ALLOWED)

    def close(self) -> None:
        for fd in self.open.values():
            os.close(fd)
        self.open.clear()


def tag_directory(src: str) -> str:
    """The tag directory of save directory `src` (named by its ``latest``), or `src` itself
    when it holds the model-states files.

    Raises:
        IntegrityError: neither (or ``latest`` names a directory that is not there).
    """
    if _has_model_files(src):
        return src
    latest = os.path.join(src, LATEST)
    if not os.path.isfile(latest):
        raise IntegrityError(f"{src}: no DeepSpeed model-states files and no {LATEST} file naming a tag directory")
    tag = read_small(latest, 4096, f"DeepSpeed's {LATEST} file").decode("utf-8", "replace").strip()
    if not tag or "/" in tag or tag in (".", ".."):
        raise IntegrityError(f"{latest}: names no tag directory ({tag!r})")
    path = os.path.join(src, tag)
    if not os.path.isdir(path):
        raise IntegrityError(f"{latest}: names the tag {tag!r}, but {path} is not there")
    return path


def _has_model_files(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(MODEL_FILE.match(n) or Z3_MODEL_FILE.match(n) or PIPELINE_FILE.match(n) for n in names)


@dataclass(frozen=True)
class _Layout:
    """The files of a tag directory, by rank."""

    model: dict[int, str]  # mp rank -> mp_rank_XX_model_states.pt
    z3_model: dict[tuple[int, int], str]  # (dp, mp) -> zero_pp_rank_D_mp_rank_XX_model_states.pt
    optim: dict[tuple[int, int], str]  # (dp, mp) -> [bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt
    pipeline: bool


def _files_of(tag_dir: str) -> _Layout:
    model: dict[int, str] = {}
    z3: dict[tuple[int, int], str] = {}
    optim: dict[tuple[int, int], str] = {}
    pipeline = False
    for n in sorted(os.listdir(tag_dir)):
        path = os.path.join(tag_dir, n)
        if m := MODEL_FILE.match(n):
            model[int(m.group(1))] = path
        elif m := Z3_MODEL_FILE.match(n):
            z3[(int(m.group(1)), int(m.group(2)))] = path
        elif m := OPTIM_FILE.match(n):
            if (int(m.group(1)), int(m.group(2))) in optim:
                raise IntegrityError(f"{tag_dir}: two optimizer files for data-parallel rank {m.group(1)}")
            optim[(int(m.group(1)), int(m.group(2)))] = path
        elif PIPELINE_FILE.match(n):
            pipeline = True
    return _Layout(model, z3, optim, pipeline)


class DeepSpeedConverter:
    """The ``deepspeed`` converter (registered in the ``ckptkit.converters`` entry-point group)."""

    name = NAME
    description = "DeepSpeed engine.save_checkpoint directory (ZeRO stages 0-3; its latest tag, or a tag directory)"

    def detect(self, path: str) -> bool:
        """Whether `path` is a DeepSpeed save directory (a ``latest`` naming a tag directory
        with model-states files) or a tag directory."""
        try:
            return _has_model_files(path) or _has_model_files(tag_directory(path))
        except (IntegrityError, ManifestError, OSError):
            return False

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None) -> ConvertReport:
        """Convert the DeepSpeed checkpoint `src` into the committed ckptkit checkpoint `dst`
        (recording `layout` if given, else the ``deepspeed`` one).

        Raises:
            ManifestError: a pickle needs a class outside `ALLOWED` (named); entries that
                cannot be converted, without `allow_skip`; a save this converter does not read
                (pipeline or model parallel).
            IntegrityError: no DeepSpeed files, a rank's file missing or truncated,
                partitions that do not add up to the parameters.
            CheckpointExistsError, StorageError: as `ckptkit.ops.convert.write_converted`.
        """
        started = time.perf_counter()
        if not os.path.isdir(src):
            raise IntegrityError(f"{src}: no such directory")
        files = _Files()
        try:
            tag_dir = tag_directory(src)
            ranks = model_parallel_ranks(tag_dir)
            plans = [plan_conversion(tag_dir, files, mp) for mp in ranks]
            plan = plans[0]
            skipped = list({s.name: s for p in plans for s in p.skipped}.values())
            refuse_skips(skipped, allow_skip=allow_skip, where=src)
            tensors = _tensors(plans, files, layout, src)
            readers = {spec.name: read for spec, read, _ in tensors}
            committed = write_converted(
                dst, [spec for spec, _, _ in tensors], lambda spec: readers[spec.name](),
                objects=plan.objects, step=lambda: plan.step, info=CheckpointInfo(**plan.info), layout=layout or plan.layout,
                progress=progress, source=source_info(NAME, tag_dir, version=plan.version, topology=plan.topology))
        finally:
            files.close()
        return report_of(NAME, src, committed, [(spec, n) for spec, _, n in tensors], plan.object_sources, skipped, started)


def _tensors(plans: list[_Plan], files: _Files, layout: Layout | None, src: str) -> list[Joined]:
    """Every tensor to write, with its reader: one model-parallel rank's as planned; several
    ranks' joined through `layout` (`tp`).

    Raises:
        ManifestError: several model-parallel ranks and no layout, or tensors that do not fit it.
    """
    if len(plans) == 1:
        return [(spec, partial(assemble, files, spec, recipe), 1 if recipe.whole else len(recipe.pieces))
                for spec, recipe in plans[0].tensors]
    if layout is None:
        raise ManifestError(f"{src}: {len(plans)} model-parallel ranks, and DeepSpeed records no split dimension per "
                            f"parameter; give the model's layout (--layout FILE), which says how TP cuts each")
    recipes = [{spec.name: recipe for spec, recipe in p.tensors} for p in plans]
    try:
        return join_model_parallel([[(spec, 1 if recipe.whole else len(recipe.pieces)) for spec, recipe in p.tensors] for p in plans], layout,
                                   lambda r, spec: assemble(files, spec, recipes[r][spec.name]))
    except ManifestError as exc:
        raise ManifestError(f"{src}: {exc}") from None


def model_parallel_ranks(tag_dir: str) -> list[int]:
    """The model-parallel ranks whose files the tag directory holds, in order.

    Raises:
        ManifestError: a pipeline-parallel save (``layer_*`` files).
        IntegrityError: ranks missing from 0 to the highest one.
    """
    found = _files_of(tag_dir)
    if found.pipeline:
        raise ManifestError(f"{tag_dir}: a pipeline-parallel DeepSpeed save (layer_* files), which this converter does not read")
    ranks = sorted(set(found.model) | {mp for _, mp in found.z3_model} | {mp for _, mp in found.optim}) or [0]
    if ranks != list(range(len(ranks))):
        missing = sorted(set(range(ranks[-1] + 1)) - set(ranks))
        raise IntegrityError(f"{tag_dir}: no files of model-parallel rank(s) {missing} (mp_rank_XX)")
    return ranks


def plan_conversion(tag_dir: str, files: _Files, mp: int = 0) -> _Plan:
    """Read the pickles of model-parallel rank `mp` and plan each of its tensors (pure but for
    those reads): with model parallelism, the rank's own (TP-local) tensors.

    Raises:
        IntegrityError, ManifestError: as `DeepSpeedConverter.convert`.
    """
    found = _files_of(tag_dir)
    if found.pipeline:
        raise ManifestError(f"{tag_dir}: a pipeline-parallel DeepSpeed save (layer_* files), which this converter does not read")
    if mp in found.model:
        model_path = found.model[mp]
    elif (0, mp) in found.z3_model:
        model_path = found.z3_model[(0, mp)]
    else:
        raise IntegrityError(f"{tag_dir}: no model-states file of model-parallel rank {mp} (mp_rank_{mp:02d}_model_states.pt)")
    model = files.load(model_path)
    if not isinstance(model, dict) or not isinstance(model.get("module"), dict):
        raise IntegrityError(f"{model_path}: not a DeepSpeed model-states file (no module state dict)")
    plan = _Plan()
    optim = _optimizer_files(tag_dir, found, files, mp)
    stage = _stage(optim)
    if stage == 3:
        missing = [d for d in range(len(optim)) if (d, mp) not in found.z3_model]
        if missing:
            raise IntegrityError(f"{tag_dir}: no model-states file of data-parallel rank(s) {missing} (a ZeRO-3 save has one per rank)")
    shapes = _param_shapes(model, model_path) if stage else []
    rank_models = [(found.z3_model[(d, mp)], model if d == 0 else files.load(found.z3_model[(d, mp)]))
                   for d in range(len(optim))] if stage == 3 else []
    _plan_module(plan, model, model_path, shapes, stage, optim, _z3_frozen(model, rank_models) if stage == 3 else {})
    if stage:
        _plan_partitions(plan, files, shapes, stage, optim)
    elif model.get("optimizer") is not None:
        plan.walk(model["optimizer"], "optimizer", "optimizer", model_path, "optimizer")
    _plan_values(plan, model, model_path, shapes, stage)
    return plan


def _optimizer_files(tag_dir: str, found: _Layout, files: _Files, mp: int) -> list[tuple[str, dict[str, Any]]]:
    """Each data-parallel rank's optimizer file (of model-parallel rank `mp`) and its
    ``optimizer_state_dict``, in rank order."""
    ranks = sorted(d for d, m in found.optim if m == mp)
    out = []
    for d in ranks:
        path = found.optim[(d, mp)]
        tree = files.load(path)
        osd = tree.get("optimizer_state_dict") if isinstance(tree, dict) else None
        if not isinstance(osd, dict):
            raise IntegrityError(f"{path}: not a DeepSpeed optimizer-states file (no optimizer_state_dict)")
        out.append((path, osd))
    if out:
        counts = out[0][1].get("partition_count")
        world = max(counts) if isinstance(counts, list) and counts else counts
        if not isinstance(world, int) or world < 1:
            raise IntegrityError(f"{out[0][0]}: no partition_count")
        if ranks != list(range(world)):
            missing = sorted(set(range(world)) - set(ranks))
            raise IntegrityError(f"{tag_dir}: the save was partitioned over {world} data-parallel ranks, but the optimizer "
                                 f"file(s) of rank(s) {missing or ranks[world:]} are " + ("missing" if missing else "extra"))
    return out


def _stage(optim: list[tuple[str, dict[str, Any]]]) -> int:
    """The ZeRO stage the optimizer files name (0 when there are none)."""
    if not optim:
        return 0
    stages = {osd.get("zero_stage") for _, osd in optim}
    stage = next(iter(stages))
    if len(stages) != 1 or not isinstance(stage, int) or stage not in (1, 2, 3):
        raise IntegrityError(f"{optim[0][0]}: the optimizer files disagree on the ZeRO stage or name none ({sorted(map(str, stages))})")
    return stage


def _param_shapes(model: dict[str, Any], path: str) -> list[dict[str, tuple[int, ...]]]:
    shapes = model.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise IntegrityError(f"{path}: no param_shapes (the parameters of each optimizer group)")
    out = []
    for g in shapes:
        group = {}
        for name, shape in g.items():
            if not isinstance(name, str) or not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise IntegrityError(f"{path}: param_shapes has a malformed entry {name!r}")
            group[name] = shape
        out.append(group)
    return out


def _plan_module(plan: _Plan, model: dict[str, Any], path: str, shapes: list[dict[str, tuple[int, ...]]], stage: int,
                 optim: list[tuple[str, dict[str, Any]]], frozen: dict[str, tuple[Piece, ...]]) -> None:
    """Every entry of the module's state dict; under ZeRO-3 each trainable parameter from its
    fp32 master and each frozen one from its per-rank fragments (`frozen`)."""
    params = {n: s for g in shapes for n, s in g.items()}
    places = _z3_places(shapes, len(optim)) if stage == 3 else {}
    frozen_shapes = model.get("frozen_param_shapes") or {}
    buffers = set(model.get("buffer_names") or ())
    for key, value in model["module"].items():
        name = f"model/{escape(str(key))}"
        kind = "buffer" if key in buffers else "param"
        if stage == 3 and (key in params or key in frozen):
            if not isinstance(value, StoredTensor):
                raise IntegrityError(f"{path}: module entry {key} is not a tensor")
            if key in frozen:
                plan.tensor(name, f"{key} (frozen: the ranks' fragments)", kind, tuple(frozen_shapes[key]), value.dtype,
                            Recipe(None, frozen[key], value.dtype))
                continue
            pieces = _z3_pieces(key, places[key], optim, FP32_KEYS[1], None)
            plan.tensor(name, f"{key} (the fp32 master, cast to {value.dtype}: ZeRO-3 saves no {value.dtype} copy)",
                        kind, params[key], value.dtype, Recipe(None, pieces, "float32"))
        else:
            plan.walk(value, name, str(key), path, kind)


def _z3_frozen(model: dict[str, Any], rank_models: list[tuple[str, dict[str, Any]]]) -> dict[str, tuple[Piece, ...]]:
    """Each frozen parameter of a ZeRO-3 save as pieces of the ranks' ``frozen_param_fragments``
    (``ceil(numel / dp)`` elements on each rank in turn, the last padded).

    Raises:
        IntegrityError: a rank's fragment is missing or too short.
    """
    shapes = model.get("frozen_param_shapes") or {}
    world = len(rank_models)
    out = {}
    for key, shape in shapes.items():
        numel = math.prod(shape)
        per = -(-numel // world)
        pieces = []
        for r, (path, tree) in enumerate(rank_models):
            count = max(0, min(per, numel - r * per))
            fragment = (tree.get("frozen_param_fragments") or {}).get(key)
            if not isinstance(fragment, StoredTensor) or len(fragment.shape) != 1 or fragment.shape[0] < count:
                raise IntegrityError(f"{path}: no fragment of {count} elements of the frozen parameter {key}")
            if count:
                pieces.append(Piece(path, fragment, 0, count))
        out[key] = tuple(pieces)
    return out


def _plan_partitions(plan: _Plan, files: _Files, shapes: list[dict[str, tuple[int, ...]]], stage: int,
                     optim: list[tuple[str, dict[str, Any]]]) -> None:
    """The fp32 master weights and per-element optimizer state of every parameter, and the
    optimizer files' other values."""
    fp32_key = FP32_KEYS[1] if stage == 3 else FP32_KEYS[0]
    states = [_inner_state(path, osd, stage) for path, osd in optim]
    _check_partitions(shapes, stage, optim)
    per_element = _per_element_keys(states, optim)
    places = _z3_places(shapes, len(optim)) if stage == 3 else _z12_places(shapes, optim)
    for group in shapes:
        for name, shape in group.items():
            for key in (None, *per_element):
                pieces = (_z3_pieces(name, places[name], optim, fp32_key, key) if stage == 3
                          else _z12_pieces(name, places[name], optim, fp32_key, key))
                prefix = "fp32" if key is None else escape(key)
                plan.tensor(f"optimizer/{prefix}/{escape(name)}", f"{name} ({'fp32 master' if key is None else key})",
                            "optimizer", shape, "float32", Recipe(None, pieces, "float32"))
    _plan_optimizer_values(plan, files, shapes, stage, optim, states)


# Where an optimizer file keeps the wrapped torch optimizer's state dict: stages 1-2, stage 3.
INNER_KEYS = ("base_optimizer_state", "optimizer_state_dict")


def _inner_state(path: str, osd: dict[str, Any], stage: int) -> dict[int, dict[str, Any]]:
    """A rank's per-group optimizer state (``state`` of the wrapped torch optimizer's state dict)."""
    key = INNER_KEYS[stage == 3]
    inner = osd.get(key)
    state = inner.get("state") if isinstance(inner, dict) else None
    if not isinstance(state, dict):
        raise IntegrityError(f"{path}: no {key}.state")
    return state


def _per_element_keys(states: list[dict[int, dict[str, Any]]], optim: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The optimizer state keys held per element (flat tensors: exp_avg, exp_avg_sq...), the
    same in every group of every rank; scalars (step) are values."""
    keys: list[str] = []
    for (path, _), state in zip(optim, states):
        for g, entry in state.items():
            flat = sorted(k for k, v in entry.items() if isinstance(v, StoredTensor) and len(v.shape) == 1)
            if not keys:
                keys = flat
            elif flat != keys:
                raise IntegrityError(f"{path}: group {g} holds optimizer state {flat}, other groups {keys}")
    return keys


def _flats(osd: dict[str, Any], key: str | None, fp32_key: str, state: dict[int, dict[str, Any]], path: str) -> list[StoredTensor]:
    """A rank's flat tensors, one per group (or sub-group): the fp32 partitions, or state `key`."""
    if key is None:
        flats = osd.get(fp32_key)
    else:
        flats = [state.get(g, {}).get(key) for g in range(len(state))]
    if not isinstance(flats, list) or not all(isinstance(t, StoredTensor) and len(t.shape) == 1 for t in flats):
        raise IntegrityError(f"{path}: {fp32_key if key is None else key} is not a list of flat tensors, one per group")
    return flats


def _z12_pieces(name: str, place: tuple[int, int, int], optim: list[tuple[str, dict[str, Any]]],
                fp32_key: str, key: str | None) -> tuple[Piece, ...]:
    """Parameter `name` of a ZeRO-1/2 save, at `place` (group, offset, numel) in its group's
    flat buffer, which the ranks' partitions cut rank after rank."""
    g, offset, numel = place
    size = _z12_partition(optim[0][1], g, optim[0][0])[1]  # the same on every rank (`_check_partitions`)
    pieces = []
    first, last = offset // max(size, 1), (offset + numel - 1) // max(size, 1)
    for r in range(first, min(last, len(optim) - 1) + 1) if numel else ():  # the ranks the parameter meets
        path, osd = optim[r]
        flat = _flats(osd, key, fp32_key, _inner_state(path, osd, 1), path)[g]
        real, _ = _z12_partition(osd, g, path)
        lo, hi = max(offset, r * size), min(offset + numel, r * size + real)
        if lo < hi:
            if flat.shape[0] < hi - r * size:
                raise IntegrityError(f"{path}: group {g}'s {key or 'fp32 partition'} has {flat.shape[0]} elements, "
                                     f"{name} needs {hi - r * size}")
            pieces.append(Piece(path, flat, lo - r * size, hi - lo))
    if sum(p.count for p in pieces) != numel:
        raise IntegrityError(f"{name}: the partitions of the {len(optim)} ranks hold {sum(p.count for p in pieces)} of its "
                             f"{numel} elements")
    return tuple(pieces)


def _z12_partition(osd: dict[str, Any], g: int, path: str) -> tuple[int, int]:
    """A rank's real elements of group `g`'s partition, and the padded partition size."""
    flats = osd.get(FP32_KEYS[0])
    paddings = osd.get("group_paddings") or [0] * len(flats or [])
    if not isinstance(flats, list) or g >= len(flats) or not isinstance(flats[g], StoredTensor) or g >= len(paddings):
        raise IntegrityError(f"{path}: no fp32 partition of group {g}")
    real = flats[g].shape[0] if flats[g].shape else 0
    return real, real + int(paddings[g])


def _z12_places(shapes: list[dict[str, tuple[int, ...]]], optim: list[tuple[str, dict[str, Any]]]) -> dict[str, tuple[int, int, int]]:
    """Each parameter's group, its offset in the group's flat buffer (parameters in order, each
    followed by its alignment padding), and its numel."""
    aligns = optim[0][1].get("param_alignment_paddings")
    out = {}
    for g, group in enumerate(shapes):
        offset = 0
        for j, (n, shape) in enumerate(group.items()):
            out[n] = (g, offset, math.prod(shape))
            pad = aligns[g][j] if isinstance(aligns, list) and g < len(aligns) and j < len(aligns[g]) else 0
            offset += math.prod(shape) + int(pad)
    return out


def _z3_places(shapes: list[dict[str, tuple[int, ...]]], world: int) -> dict[str, tuple[int, int, int]]:
    """Each parameter's offset in every rank's flat buffer (its groups end to end), its
    elements per rank (ceil(numel / dp)) and its numel."""
    out = {}
    offset = 0
    for group in shapes:
        for n, shape in group.items():
            numel = math.prod(shape)
            per = -(-numel // world)
            out[n] = (offset, per, numel)
            offset += per
    return out


def _z3_pieces(name: str, place: tuple[int, int, int], optim: list[tuple[str, dict[str, Any]]],
               fp32_key: str, key: str | None) -> tuple[Piece, ...]:
    """Parameter `name` of a ZeRO-3 save: `per` elements on each rank in turn, at the same
    offset of every rank's flat buffer."""
    offset, per, numel = place
    pieces: list[Piece] = []
    for r, (path, osd) in enumerate(optim):
        count = max(0, min(per, numel - r * per))
        if count:
            pieces += _split(path, _flats(osd, key, fp32_key, _inner_state(path, osd, 3), path), offset, count, name)
    return tuple(pieces)


def _split(path: str, flats: Sequence[StoredTensor], start: int, count: int, name: str) -> list[Piece]:
    """Elements [start, start + count) of `flats` laid end to end, as pieces of each."""
    pieces = []
    base = 0
    for flat in flats:
        n = flat.shape[0]
        lo, hi = max(start, base), min(start + count, base + n)
        if lo < hi:
            pieces.append(Piece(path, flat, lo - base, hi - lo))
        base += n
    if sum(p.count for p in pieces) != count:
        raise IntegrityError(f"{path}: the flat partitions end before {name} (at element {base} of {start + count})")
    return pieces


def _plan_optimizer_values(plan: _Plan, files: _Files, shapes: list[dict[str, tuple[int, ...]]], stage: int,
                           optim: list[tuple[str, dict[str, Any]]], states: list[dict[int, dict[str, Any]]]) -> None:
    """The optimizer files' values beside the flat partitions: each group's step and
    hyper-parameters, the loss scaler, the partitioning (per rank where the ranks differ)."""
    inner_key = INNER_KEYS[stage == 3]
    skip = {*FP32_KEYS, inner_key}
    scaler = optim[0][1].get("loss_scaler")
    if isinstance(scaler, Record) and isinstance(scaler.state, dict) and not json_problems({"s": plain(scaler.state)}):
        if all(plain(osd.get("loss_scaler")) == plain(scaler) for _, osd in optim):
            plan.info["loss_scaler"] = {"type": scaler.qualname, **plain(scaler.state)}
            skip.add("loss_scaler")
    for key in optim[0][1]:
        if key in skip:
            continue
        values = [plain(osd.get(key)) for _, osd in optim]
        same = all(v == values[0] for v in values)
        plan.value(f"deepspeed/optimizer/{escape(str(key))}", f"optimizer_state_dict.{key}", values[0] if same else values)
    steps = [[_scalar(files, path, state.get(g, {}).get("step")) for g in sorted(state)] for (path, _), state in
             zip(optim, states)]
    same = all(s == steps[0] for s in steps)
    plan.value("deepspeed/optimizer/step", f"{inner_key}.state.<group>.step", steps[0] if same else steps)
    groups = (optim[0][1].get(inner_key) or {}).get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise IntegrityError(f"{optim[0][0]}: no {inner_key}.param_groups")
    options = [{k: v for k, v in plain(g).items() if k != "params"} for g in groups]
    plan.value("deepspeed/optimizer/param_groups", f"{inner_key}.param_groups", options)
    common = steps[0][0] if same and steps[0] and all(s == steps[0][0] for s in steps[0]) else None
    param_groups = [ParamGroup(params=tuple(g), options=o) for g, o in zip(shapes, options)] if len(shapes) == len(options) else []
    plan.info["optimizer"] = OptimizerInfo(
        type="client",  # named from ds_config in _plan_values
        param_groups=tuple(param_groups),
        step=int(common) if isinstance(common, float) and common.is_integer() and common >= 0 else None)


def _scalar(files: _Files, path: str, value: Any) -> float | None:
    """The value of a one-element float tensor (an optimizer group's step), or None."""
    if value is None:
        return None
    if not isinstance(value, StoredTensor) or math.prod(value.shape) != 1 or value.dtype not in _SCALARS:
        raise IntegrityError(f"{path}: an optimizer step that is not a one-element tensor")
    buf = np.empty(itemsize(value.dtype), dtype=np.uint8)
    copy_tensor(files.archive(path), value, buf.reshape(*value.shape, -1))
    return float(buf.view(_SCALARS[value.dtype])[0])


_SCALARS = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32}


def _check_partitions(shapes: list[dict[str, tuple[int, ...]]], stage: int, optim: list[tuple[str, dict[str, Any]]]) -> None:
    """The ranks' partitions add up to the parameters exactly (padding aside).

    Raises:
        IntegrityError: they do not: a file of another save, or a truncated list.
    """
    world = len(optim)
    if stage == 3:
        want = sum(-(-math.prod(s) // world) for g in shapes for s in g.values())
        for path, osd in optim:
            have = sum(t.shape[0] for t in _flats(osd, None, FP32_KEYS[1], {}, path))
            if have != want:
                raise IntegrityError(f"{path}: the rank's fp32 partitions hold {have} elements; the parameters of "
                                     f"param_shapes over {world} ranks need {want}")
        return
    aligns = optim[0][1].get("param_alignment_paddings")
    for g, group in enumerate(shapes):
        pads = aligns[g] if isinstance(aligns, list) and g < len(aligns) else [0] * len(group)
        want = sum(math.prod(s) for s in group.values()) + sum(int(p) for p in pads)
        parts = [_z12_partition(osd, g, path) for path, osd in optim]
        sizes = {size for _, size in parts}
        have = sum(real for real, _ in parts)
        if len(sizes) != 1 or have != want:
            raise IntegrityError(f"{optim[0][0]}: group {g}'s partitions over {world} ranks hold {have} elements "
                                 f"(partition sizes {sorted(sizes)}); its parameters need {want}")


def _plan_values(plan: _Plan, model: dict[str, Any], path: str, shapes: list[dict[str, tuple[int, ...]]], stage: int) -> None:
    """DeepSpeed's other values (info, ``deepspeed/...``) and the client state (``client/...``)."""
    for key, value in model.items():
        if key in ("module", "optimizer") or (key == "frozen_param_fragments" and stage == 3):
            continue  # converted as tensors (ZeRO-3's frozen fragments: into the frozen parameters)
        if key not in DS_KEYS:
            plan.walk(value, f"client/{escape(str(key))}", str(key), path, "other")
        elif key == "ds_config" and isinstance(value, dict) and not json_problems({key: plain(value)}):
            plan.info["config"] = {"ds_config": plain(value)}
        elif key == "lr_scheduler" and isinstance(value, dict) and not _has_tensor(value) and not json_problems({key: plain(value)}):
            plan.info["scheduler"] = plain(value)
        elif key == "param_shapes":
            plan.value("deepspeed/param_shapes", key, [{n: list(s) for n, s in g.items()} for g in shapes] if stage else value)
        else:
            plan.walk(value, f"deepspeed/{escape(str(key))}", str(key), path, "other")
    steps, samples = model.get("global_steps"), model.get("global_samples")
    plan.step = steps if isinstance(steps, int) and steps >= 0 else 0
    dp, mp = (n if isinstance(n, int) and n >= 1 else 1 for n in (model.get("dp_world_size"), model.get("mp_world_size")))
    plan.version, plan.topology = model.get("ds_version"), Topology(world_size=dp * mp, tp=mp, dp=dp, zero_stage=stage)
    if isinstance(samples, int) and samples >= 0:
        plan.info["data_progress"] = DataProgress(consumed_samples=samples)
    if "optimizer" in plan.info:  # the config (read after the optimizer files) names the optimizer's type
        opt = plan.info["optimizer"]
        kind = ((plan.info.get("config") or {}).get("ds_config") or {}).get("optimizer", {})
        plan.info["optimizer"] = opt.model_copy(update={"type": str(kind.get("type", "client")) if isinstance(kind, dict) else "client"})
    plan.layout = _layout(shapes) if stage else None


def _layout(shapes: list[dict[str, tuple[int, ...]]]) -> Layout:
    """The model as DeepSpeed holds it: every parameter whole on each TP rank, one pipeline
    stage, ZeRO flattening each stage's parameters together; fp32 masters and moments."""
    params = tuple(Param(name=n, parts=(TensorPart(tensor=n, shape=tuple(s)),)) for g in shapes for n, s in g.items())
    return Layout(
        name="deepspeed",
        units=(Unit(name="model", place="first", params=params),),
        zero=Zero(flatten="stage"),
        states=(StateGroup(prefix="model", role="param"), StateGroup(prefix="optimizer/fp32", role="optimizer"),
                StateGroup(prefix="optimizer/exp_avg", role="optimizer"),
                StateGroup(prefix="optimizer/exp_avg_sq", role="optimizer")),
        constraints=(Constraint(axis="tp", at_most=1, what="a DeepSpeed checkpoint records no tensor-parallel cut"),
                     Constraint(axis="pp", at_most=1, what="a DeepSpeed checkpoint records no pipeline cut")),
    )


def assemble(files: _Files, spec: TensorSpec, recipe: Recipe) -> memoryview:
    """Return tensor `spec`'s bytes (C order), read from the source when its turn comes.

    Raises:
        IntegrityError: a file is truncated or unlike its pickle.
    """
    width = itemsize(spec.dtype)
    count = math.prod(spec.shape)
    if recipe.whole is not None:
        path, stored = recipe.whole
        buf = np.empty(count * width, dtype=np.uint8)
        copy_tensor(files.archive(path), stored, buf.reshape(*spec.shape, width))
        return buf.data
    src_width = itemsize(recipe.source_dtype)
    flat = np.empty(count * src_width, dtype=np.uint8)
    pos = 0
    for piece in recipe.pieces:
        if piece.tensor.dtype != recipe.source_dtype:
            raise IntegrityError(f"{piece.path}: a flat partition of {piece.tensor.dtype}, expected {recipe.source_dtype}")
        n = piece.count * src_width
        copy_flat(files.archive(piece.path), piece.tensor, piece.start, flat[pos:pos + n].data)
        pos += n
    if recipe.source_dtype == spec.dtype:
        return flat.data
    return cast_float32(flat.view(np.float32), spec.dtype).view(np.uint8).data


CONVERTER = DeepSpeedConverter()

__all__ = ["ALLOWED", "CONVERTER", "NAME", "DeepSpeedConverter", "assemble", "cast_float32", "plan_conversion", "tag_directory"]
