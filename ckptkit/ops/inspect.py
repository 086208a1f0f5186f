"""Summarize a checkpoint: step, topology, the model, tensors and bytes by kind and dtype, each tensor and its cut, assets, versions (no torch)."""

from __future__ import annotations

import fnmatch
import math
import os
from collections import Counter
from collections.abc import Hashable
from typing import Any

from pydantic import BaseModel, ConfigDict

from .reports import SkippedEntry
from ..errors import ForeignCheckpointError
from ..io.kinds import Kind, what
from ..io.payload import open_checkpoint
from ..manifest.dtypes import itemsize
from ..manifest import CheckpointInfo, Manifest, Producer, SourceInfo, TensorEntry, Topology
from ..manifest.derived import DerivedShards
from ..manifest.shards import iter_shards, patch_index_dtype, shard_count


class ModelSummary(BaseModel):
    """The model's shape, as the checkpoint's model config (or its layout) gives it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    family: str
    layers: int | None
    hidden_size: int | None
    heads: int | None
    kv_heads: int | None
    vocab_size: int | None
    intermediate_size: int | None
    experts: int | None = None  # a mixture of experts: experts per layer
    top_k: int | None = None  # ... and how many each token uses


class TensorSummary(BaseModel):
    """One saved tensor: its global shape, dtype, kind, bytes, and how its shards cut it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    shape: list[int]
    dtype: str
    kind: str
    bytes: int
    shards: int
    grid: list[int]  # distinct pieces along each dim ([1, 1]: whole)
    cut: str  # the same in words: "whole", "2 x 1", or "7 boxes" where the shards form no grid


# Model config keys by meaning: the reference trainer's, Hugging Face's (Llama, GPT-2), Megatron's.
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "layers": ("num_layers", "num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_heads", "num_attention_heads", "n_head"),
    "kv_heads": ("num_kv_heads", "num_key_value_heads", "num_query_groups"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner"),
    "experts": ("num_experts", "num_local_experts", "num_moe_experts"),
    "top_k": ("top_k", "num_experts_per_tok", "moe_router_topk"),
}


def model_summary(info: CheckpointInfo, layout: dict[str, Any] | None) -> ModelSummary | None:
    """Read the model's shape from the model config of `info`, else the layout's config (pure)."""
    config: dict[str, Any] = dict(layout.get("config") or {}) if layout else {}
    config.update(info.model.config if info.model else {})
    family = info.model.family if info.model else (str(layout.get("name")) if layout else None)
    if family is None:
        return None
    values = {field: next((v for k in keys if type(v := config.get(k)) is int), None) for field, keys in CONFIG_KEYS.items()}
    if values["layers"] is None and layout and type(layout.get("num_layers")) is int and layout["num_layers"]:
        values["layers"] = layout["num_layers"]
    return ModelSummary(family=family, **values)


def tensor_summary(fqn: str, entry: TensorEntry, cut: tuple[int, list[int], str] | None = None) -> TensorSummary:
    """Summarize one tensor and its cut (`tensor_cut`, found here unless given; pure)."""
    count, grid, words = cut or tensor_cut(entry)
    return TensorSummary(name=fqn, shape=list(entry.shape), dtype=entry.dtype, kind=entry.kind,
                         bytes=math.prod(entry.shape) * itemsize(entry.dtype), shards=count, grid=list(grid), cut=words)


def tensor_cut(entry: TensorEntry) -> tuple[int, list[int], str]:
    """A tensor's shard count, the distinct pieces along each dim, and the cut in words."""
    shards = list(iter_shards(entry))
    grid = [len({s.box.offsets[d] for s in shards}) for d in range(len(entry.shape))]
    if len(shards) <= 1:
        cut = "whole"
    elif math.prod(grid) == len(shards):
        cut = " x ".join(str(n) for n in grid)
    else:
        cut = f"{len(shards)} boxes"
    return len(shards), grid, cut


class Borrowed(BaseModel):
    """An earlier checkpoint an incremental save reads unchanged boxes (and earlier patches) from:
    its name, how many of its files, and the bytes of this checkpoint's tensors and patches read
    from them (not written again)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    checkpoint: str
    files: int
    tensor_bytes: int


class InspectReport(BaseModel):
    """What ``ckptkit inspect`` shows, as data."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    source: str
    checkpoint_id: str  # "" for another tool's checkpoint (read_through), as created_at and schema_version
    step: int
    created_at: str
    schema_version: str
    producer: Producer | None  # None: another tool's checkpoint
    topology: Topology
    tensors: int
    shards: int
    files: int
    payload_bytes: int
    tensor_bytes: int
    bytes_by_kind: dict[str, int]
    bytes_by_dtype: dict[str, int]
    tensors_by_kind: dict[str, int]
    largest_tensor: str | None
    objects: list[str]
    tokenizer: list[str]
    info: CheckpointInfo
    model: ModelSummary | None
    tensor_list: list[TensorSummary]  # every tensor (matching the filter), by name
    # Another tool's checkpoint, read through its adapter (nothing converted): the adapter's name,
    # what it is (the kind `ls` names it by), the entries `ckptkit convert` would skip and its warnings.
    read_through: str | None = None
    kind: Kind | None = None
    skipped: list[SkippedEntry] = []
    warnings: list[str] = []
    # An incremental save's: the bytes of its own files, and what it reads from earlier checkpoints.
    owned_bytes: int | None = None
    borrowed: list[Borrowed] = []
    patches: int = 0  # sparse patches over the tensors (an incremental save's), their elements
    patched_elements: int = 0

    def render(self, *, tensors: bool = False) -> str:
        """Return the report as a few readable lines (and, with `tensors`, one per tensor)."""
        report = self
        source = report.info.source
        if report.read_through is None:
            lines = [f"checkpoint  {report.source}",
                     f"step        {report.step}   (id {report.checkpoint_id[:12]}, {report.created_at}, schema {report.schema_version})",
                     f"topology    {_topology_words(report.topology)}"]
            if source is not None:
                lines.append(f"source      {_source_line(source)}")
            lines.append(f"tensors     {report.tensors} ({report.shards} shards in {report.files} files, "
                         f"{human_bytes(report.payload_bytes)} on disk)")
            if report.borrowed:
                saved = sum(b.tensor_bytes for b in report.borrowed)
                lines.append(f"incremental owns {human_bytes(report.owned_bytes or 0)}; reads {human_bytes(saved)} of unchanged "
                             f"tensors and earlier patches from " + ", ".join(f"{b.checkpoint} ({human_bytes(b.tensor_bytes)}, {b.files} "
                                                        f"file{'s' if b.files != 1 else ''})" for b in report.borrowed)
                             + ", not written again")
            if report.patches:
                lines.append(f"patches     {report.patches} over the tensors' boxes, {report.patched_elements} elements "
                             f"(16-bit boxes that changed in few elements)")
        else:
            lines = [f"checkpoint  {report.source}   ({what(report.kind or 'unknown')}, read through the {report.read_through} adapter; "
                     f"`ckptkit convert {report.source} DST` brings it in)",
                     f"step        {report.step}"]
            if source is not None:
                lines.append(f"source      {_source_line(source, path=False)}")
            lines.append(f"tensors     {report.tensors} (in {report.files} files, {human_bytes(report.payload_bytes)} on disk)")
        for kind, nbytes in report.bytes_by_kind.items():
            lines.append(f"  {kind:<10}{report.tensors_by_kind[kind]:>7} tensors  {human_bytes(nbytes):>11}")
        lines.append("dtypes      " + ", ".join(f"{d} {human_bytes(n)}" for d, n in report.bytes_by_dtype.items()))
        if report.largest_tensor:
            lines.append(f"largest     {report.largest_tensor}")
        info = report.info
        if report.model:
            lines.append(f"model       {_model_line(report.model)}")
        if info.optimizer:
            lines.append(f"optimizer   {info.optimizer.type} ({len(info.optimizer.param_groups)} param groups)")
        if info.data_progress:
            d = info.data_progress
            lines.append(f"data        epoch {d.epoch}, {d.consumed_samples} samples, {d.consumed_tokens} tokens consumed")
        lines.append("tokenizer   " + (", ".join(report.tokenizer) if report.tokenizer else "none"))
        code = info.code
        versions = f"ckptkit {report.producer.ckptkit}, torch {report.producer.torch}" if report.producer else ""
        if code and code.git_commit:
            versions += f", code {code.git_commit[:12]}{' (dirty)' if code.dirty else ''}"
        if info.data and (info.data.dataset_id or info.data.fingerprint):
            versions += f", data {info.data.dataset_id or ''} {(info.data.fingerprint or '')[:16]}".rstrip()
        if versions:
            lines.append(f"versions    {versions.removeprefix(', ')}")
        if report.objects:
            lines.append("objects     " + ", ".join(report.objects[:12]) + (" ..." if len(report.objects) > 12 else ""))
        if report.skipped:
            lines.append(f"skipped     {len(report.skipped)} entr{'y' if len(report.skipped) == 1 else 'ies'} convert would refuse "
                         f"without --allow-skip: " + "; ".join(f"{e.name}: {e.reason}" for e in report.skipped[:5]) + (" ..." if len(report.skipped) > 5 else ""))
        lines += [f"warning     {w}" for w in report.warnings]
        if tensors:
            lines += _tensor_lines(report.tensor_list)
        return "\n".join(lines)


def _topology_words(t: Topology) -> str:
    return f"world {t.world_size} = tp {t.tp} x pp {t.pp} x dp {t.dp} x cp {t.cp}, ep {t.ep}, zero {t.zero_stage}"


def _source_line(s: SourceInfo, *, path: bool = True) -> str:
    """Where a converted checkpoint came from (or what another tool's is), in one line."""
    what = s.format + (f" {s.version}" if s.version else "") + (f" at {s.path}" if path else "")
    if s.topology is not None:
        return f"{what}, {_topology_words(s.topology)}"
    return what + (f", files of {s.ranks} rank{'s' if s.ranks != 1 else ''}" if s.ranks else "")


def _model_line(m: ModelSummary) -> str:
    parts = [f"{m.layers} layers" if m.layers is not None else None,
             f"hidden {m.hidden_size}" if m.hidden_size is not None else None,
             (f"{m.heads} heads" + (f" ({m.kv_heads} kv)" if m.kv_heads is not None else "")) if m.heads is not None else None,
             f"vocabulary {m.vocab_size}" if m.vocab_size is not None else None,
             f"intermediate {m.intermediate_size}" if m.intermediate_size is not None else None,
             (f"{m.experts} experts" + (f" (top {m.top_k})" if m.top_k else "")) if m.experts else None]
    shown = [p for p in parts if p]
    return m.family + (": " + ", ".join(shown) if shown else "")


def _tensor_lines(tensors: list[TensorSummary]) -> list[str]:
    width = max((len(t.name) for t in tensors), default=0)
    out = [f"tensors     {len(tensors)} listed: name, dtype, shape, kind, bytes, cut"]
    for t in tensors:
        shape = "[" + ", ".join(str(n) for n in t.shape) + "]"
        out.append(f"  {t.name:<{width}}  {t.dtype:<8} {shape:<14} {t.kind:<9} {human_bytes(t.bytes):>10}  {t.cut}")
    return out


def inspect(path: str | os.PathLike[str], *, match: str = "*") -> InspectReport:
    """Return the summary of the committed checkpoint at `path` (or a root's latest), listing
    the tensors whose names match the glob `match`.

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest cannot be read, or is inconsistent with itself.
    """
    try:
        loc, m = open_checkpoint(path)
    except ForeignCheckpointError as exc:
        return _foreign(exc, match)
    return summarize(str(loc), m, match)


def _foreign(exc: ForeignCheckpointError, match: str) -> InspectReport:
    """Another tool's checkpoint, read through its adapter as ``convert`` reads it (metadata and
    scalars only), nothing written."""
    from .convert import survey  # the adapters' readers, imported only for another tool's checkpoint

    found = survey(exc.path)
    report = summarize(exc.path, found.manifest, match)
    return report.model_copy(update={
        "checkpoint_id": "", "created_at": "", "schema_version": "", "producer": None, "files": found.files,
        "payload_bytes": found.file_bytes, "shards": 0, "read_through": found.format,
        "kind": exc.kind, "warnings": found.report.warnings,
        "skipped": list(found.report.skipped)})


def summarize(path: str, m: Manifest, match: str = "*") -> InspectReport:
    """The summary of the checkpoint the manifest `m` describes (found at `path`), listing the
    tensors whose names match the glob `match` (pure: reads nothing but `m`)."""
    by_kind: Counter[str] = Counter()
    by_dtype: Counter[str] = Counter()
    count_kind: Counter[str] = Counter()
    shards = 0
    largest: tuple[int, str | None] = (0, None)
    listed: list[TensorSummary] = []
    derived: dict[Hashable, tuple[int, list[int], str]] = {}  # a derived tensor's cut, once per boxes key
    for fqn, t in m.tensors.items():
        nbytes = math.prod(t.shape) * itemsize(t.dtype)
        by_kind[t.kind] += nbytes
        by_dtype[t.dtype] += nbytes
        count_kind[t.kind] += 1
        cut = None
        if isinstance(t.shards, DerivedShards):  # found by a rule's sweep: tensors cut alike share it
            key = t.shards.source.boxes_key(fqn)
            cut = derived.get(key)
            if cut is None:
                cut = derived[key] = tensor_cut(t)
        if fnmatch.fnmatchcase(fqn, match):
            listed.append(tensor_summary(fqn, t, cut))
            shards += listed[-1].shards
        else:
            shards += cut[0] if cut is not None else shard_count(t)
        if nbytes > largest[0] or largest[1] is None:
            largest = (nbytes, fqn)
    return InspectReport(
        source=path,
        checkpoint_id=m.checkpoint_id,
        step=m.step,
        created_at=m.created_at,
        schema_version=m.schema_version,
        producer=m.producer,
        topology=m.topology,
        tensors=len(m.tensors),
        shards=shards,
        files=len(m.files),
        payload_bytes=sum(f.size for f in m.files),
        tensor_bytes=sum(by_kind.values()),
        bytes_by_kind=dict(sorted(by_kind.items())),
        bytes_by_dtype=dict(sorted(by_dtype.items())),
        tensors_by_kind=dict(sorted(count_kind.items())),
        largest_tensor=largest[1],
        objects=sorted(m.objects),
        tokenizer=list(m.tokenizer.files) if m.tokenizer else [],
        info=m.info,
        model=model_summary(m.info, m.layout),
        tensor_list=sorted(listed, key=lambda t: t.name),
        owned_bytes=sum(f.size for f in m.files if f.base is None) if m.bases() else None,
        borrowed=_borrowed(m),
        patches=sum(len(t.patches) for t in m.tensors.values()),
        patched_elements=sum(p.count for t in m.tensors.values() for p in t.patches),
    )


def _borrowed(m: Manifest) -> list[Borrowed]:
    """What the checkpoint reads from each earlier checkpoint (none unless saved incrementally)."""
    if not m.bases():
        return []
    nbytes: Counter[str] = Counter()
    for t in m.tensors.values():
        size = itemsize(t.dtype)
        for shard in iter_shards(t):
            base = m.files[shard.file].base
            if base is not None:
                nbytes[base] += shard.box.volume * size
        for patch in t.patches:
            base = m.files[patch.file].base
            if base is not None:
                nbytes[base] += patch.count * (itemsize(patch_index_dtype(patch)) + size)
    files = Counter(f.base for f in m.files if f.base is not None)
    return [Borrowed(checkpoint=b, files=files[b], tensor_bytes=nbytes[b]) for b in m.bases()]


def human_bytes(n: int) -> str:
    """Return `n` bytes as a short human string (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
