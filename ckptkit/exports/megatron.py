"""Export to a Megatron-Core ``dist_checkpointing`` directory (``torch_dist``) that megatron-core loads into a ``GPTModel``.

The files are what megatron-core writes: DCP's ``.metadata`` and ``__0_<k>.distcp`` (written by
torch's own DCP writer), ``common.pt`` (the state that is not sharded) and ``metadata.json``
naming the backend. Keys follow Megatron-Core (layout ``megatron-gpt``):

- each transformer layer's tensors stacked on a leading layer axis under one key without a
  layer number (``model/decoder.layers.1.self_attention.linear_qkv.weight`` is layer 1 of
  ``decoder.layers.self_attention.linear_qkv.weight``), every other parameter under its name;
- with the optimizer, the distributed optimizer's ``fully_reshardable`` form: each parameter's
  fp32 master as ``optimizer.state.param.<key>`` and its moments as
  ``optimizer.state.exp_avg.<key>``, ``optimizer.state.exp_avg_sq.<key>``, the parameter groups
  in ``common.pt``;
- each linear module's extra state (``<module>._extra_state/shard_<layer>_<layers>``: ``None``
  in the local layer spec) as megatron-core asks for it.

Each chunk is one TP rank's piece of one layer, as megatron-core at the target TP would write
it (the layout says the pieces; the target must be one the layout allows): a reader of the
format loads it at any TP/PP. Only the chunk's bytes are read from the source when the DCP
writer asks for them, so memory stays about one chunk.
"""

from __future__ import annotations

import io
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ..boxes import Box
from ..errors import LayoutError, summarize
from ..io.checksum import checksum_of
from ..layouts import Layout
from ..layouts.placement import local_param, topology_problems
from ..manifest import Topology
from ..state.torch_io import byte_view, torch_dtype
from ..state.tree import unescape
from ..storage import Storage, local_path
from .convert import output_dtype
from .dcp import file_entry, unwrapped
from .source import ExportedFile, ExportedTensor, Source, Writer, Written

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
STATES = {"model": "", "optimizer/fp32": "param", "optimizer/exp_avg": "exp_avg", "optimizer/exp_avg_sq": "exp_avg_sq"}
EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk of a Megatron key: its box in the key's global tensor, from `box` of tensor `fqn`."""

    at: Box
    fqn: str
    box: Box


@dataclass(frozen=True, slots=True)
class Entry:
    """One Megatron key: its global shape and dtype, and its chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]


def megatron_writer(source: Source, out_dtype: str | None, include_optimizer: bool, layout: Layout, tp: int, pp: int) -> Writer:
    """Plan the Megatron export (failing before any write) and return its writer.

    Raises:
        LayoutError: a layout other than ``megatron-gpt``, a target TP/PP it forbids, layers
            missing, or no optimizer state with `include_optimizer` (every problem named).
    """
    if layout.name != "megatron-gpt":
        raise LayoutError(f"the megatron format writes a Megatron-Core GPT (layout megatron-gpt); {source.loc} is "
                          f"{layout.name!r}: give --layout FILE (ckptkit layout builtin megatron-gpt CONFIG)")
    problems = topology_problems(layout, Topology(world_size=tp * pp, tp=tp, pp=pp, dp=1, zero_stage=0))
    if problems:
        raise LayoutError(f"cannot export at tp {tp} x pp {pp}: " + summarize(problems))
    prefixes = ["model", *(p for p in STATES if p != "model" and include_optimizer)]
    entries = plan_entries(source, layout, prefixes, tp, out_dtype)
    groups = _param_groups(source) if include_optimizer else None
    chosen = {c.fqn for e in entries for c in e.chunks}
    skipped = sorted(set(source.manifest.tensors) - chosen)

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        source.expect(sorted(chosen))
        report: dict[tuple[str, tuple[int, ...]], ExportedTensor] = {}
        planner = _Planner(source, entries, _extra_states(layout), out_dtype, report)
        writer = FileSystemWriter(local_path(dst, tmp, "a Megatron export"), thread_count=1, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                metadata = save({}, storage_writer=writer, planner=planner, no_dist=True)
            except CheckpointException as exc:  # DCP wraps what its writer or our planner raised
                raise unwrapped(exc) from exc
        where = {(index.fqn, tuple(index.offset or ())): info.relative_path for index, info in metadata.storage_data.items()}
        tensors = [t.model_copy(update={"file": where[at]}) for at, t in report.items()]
        common: dict[str, Any] = {}
        if groups is not None:
            common["optimizer"] = {"param_state_sharding_type": "fully_reshardable", "optimizer": {"param_groups": groups}}
        extra = {"common.pt": _torch_save(common), "metadata.json": json.dumps(BACKEND).encode()}
        files = []
        for name, data in extra.items():
            dst.write(f"{tmp}/{name}", [data])
            files.append(ExportedFile(path=name, size=len(data), checksum=checksum_of(data)))
        files += [file_entry(dst, tmp, key) for key in sorted(dst.list(tmp)) if key.rpartition("/")[2] not in extra]
        return Written(sorted(tensors, key=lambda t: t.name), files, skipped)

    return write


def plan_entries(source: Source, layout: Layout, prefixes: list[str], tp: int, out_dtype: str | None) -> list[Entry]:
    """The Megatron keys of the tensors under `prefixes`, each cut into TP pieces per layer.

    Raises:
        LayoutError: a stacked tensor missing layers or unlike its other layers, no tensors of
            a prefix.
    """
    tensors = source.manifest.tensors
    params = {part.name: (param, layer) for unit in layout.units
              for layer in (range(layout.num_layers) if unit.place == "layers" else (None,))
              for param in unit.params for part in local_param(param, layer, 1, 0).parts}
    grouped: dict[str, dict[int | None, tuple[str, str]]] = {}
    problems: list[str] = []
    for prefix in prefixes:
        state = STATES[prefix]
        names = [f for f in tensors if f.startswith(f"{prefix}/")]
        if not names:
            problems.append(f"no {prefix} tensors in the checkpoint")
        for fqn in names:
            name = unescape(fqn[len(prefix) + 1:])
            found = LAYER.match(name)
            key = f"decoder.layers.{found.group(2)}" if found else name
            key = f"optimizer.state.{state}.{key}" if state else key
            grouped.setdefault(key, {})[int(found.group(1)) if found else None] = (fqn, name)
    entries = []
    for key, by_layer in sorted(grouped.items()):
        entry = _entry(key, by_layer, layout, params, tp, tensors, out_dtype, problems)
        if entry is not None:
            entries.append(entry)
    if problems:
        raise LayoutError("cannot export to Megatron: " + summarize(problems))
    return entries


def _entry(key: str, by_layer: dict[int | None, tuple[str, str]], layout: Layout, params: dict[str, Any], tp: int,
           tensors: Any, out_dtype: str | None, problems: list[str]) -> Entry | None:
    """One key's entry: a whole tensor, or its layers stacked, in the target's TP pieces (the
    model in `out_dtype` if given, the optimizer state as saved)."""
    stacked = None not in by_layer
    layers = sorted(layer for layer in by_layer if layer is not None)
    if stacked and layers != list(range(layout.num_layers)):
        problems.append(f"{key}: layers {layers} saved, the layout has {layout.num_layers}")
        return None
    first = tensors[next(iter(by_layer.values()))[0]]
    if len(by_layer) > 1 and not stacked or any(tensors[f].shape != first.shape or tensors[f].dtype != first.dtype
                                                 for f, _ in by_layer.values()):
        problems.append(f"{key}: its layers differ in shape or dtype")
        return None
    chunks = []
    for layer, (fqn, name) in sorted(by_layer.items(), key=lambda item: item[0] or 0):
        for box in _pieces(name, first.shape, params, tp):
            at = Box((layer, *box.offsets), (1, *box.lengths)) if layer is not None else box
            chunks.append(Chunk(at, fqn, box))
    shape = (layout.num_layers, *first.shape) if stacked else first.shape
    dtype = first.dtype if key.startswith("optimizer.") else output_dtype(first.dtype, out_dtype)
    return Entry(key, shape, dtype, tuple(chunks))


def _pieces(name: str, shape: tuple[int, ...], params: dict[str, Any], tp: int) -> list[Box]:
    """The boxes of logical tensor `name` that TP ranks 0..tp-1 hold (a replicated one once)."""
    if name not in params:
        return [Box((0,) * len(shape), shape)]
    param, layer = params[name]
    out: list[Box] = []
    for r in range(tp):
        for part in local_param(param, layer, tp, r).parts:
            if part.name == name and not (part.replicated and r):
                out.append(Box(part.offsets, part.lengths))
    return out


def _extra_states(layout: Layout) -> list[str]:
    """The sharded-object keys of every layer's linear modules' extra state."""
    n = layout.num_layers
    return [f"decoder.layers.{module}._extra_state/shard_{i}_{n}" for i in range(n) for module in EXTRA_STATE]


def _param_groups(source: Source) -> list[dict[str, Any]]:
    """The optimizer's parameter groups for ``common.pt``, from the checkpoint's info.

    Raises:
        LayoutError: none recorded.
    """
    info = source.manifest.info.optimizer
    if info is None or not info.param_groups:
        raise LayoutError(f"{source.loc}: no optimizer parameter groups recorded, which Megatron's optimizer state needs")
    return [dict(g.options) for g in info.param_groups]


def _torch_save(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


class _Planner(DefaultSavePlanner):
    """Write items for every chunk and extra state; each chunk read from the source (its box
    only) when the writer resolves it."""

    def __init__(self, source: Source, entries: list[Entry], objects: list[str], out_dtype: str | None,
                 report: dict[tuple[str, tuple[int, ...]], ExportedTensor]) -> None:
        super().__init__()
        self.source, self.out_dtype, self.report = source, out_dtype, report
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
        saved = self.source.manifest.tensors[chunk.fqn]
        data = self.source.read_box(chunk.fqn, chunk.box)
        tensor = torch.from_numpy(data).view(torch_dtype(saved.dtype)).reshape(chunk.at.lengths)
        out = tensor.to(torch_dtype(entry.dtype)).contiguous()
        name = f"{entry.key}[{', '.join(f'{o}:{o + n}' for o, n in zip(chunk.at.offsets, chunk.at.lengths))}]"
        self.report[(entry.key, chunk.at.offsets)] = ExportedTensor(
            name=name, source=chunk.fqn, shape=list(chunk.at.lengths), source_dtype=saved.dtype, dtype=entry.dtype, file="",
            checksum=checksum_of(byte_view(out)))
        return out


__all__ = ["BACKEND", "Chunk", "Entry", "megatron_writer", "plan_entries"]
