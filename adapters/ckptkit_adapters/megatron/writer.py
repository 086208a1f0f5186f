"""Export to a Megatron-Core ``dist_checkpointing`` directory (``torch_dist``) that megatron-core loads into a ``GPTModel``.

The files are what megatron-core writes: DCP's ``.metadata`` and ``__0_<k>.distcp`` (written by
torch's own DCP writer), ``common.pt`` (the state that is not sharded) and ``metadata.json``
naming the backend. Keys follow Megatron-Core (layout ``megatron-gpt``):

- each transformer layer's tensors stacked on a leading layer axis under one key without a
  layer number (``model/decoder.layers.1.self_attention.linear_qkv.weight`` is layer 1 of
  ``decoder.layers.self_attention.linear_qkv.weight``), every other parameter under its name;
- a mixture of experts (the reference trainer's ``llama-moe``, as megatron-core's MoE layer
  with ``SequentialMLP`` experts saves it): the router ``decoder.layers.mlp.router.weight``
  stacked by layer, each expert's ``linear_fc1`` ``[gate; up]`` and ``linear_fc2`` stacked on
  a (layer, global expert) axis pair under ``decoder.layers.mlp.experts.experts.<linear>``, one
  chunk per expert and TP piece, so the files are the same at every EP (`ep` is checked
  against the experts, as a Megatron job's would be);
- with the optimizer, the distributed optimizer's ``fully_reshardable`` form: each parameter's
  fp32 master as ``optimizer.state.param.<key>`` and its moments as
  ``optimizer.state.exp_avg.<key>``, ``optimizer.state.exp_avg_sq.<key>``, the parameter groups
  in ``common.pt``;
- each linear module's extra state (``<module>._extra_state/shard_<layer>_<layers>``: ``None``
  in the local layer spec) as megatron-core asks for it;
- in ``common.pt``, what Megatron-LM's ``load_checkpoint`` reads besides: ``args`` (the model's
  arguments with the export's parallel sizes and how it was saved), ``content_metadata`` (how to
  build the state dicts to load), ``iteration`` (the step), ``checkpoint_version``,
  and a Megatron save's ``num_floating_point_operations_so_far`` and, with the optimizer, its
  ``opt_param_scheduler``. Per-rank RNG states are not carried to a new topology (Megatron-LM
  resumes from the export with ``--no-load-rng``); every value not written is listed as skipped.

Each chunk is one TP rank's piece of one layer (and expert), as megatron-core at the target TP would write
it (the layout says the pieces; the target must be one the layout allows): a reader of the
format loads it at any TP/PP. Only the chunk's bytes are read from the source when the DCP
writer asks for them, so memory stays about one chunk.
"""

from __future__ import annotations

import argparse
import io
import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ckptkit.boxes import Box
from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.convert import output_dtype
from ckptkit.exports.source import ExportedFile, ExportedTensor, Source, Writer, Written
from ckptkit.io.checksum import checksum_of
from ckptkit.layouts import Layout, builtin
from ckptkit.layouts.placement import local_param, topology_problems
from ckptkit.manifest import Manifest, Topology
from ckptkit.models.compose import Run, compose
from ckptkit.models.reference import model_of
from ckptkit.state.torch_io import byte_view, torch_dtype
from ckptkit.state.tree import unescape
from ckptkit.storage import Storage
from ckptkit_adapters.common.dcp_write import as_tensor, file_entry, write_dcp
from ckptkit_adapters.megatron.names import (
    MEGATRON_EXPERT_EXTRA_STATE,
    MEGATRON_EXPERTS,
    MEGATRON_EXTRA_STATE,
    MEGATRON_LOCAL_EXPERTS,
    MEGATRON_MOE_EXTRA_STATE,
)
from ckptkit_adapters.megatron.scheduler import opt_param_scheduler
from ckptkit_adapters.megatron.view import megatron_args, megatron_config, megatron_view
from ckptkit_adapters.megatron.writer_optimizer import optimizer_sources, param_groups

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EXPERT = re.compile(rf"^decoder\.layers\.(\d+)\.{re.escape(MEGATRON_LOCAL_EXPERTS)}\.(\d+)\.(.+)$")
STATES = {"model": "", "optimizer/fp32": "param", "optimizer/exp_avg": "exp_avg", "optimizer/exp_avg_sq": "exp_avg_sq"}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a Megatron key: its box in the key's global tensor, and the boxes of source
    tensors it is made of, in order along its first dim (after a stacked key's layer, expert axes)."""

    at: Box
    pieces: tuple[tuple[str, Box], ...]


@dataclass(frozen=True, slots=True)
class Entry:
    """One Megatron key: its global shape and dtype, and its chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]


def megatron_writer(source: Source, out_dtype: str | None, include_optimizer: bool, layout: Layout, tp: int, pp: int,
                    ep: int = 1) -> Writer:
    """Plan the Megatron export (failing before any write) and return its writer.

    Raises:
        LayoutError: a layout with no Megatron names, a target TP/PP/EP the layout forbids (an
            EP on a model without experts, experts EP does not divide), layers or experts
            missing, or no optimizer state with `include_optimizer` (every problem named).
    """
    sources, target = megatron_sources(source, layout, include_optimizer, tp)
    problems = topology_problems(target, Topology(world_size=tp * pp * ep, tp=tp, pp=pp, dp=ep, ep=ep, zero_stage=0))
    if problems:
        raise LayoutError(f"cannot export at tp {tp} x pp {pp}{f' x ep {ep}' if ep != 1 else ''}: " + summarize(problems))
    entries = plan_entries(source, target, sources, tp, out_dtype, padded=layout.name != "megatron-gpt")
    groups = None if not include_optimizer else \
        param_groups(source, experts=bool(target.experts)) if layout.name != "megatron-gpt" else _param_groups(source)
    chosen = {fqn for e in entries for c in e.chunks for fqn, _ in c.pieces if fqn}
    skipped = sorted(set(source.manifest.tensors) - chosen)
    args = export_args(source, layout, target, tp, pp, ep) | _saved_with(include_optimizer)
    counters, warnings = _counters(source.manifest, include_optimizer, layout.name != "megatron-gpt", str(source.loc))
    carried = _carried(source.manifest, layout, target) | {f"megatron/{key}" for key in counters}

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        source.expect(sorted(chosen))
        report: dict[tuple[str, tuple[int, ...]], ExportedTensor] = {}
        where = write_dcp({}, _Planner(source, entries, _extra_states(target), report), dst, tmp)
        tensors = [t.model_copy(update={"file": where[at]}) for at, t in report.items()]
        common: dict[str, Any] = {"args": argparse.Namespace(**args), **counters, CONTENT_METADATA: content_metadata(include_optimizer)}
        if groups is not None:
            # one state per optimizer; a mixture of experts' is megatron-core's ChainedOptimizer of two (dense, experts)
            states = [{"param_state_sharding_type": "fully_reshardable", "optimizer": {"param_groups": g}} for g in groups]
            common["optimizer"] = states[0] if len(states) == 1 else dict(enumerate(states))
        extra = {"common.pt": _torch_save(common), "metadata.json": json.dumps(BACKEND).encode()}
        files = []
        for name, data in extra.items():
            dst.write(f"{tmp}/{name}", [data])
            files.append(ExportedFile(path=name, size=len(data), checksum=checksum_of(data)))
        files += [file_entry(dst, tmp, key) for key in sorted(dst.list(tmp)) if key.rpartition("/")[2] not in extra]
        return Written(sorted(tensors, key=lambda t: t.name), files)

    return Writer(skipped, write, carried, _reasons(source.manifest, include_optimizer, carried), warnings)


def _reasons(manifest: Manifest, include_optimizer: bool, carried: frozenset[str]) -> dict[str, str]:
    """Why the export leaves out a Megatron save's optimizer values: the scheduler's state is the
    optimizer's, and its parameter groups are written again from the optimizer record."""
    out = {}
    for name in set(manifest.objects) - carried:
        if name == "megatron/opt_param_scheduler" and not include_optimizer:
            out[name] = "the optimizer's scheduler state, which the megatron export writes only with --include-optimizer"
        elif name.startswith("megatron/") and name.endswith("/optimizer/optimizer"):
            out[name] = ("a rank's optimizer record; the megatron export writes the parameter groups again from the "
                         "checkpoint's optimizer info" + ("" if include_optimizer else " with --include-optimizer"))
    return out


def _counters(manifest: Manifest, include_optimizer: bool, schedule: bool, where: str) -> tuple[dict[str, Any], list[str]]:
    """What Megatron-LM's ``load_checkpoint`` reads from ``common.pt`` beside the arguments: the
    iteration (the checkpoint's step; it stops without one unless ``--finetune``), the checkpoint
    version (3.0, the current layout of the files), a Megatron save's floating-point operation
    count and, with the optimizer, the scheduler state it loads with the optimizer (a Megatron
    save's own; of a checkpoint no Megatron job saved, `schedule`, its schedule as Megatron's,
    `scheduler.opt_param_scheduler`); and the warnings of what stands in for the schedule."""
    objects = manifest.objects
    out: dict[str, Any] = {"iteration": manifest.step, "checkpoint_version": 3.0}
    if isinstance(objects.get("megatron/num_floating_point_operations_so_far"), (int, float)):
        out["num_floating_point_operations_so_far"] = objects["megatron/num_floating_point_operations_so_far"]
    if not include_optimizer:
        return out, []
    if isinstance(objects.get("megatron/opt_param_scheduler"), dict):
        out["opt_param_scheduler"] = objects["megatron/opt_param_scheduler"]
        return out, []
    if not schedule:
        return out, []
    out["opt_param_scheduler"], warnings = opt_param_scheduler(manifest, where)
    return out, warnings


def _carried(manifest: Manifest, layout: Layout, target: Layout) -> frozenset[str]:
    """The checkpoint's values the export carries: a Megatron save's arguments (written with the
    export's parallel sizes), and its layers' empty extra states (megatron-core's without
    Transformer Engine), which the export writes empty for every layer again."""
    n, experts = target.num_layers, target.experts
    modules = [f"{i}.{m}" for i in range(n) for m in (MEGATRON_MOE_EXTRA_STATE if experts else MEGATRON_EXTRA_STATE)]
    modules += [f"{i}.{MEGATRON_LOCAL_EXPERTS}.{e}.linear_fc{k}" for i in range(n) for e in range(experts or 0) for k in (1, 2)]
    empty = {f"model/decoder.layers.{m}._extra_state" for m in modules}
    args = layout.name == "megatron-gpt" and isinstance((manifest.info.config or {}).get("args"), dict)
    own = {"megatron/args"} if args else set()
    own.add(f"megatron/{CONTENT_METADATA}")  # a Megatron save's, which the export writes for its own files
    return frozenset(k for k, v in manifest.objects.items() if (k in empty and v in (None, [None])) or k in own)


CONTENT_METADATA = "content_metadata"  # common.pt's: how the sharded state dicts were built (megatron-core 0.13+)


def content_metadata(include_optimizer: bool) -> dict[str, Any]:
    """What Megatron-LM saves as ``content_metadata`` and its ``load_checkpoint`` builds the state
    dicts to load from: keys without a ``ChainedOptimizer`` prefix, not singleton local shards, and
    with the optimizer, the distributed optimizer's ``fully_reshardable`` form. (Without it,
    Megatron-LM takes the export for a save older than megatron-core 0.13 and asks for another form.)"""
    out: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if include_optimizer:
        out |= {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": False}
    return out


def _saved_with(include_optimizer: bool) -> dict[str, Any]:
    """The arguments that say how the export was saved: ``torch_dist``, and with the optimizer the
    distributed optimizer's fully reshardable form; without it ``no_save_optim``, so that
    Megatron-LM's ``load_checkpoint`` loads the model alone rather than look for optimizer state."""
    return {"ckpt_format": "torch_dist", "use_dist_ckpt": True, "no_save_optim": None if include_optimizer else True,
            **({"use_distributed_optimizer": True, "dist_ckpt_optim_fully_reshardable": True} if include_optimizer else {})}


# Megatron-LM's arguments of the parallel sizes, set to the export's
PARALLEL_ARGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def export_args(source: Source, layout: Layout, target: Layout, tp: int, pp: int, ep: int) -> dict[str, Any]:
    """Megatron-LM's arguments (``args`` in ``common.pt``), which say the model, so that Megatron-LM
    (``--use-checkpoint-args``) and ``convert --from megatron`` read it back with no layout named:
    a Megatron save's own, as its conversion kept them (``info.config.args``), else those of the
    target's config (`megatron_args`) with the samples the run consumed (``consumed_train_samples``,
    where Megatron-LM's data resumes); their parallel sizes the export's."""
    carried = (source.manifest.info.config or {}).get("args") if layout.name == "megatron-gpt" else None
    args = dict(carried) if isinstance(carried, dict) else megatron_args(target.config)
    progress = source.manifest.info.data_progress
    if not isinstance(carried, dict) and progress is not None and progress.consumed_samples:
        args["consumed_train_samples"] = progress.consumed_samples
    return {**args, **dict(zip(PARALLEL_ARGS, (tp, pp, ep)))}


Sources = dict[str, dict[str, list[Run]]]  # Megatron state ("" for the model) -> Megatron name per layer -> its rows


def megatron_sources(source: Source, layout: Layout, include_optimizer: bool, tp: int = 1) -> tuple[Sources, Layout]:
    """Where each Megatron tensor (per layer, per expert) comes from, and the Megatron layout of
    the target: a Megatron GPT's tensors as they are; any other view of a canonical model (the
    reference trainer's, a converted Hugging Face model's) through the model (``models.compose``
    to the Megatron view, its vocabulary padded for `tp`), with its fp32 masters and moments if asked.

    Raises:
        LayoutError: a layout of no tool's view, an architecture megatron-core's GPT cannot
            hold (what it lacks named), tensors missing.
    """
    tensors = source.manifest.tensors
    if layout.name != "megatron-gpt":
        carried = (source.manifest.info.config or {}).get("config.json")
        try:
            spec, view = model_of(layout, carried if isinstance(carried, dict) else None)
            target = builtin("megatron-gpt", megatron_config(spec, tp))
            mine = megatron_view(spec, int(target.config["vocab_size"]))  # type: ignore[arg-type]
        except LayoutError as e:
            raise LayoutError(f"{source.loc}: {e}") from None
        out: Sources = {"": compose(spec, view, mine, "model/")}
        if include_optimizer:
            out |= optimizer_sources(source, spec, view, mine)
        missing = sorted({r.fqn for names in out.values() for runs in names.values() for r in runs} - set(tensors))
        if missing:
            raise LayoutError(f"cannot export to Megatron: {len(missing)} tensor(s) missing: " + summarize(missing))
        return out, target
    out = {}
    for wanted in ["model", *(p for p in STATES if p != "model" and include_optimizer)]:
        prefix = wanted
        if wanted == "optimizer/fp32" and not any(f.startswith("optimizer/fp32/") for f in tensors) and all(
                t.dtype == "float32" for f, t in tensors.items() if f.startswith("model/")):
            prefix = "model"  # a float32 model's optimizer (Megatron's FP32Optimizer) keeps no other master
        names = [f for f in tensors if f.startswith(f"{prefix}/")]
        if not names:
            raise LayoutError(f"{source.loc}: no {prefix} tensors in the checkpoint, which the export needs")
        out[STATES[wanted]] = {unescape(f[len(prefix) + 1:]): [Run(0, tensors[f].shape[0] if tensors[f].shape else 1, f, 0)]
                               for f in names}
    return out, layout


def plan_entries(source: Source, layout: Layout, sources: Sources, tp: int, out_dtype: str | None,
                 padded: bool = False) -> list[Entry]:
    """The Megatron keys of `sources`, each cut into TP pieces per layer (and expert) as `layout`
    cuts them (`padded`: rows past the sources' are padding, zeros).

    Raises:
        LayoutError: a stacked tensor missing layers or experts, or unlike its other layers.
    """
    tensors = source.manifest.tensors
    params = {part.name: (param, layer, expert) for unit in layout.units
              for layer in layout.unit_layers(unit)
              for expert in (range(unit.experts) if unit.experts else (None,))
              for param in unit.params for part in local_param(param, layer, 1, 0, expert).parts}
    shapes = layout.tensors()
    grouped: dict[str, dict[tuple[int, ...], tuple[str, list[Run]]]] = {}
    for state, names in sources.items():
        for name, runs in names.items():
            key, index = _stacked(name)
            grouped.setdefault(f"optimizer.state.{state}.{key}" if state else key, {})[index] = (name, runs)
    problems: list[str] = []
    entries = []
    for key, by_index in sorted(grouped.items()):
        entry = _entry(key, by_index, layout, params, shapes, tp, tensors, out_dtype, problems, padded)
        if entry is not None:
            entries.append(entry)
    if problems:
        raise LayoutError("cannot export to Megatron: " + summarize(problems))
    return entries


def _stacked(name: str) -> tuple[str, tuple[int, ...]]:
    """The key megatron-core stacks a tensor under, and its index on the stacked axes: (layer,
    global expert) for an expert's, (layer,) for a layer's, () for any other."""
    found = EXPERT.match(name)
    if found:
        return f"decoder.layers.{MEGATRON_EXPERTS}.{found.group(3)}", (int(found.group(1)), int(found.group(2)))
    found = LAYER.match(name)
    if found:
        return f"decoder.layers.{found.group(2)}", (int(found.group(1)),)
    return name, ()


def _entry(key: str, by_index: dict[tuple[int, ...], tuple[str, list[Run]]], layout: Layout, params: dict[str, Any],
           shapes: dict[str, tuple[int, ...]], tp: int, tensors: Any, out_dtype: str | None, problems: list[str],
           padded: bool) -> Entry | None:
    """One key's entry: a whole tensor, or its layers (and experts) stacked, in the target's TP
    pieces (the model in `out_dtype` if given, the optimizer state as saved)."""
    depth = {len(index) for index in by_index}
    if len(depth) > 1:
        problems.append(f"{key}: both stacked and whole")
        return None
    axes = (layout.num_layers, layout.experts)[: depth.pop()]
    want = [()] if not axes else [(i,) for i in range(axes[0])] if len(axes) == 1 else \
        [(i, e) for i in range(axes[0]) for e in range(axes[1])]
    if sorted(by_index) != want:
        what = "layers" if len(axes) == 1 else "(layer, expert) pairs"
        problems.append(f"{key}: {len(by_index)} {what} saved, the layout has {len(want)}")
        return None
    name, runs = by_index[want[0]]
    first = tensors[runs[0].fqn]
    shape = shapes.get(name, first.shape)
    dtypes = {tensors[r.fqn].dtype for _, rs in by_index.values() for r in rs}
    if len(dtypes) != 1:
        problems.append(f"{key}: its source tensors have dtypes {sorted(dtypes)}")
        return None
    chunks = []
    for index in want:
        name, runs = by_index[index]
        rows, filled = shape[0] if shape else 1, sum(r.count for r in runs)
        if shapes.get(name, shape) != shape or filled > rows or (filled < rows and not padded):
            problems.append(f"{key}: {name} is not of the shape {list(shape)} the layout gives")
            return None
        for box in _pieces(name, shape, params, tp):
            at = Box((*index, *box.offsets), (*(1 for _ in index), *box.lengths))
            chunks.append(Chunk(at, _from_runs(box, runs)))
    dtype = first.dtype if key.startswith("optimizer.") else output_dtype(first.dtype, out_dtype)
    return Entry(key, (*axes, *shape), dtype, tuple(chunks))


def described(pieces: tuple[tuple[str, Box], ...]) -> str:
    """The source of a chunk made of `pieces`, in the report: each piece's rows, or (a source
    giving more than 4 pieces: rows in another order) how many runs of its rows it gives."""
    counts = Counter(fqn for fqn, _ in pieces)
    out: dict[str, None] = {}  # in order, each summarized source once
    for fqn, box in pieces:
        rows = f"{counts[fqn]} runs of rows" if counts[fqn] > 4 else ", ".join(f"{o}:{o + n}" for o, n in zip(box.offsets, box.lengths))
        out[f"{fqn or 'padding'}[{rows}]"] = None
    return " + ".join(out)


def _from_runs(box: Box, runs: list[Run]) -> tuple[tuple[str, Box], ...]:
    """The source boxes of `box` of a Megatron tensor made of `runs` of rows, in row order (rows
    no run fills: padding, ``""``)."""
    if not box.lengths:
        return ((runs[0].fqn, box),)
    lo, hi = box.offsets[0], box.offsets[0] + box.lengths[0]
    out, at = [], lo
    for r in runs:
        a, b = max(lo, r.row), min(hi, r.row + r.count)
        if a < b:
            if a > at:
                out.append(("", Box((at, *box.offsets[1:]), (a - at, *box.lengths[1:]))))
            out.append((r.fqn, Box((r.src_row + a - r.row, *box.offsets[1:]), (b - a, *box.lengths[1:]))))
            at = b
    if at < hi:
        out.append(("", Box((at, *box.offsets[1:]), (hi - at, *box.lengths[1:]))))
    return tuple(out)


def _pieces(name: str, shape: tuple[int, ...], params: dict[str, Any], tp: int) -> list[Box]:
    """The boxes of logical tensor `name` that TP ranks 0..tp-1 hold (a replicated one once)."""
    if name not in params:
        return [Box((0,) * len(shape), shape)]
    param, layer, expert = params[name]
    out: list[Box] = []
    for r in range(tp):
        for part in local_param(param, layer, tp, r, expert).parts:
            if part.name == name and not (part.replicated and r):
                out.append(Box(part.offsets, part.lengths))
    return out


def _extra_states(layout: Layout) -> list[str]:
    """The sharded-object keys of every layer's (and expert's) linear modules' extra state."""
    n, experts = layout.num_layers, layout.experts
    if not experts:
        return [f"decoder.layers.{module}._extra_state/shard_{i}_{n}" for i in range(n) for module in MEGATRON_EXTRA_STATE]
    return [*(f"decoder.layers.{module}._extra_state/shard_{i}_{n}" for i in range(n) for module in MEGATRON_MOE_EXTRA_STATE),
            *(f"decoder.layers.{module}._extra_state/shard_{i}.{e}_{n}.{experts}" for i in range(n) for e in range(experts)
              for module in MEGATRON_EXPERT_EXTRA_STATE)]


def _param_groups(source: Source) -> list[list[dict[str, Any]]]:
    """The optimizers' parameter groups for ``common.pt``, from the checkpoint's info: one
    optimizer's, or (groups of expert-parallel parameters among them) the dense and the experts'
    optimizers' of megatron-core's ``ChainedOptimizer``; each with the optimizer's step, which
    the distributed optimizer keeps in its groups (a plain optimizer's, per parameter).

    Raises:
        LayoutError: none recorded.
    """
    info = source.manifest.info.optimizer
    if info is None or not info.param_groups:
        raise LayoutError(f"{source.loc}: no optimizer parameter groups recorded, which Megatron's optimizer state needs")
    groups = [{k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in g.options.items()} for g in info.param_groups]
    if info.step is not None:  # a plain optimizer's groups (torch's Adam) keep no step; the distributed optimizer's do
        groups = [g if "step" in g else {**g, "step": float(info.step)} for g in groups]
    experts = [g for g in groups if g.get("is_expert_parallel") is True]
    return [[g for g in groups if g not in experts], experts] if experts and len(experts) < len(groups) else [groups]


def _torch_save(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


class _Planner(DefaultSavePlanner):
    """Write items for every chunk and extra state; each chunk read from the source (its box
    only) when the writer resolves it."""

    def __init__(self, source: Source, entries: list[Entry], objects: list[str],
                 report: dict[tuple[str, tuple[int, ...]], ExportedTensor]) -> None:
        super().__init__()
        self.source, self.report = source, report
        self.chunks = {(e.key, c.at.offsets): (e, c) for e in entries for c in e.chunks}
        self.objects = objects

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(e.key, c.at.offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(c.at.offsets), torch.Size(c.at.lengths)),
                                                       properties=TensorProperties(dtype=torch_dtype(e.dtype)),
                                                       size=torch.Size(e.shape)))
                 for e, c in self.chunks.values()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO) for key in self.objects]
        self.plan = SavePlan(items, planner_data={})
        return self.plan

    def resolve_data(self, write_item: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(_torch_save([None]))  # megatron-core saves a sharded object as the list of its pieces
        entry, chunk = self.chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        saved = next((self.source.manifest.tensors[fqn].dtype for fqn, _ in chunk.pieces if fqn), entry.dtype)
        read = iter(self.source.read_pieces([p for p in chunk.pieces if p[0]]))
        parts = [as_tensor(next(read), saved).to(torch_dtype(entry.dtype)) if fqn else torch.zeros(box.lengths, dtype=torch_dtype(entry.dtype))
                 for fqn, box in chunk.pieces]
        out = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(chunk.at.lengths).contiguous()
        name = f"{entry.key}[{', '.join(f'{o}:{o + n}' for o, n in zip(chunk.at.offsets, chunk.at.lengths))}]"
        source = described(chunk.pieces)
        self.report[(entry.key, chunk.at.offsets)] = ExportedTensor(
            name=name, source=source, shape=list(chunk.at.lengths), source_dtype=saved, dtype=entry.dtype, file="",
            checksum=checksum_of(byte_view(out)))
        return out


__all__ = ["BACKEND", "Chunk", "Entry", "Run", "megatron_sources", "megatron_writer", "plan_entries"]
