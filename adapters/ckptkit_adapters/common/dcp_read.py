"""The torch DCP container read (no torch): its entries named (`Naming`, `LayoutNaming`), planned
(`plan_conversion`: tensors from entry regions, values as JSON, what is skipped), assembled chunk by chunk
(`assemble`) and written as a ckptkit checkpoint (`write_plan`). The dcp adapter's reader and the megatron
adapter's (Megatron-Core's torch_dist is a DCP save) read through it.
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import JsonValue

from ckptkit.boxes import Box, tiling_problems
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout
from ckptkit.manifest import CheckpointInfo, SourceInfo
from ckptkit.manifest.dtypes import itemsize
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
from ckptkit.state.tree import escape, json_problems, unescape
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.dcp_metadata import (
    DcpMetadata,
    StorageRef,
    TensorMeta,
)
from ckptkit_adapters.common.torchsave import copy_tensor, open_archive, pread_into, stored_tensor, stored_value

TOP_KINDS = {"model": "param", "optim": "optimizer", "optimizer": "optimizer", "rng": "rng", "buffers": "buffer"}


_STEP_FORMATS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}


def fqn_of(key: str) -> str:
    """The ckptkit name of DCP key `key`: split at every ``.``, parts escaped, joined by ``/``."""
    return "/".join(escape(part) for part in key.split("."))


def dcp_key(fqn: str) -> str:
    """The DCP key of ckptkit name `fqn` (the inverse of `fqn_of`)."""
    return ".".join(unescape(part) for part in fqn.split("/"))


def optimizer_prefixes(keys: Iterator[str] | list[str]) -> set[str]:
    """The prefixes under which a torch optimizer state dict was saved (those with
    ``<prefix>.param_groups.<i>.…`` keys; ``""`` for one saved at the top)."""
    out = set()
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts) - 1):
            if parts[i] == "param_groups" and parts[i + 1].isdigit():
                out.add(".".join(parts[:i]))
    return out


def kind_of(key: str, optimizers: set[str]) -> str:
    """The ckptkit kind of the tensor saved under DCP key `key`."""
    if any(key.startswith(f"{p}.state." if p else "state.") for p in optimizers):
        return "optimizer"
    return TOP_KINDS.get(key.split(".", 1)[0], "other")


@dataclass(frozen=True, slots=True)
class Named:
    """A tensor to write, as a naming gives it: its ckptkit name, kind and shape, and the region
    of the DCP entry it is (the whole entry, or e.g. one layer of a layer-stacked tensor)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    region: Box


class Naming:
    """How DCP keys become ckptkit names: split at every ``.`` (`fqn_of`), kinds by `kind_of`.
    A format that stores DCP files under its own conventions (Megatron-Core) overrides it."""

    def start(self, md: DcpMetadata) -> None:
        self.optimizers = optimizer_prefixes(list(md.entries))

    def tensors(self, key: str, meta: TensorMeta) -> list[Named]:
        return [Named(fqn_of(key), kind_of(key, self.optimizers), meta.shape, Box((0,) * len(meta.shape), meta.shape))]

    def value(self, key: str) -> str:
        return fqn_of(key)


class LayoutNaming(Naming):
    """A naming that knows the names a layout gives: a DCP key that is one of them (with ``.``
    for each ``/``: ``model.decoder.layers.0.mlp.linear_fc1.weight``) becomes that name
    (``model/decoder.layers.0.mlp.linear_fc1.weight``), and so does a parameter's bare name at
    the top (``dcp.save(model.state_dict())``, torchtitan's flattened model: ``layers.0.attention.wo.weight``
    is ``model/layers.0.attention.wo.weight``, a parameter); every other key is split at every ``.``."""

    def __init__(self, layout: Layout) -> None:
        self.known: dict[str, tuple[str, str | None]] = {dcp_key(state.fqn(escape(name))): (state.fqn(escape(name)), None)
                      for state in layout.states for name in layout.tensors()}
        params = next((state for state in layout.states if state.role == "param"), None)
        if params is not None:
            for name in layout.tensors():
                self.known.setdefault(name, (params.fqn(escape(name)), "param"))

    def tensors(self, key: str, meta: TensorMeta) -> list[Named]:
        name, kind = self.known.get(key, (fqn_of(key), None))
        return [Named(name, kind or kind_of(key, self.optimizers), meta.shape, Box((0,) * len(meta.shape), meta.shape))]


@dataclass(frozen=True, slots=True)
class Planned:
    """A tensor of the plan: what is written (`spec`), from the `region` of DCP entry `key`."""

    spec: TensorSpec
    key: str
    meta: TensorMeta
    region: Box


@dataclass(frozen=True, slots=True)
class Assembled:
    """A tensor of the plan put together another way than from one entry's region (e.g. from
    flat ranges of several entries): what is written, its bytes (flat, C order) on demand, and
    how many chunks it is read from."""

    spec: TensorSpec
    read: Callable[[], np.ndarray[Any, Any]]
    chunks: int


@dataclass
class Plan:
    """A planned DCP conversion: tensors from entry regions and put together otherwise, values
    (as JSON objects, with their sources), what is skipped and every problem found."""

    tensors: list[Planned] = field(default_factory=list)
    objects: dict[str, JsonValue] = field(default_factory=dict)
    object_sources: dict[str, str] = field(default_factory=dict)
    skipped: list[SkippedEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    assembled: list[Assembled] = field(default_factory=list)


def write_plan(
    fmt: str, src: str, dst: str, md: DcpMetadata, plan: Plan, *, allow_skip: bool, progress: Progress | None,
    started: float, step: int | None = None, info: CheckpointInfo | None = None, layout: Layout | None = None,
    source: SourceInfo | None = None,
) -> ConvertReport:
    """Commit a planned DCP conversion at `dst` and report it as format `fmt`: refuse its
    problems and (without `allow_skip`) its skipped entries, then write every tensor.
    `step` defaults to the optimizer's common step (see `_common_step`); `source` to format
    `fmt` at `src`, its ranks those whose files hold its bytes (`writer_ranks`).

    Raises:
        IntegrityError, ManifestError: as `DcpConverter.convert`.
    """
    if plan.problems:
        raise IntegrityError(f"{src}: {len(plan.problems)} problem(s): " + "; ".join(plan.problems[:10]))
    refuse_skips(plan.skipped, allow_skip=allow_skip, where=src)
    steps: list[float] = []
    planned = {t.spec.name: t for t in plan.tensors}
    other = {t.spec.name: t for t in plan.assembled}

    def read(spec: TensorSpec) -> memoryview:
        data = other[spec.name].read() if spec.name in other else assemble(src, md, planned[spec.name])
        if spec.kind == "optimizer" and spec.name.endswith("/step") and not spec.shape and spec.dtype in _STEP_FORMATS:
            steps.append(struct.unpack(_STEP_FORMATS[spec.dtype], data.tobytes())[0])
        return data.data

    committed = write_converted(dst, [t.spec for t in plan.tensors] + [t.spec for t in plan.assembled], read, objects=plan.objects,
                                step=lambda: _common_step(steps) if step is None else step, info=info, layout=layout,
                                progress=progress, source=source or source_info(fmt, src, ranks=writer_ranks(src)))
    chunks = [(t.spec, chunk_count(t.meta, t.region)) for t in plan.tensors] + [(t.spec, t.chunks) for t in plan.assembled]
    return report_of(fmt, src, committed, chunks, plan.object_sources, plan.skipped, started)


_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def writer_ranks(src: str) -> int | None:
    """How many ranks wrote the save in directory `src`: one ``__<rank>_<i>.distcp`` file (or
    more) each (None when it has none, as a ``HuggingFaceStorageWriter`` save)."""
    ranks = {int(m.group(1)) for n in os.listdir(src) if (m := _RANK_FILE.fullmatch(n))}
    return len(ranks) or None


def chunk_count(meta: TensorMeta, region: Box) -> int:
    """How many non-empty chunks of the entry a region of it is assembled from."""
    return sum(1 for c in meta.chunks if math.prod(c.sizes) and Box(c.offsets, c.sizes).intersect(region) is not None)


def plan_conversion(src: str, md: DcpMetadata, naming: Naming | None = None) -> Plan:
    """Name every entry (by `naming`, default `Naming`), check its chunks and storage, read the
    values; collect what is skipped (with reasons) and every problem (missing or truncated
    files, chunks that do not tile their tensor, chunks with no storage)."""
    naming = naming or Naming()
    naming.start(md)
    plan = Plan()
    sizes = _file_sizes(src, md, plan.problems)
    for (stored_key, _), ref in md.storage.items():
        size = sizes.get(ref.path)
        if size is not None and ref.offset + ref.length > size:
            plan.problems.append(f"{ref.path}: {stored_key} is stored at bytes {ref.offset}-{ref.offset + ref.length}, "
                                 f"past the file's end at {size} (truncated?)")
    for key, meta in md.entries.items():
        if meta is None:
            _plan_value(src, md, key, naming.value(key), plan, sizes)
        else:
            _plan_tensor(md, key, meta, naming.tensors(key, meta), plan)
    chunk_keys = {(key, c.offsets) for key, meta in md.entries.items() if meta is not None for c in meta.chunks}
    value_keys = {(key, None) for key, meta in md.entries.items() if meta is None}
    for index in md.storage:
        if index not in chunk_keys and index not in value_keys:
            where = index[0] if index[1] is None else f"{index[0]} at {list(index[1])}"
            plan.skipped.append(SkippedEntry(name=where, reason="stored bytes that the metadata lists under no entry"))
    return plan


def _file_sizes(src: str, md: DcpMetadata, problems: list[str]) -> dict[str, int]:
    sizes = {}
    for path in sorted({ref.path for ref in md.storage.values()}):
        try:
            fd, size = open_regular(os.path.join(src, path))
        except OSError as exc:
            problems.append(f"{path}: missing or unreadable ({exc}); a rank's file of the checkpoint?")
            continue
        os.close(fd)
        sizes[path] = size
    return sizes


def _plan_tensor(md: DcpMetadata, key: str, meta: TensorMeta, named: list[Named], plan: Plan) -> None:
    dtype = meta.dtype.dtype
    if dtype is None:
        plan.skipped.append(SkippedEntry(name=key, reason=f"dtype torch.{meta.dtype.name} has no ckptkit equivalent"))
        return
    boxes = [Box(c.offsets, c.sizes) for c in meta.chunks]
    plan.problems += [f"{key}: {p}" for p in tiling_problems(meta.shape, boxes)]
    for chunk in meta.chunks:
        ref = md.storage.get((key, chunk.offsets))
        if ref is None:
            plan.problems.append(f"{key}: the chunk at {list(chunk.offsets)} has no storage entry")
        elif ref.transforms:
            plan.skipped.append(SkippedEntry(
                name=key, reason=f"stored with stream transforms {list(ref.transforms)}, which this converter does not read"))
            return
    for n in named:
        source = key if n.region.lengths == meta.shape else f"{key}[{', '.join(f'{o}:{o + k}' for o, k in zip(n.region.offsets, n.region.lengths))}]"
        plan.tensors.append(Planned(TensorSpec(name=n.name, source=source, dtype=dtype, shape=n.shape, kind=n.kind), key, meta,
                                    n.region))


def _plan_value(src: str, md: DcpMetadata, key: str, name: str, plan: Plan, sizes: dict[str, int]) -> None:
    ref = md.storage.get((key, None))
    if ref is None:
        plan.problems.append(f"{key}: the value has no storage entry")
        return
    if ref.path not in sizes or ref.offset + ref.length > sizes[ref.path]:
        return  # already a problem
    if ref.transforms:
        plan.skipped.append(SkippedEntry(name=key, reason=f"stored with stream transforms {list(ref.transforms)}"))
        return
    try:
        with entry_archive(src, ref, key) as archive:
            value = stored_value(archive)
    except ManifestError as exc:  # a class outside the builtins: skipped (and refused without allow_skip)
        plan.skipped.append(SkippedEntry(name=key, reason=str(exc)))
        return
    converted, problem = _to_json(value, key)
    if problem:
        plan.skipped.append(SkippedEntry(name=key, reason=f"not a JSON value ({problem})"))
        return
    plan.objects[name] = converted
    plan.object_sources[name] = key


@contextmanager
def entry_archive(src: str, ref: StorageRef, key: str) -> Iterator[Any]:
    """The ``torch.save`` archive that DCP entry `key` is stored as (its file open meanwhile)."""
    path = os.path.join(src, ref.path)
    fd, _ = open_regular(path)
    try:
        yield open_archive(fd, ref.offset, ref.length, f"{path} ({key})")
    finally:
        os.close(fd)


def _to_json(value: Any, key: str) -> tuple[JsonValue, str]:
    """`value` with tuples as lists, and what keeps it from being JSON ("" when nothing)."""
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    converted = plain(value)
    return converted, "; ".join(json_problems({key: converted})[:3])


def assemble(src: str, md: DcpMetadata, planned: Planned) -> np.ndarray[Any, Any]:
    """Return a planned tensor (flat bytes, C order): its region of its DCP entry, from the
    chunks the region meets. A chunk inside the region is read straight into place; one that
    reaches outside it is read whole and its part copied.

    Raises:
        IntegrityError: a chunk's archive is unreadable or unlike its metadata (dtype, shape).
        ManifestError: a chunk's pickle needs a class outside the tensor allowlist (named).
    """
    spec, key, meta, region = planned.spec, planned.key, planned.meta, planned.region
    width = itemsize(spec.dtype)
    buf = np.empty(math.prod(region.lengths) * width, dtype=np.uint8)
    view = buf.reshape(*region.lengths, width)
    for chunk in meta.chunks:
        box = Box(chunk.offsets, chunk.sizes)
        common = box.intersect(region) if math.prod(chunk.sizes) else None
        if common is None:
            continue
        ref = md.storage[(key, chunk.offsets)]
        into = view[tuple(slice(o - r, o - r + n) for o, r, n in zip(common.offsets, region.offsets, common.lengths))]
        if ref.raw:  # the chunk's elements themselves (a HuggingFaceStorageWriter save)
            into[...] = _raw_chunk(src, ref, chunk.sizes, width)[
                tuple(slice(o - c, o - c + n) for o, c, n in zip(common.offsets, chunk.offsets, common.lengths))]
            continue
        with entry_archive(src, ref, key) as archive:
            stored = stored_tensor(archive)
            if stored.dtype != spec.dtype or stored.shape != chunk.sizes:
                raise IntegrityError(
                    f"{archive.where}: the chunk at {list(chunk.offsets)} holds {stored.dtype}{list(stored.shape)}, "
                    f"the metadata says {spec.dtype}{list(chunk.sizes)}")
            if common == box:
                copy_tensor(archive, stored, into)
                continue
            whole = np.empty((*chunk.sizes, width), dtype=np.uint8)
            copy_tensor(archive, stored, whole)
            into[...] = whole[tuple(slice(o - c, o - c + n) for o, c, n in zip(common.offsets, chunk.offsets, common.lengths))]
    return buf


def _raw_chunk(src: str, ref: StorageRef, sizes: tuple[int, ...], width: int) -> np.ndarray[Any, Any]:
    """A chunk stored as its raw elements, read whole (shape `sizes` plus the element bytes)."""
    path = os.path.join(src, ref.path)
    if ref.length != math.prod(sizes) * width:
        raise IntegrityError(f"{path}: a chunk of {list(sizes)} stored in {ref.length} bytes")
    data = np.empty((*sizes, width), dtype=np.uint8)
    fd, _ = open_regular(path)
    try:
        pread_into(fd, data.reshape(-1).data, ref.offset, path)
    finally:
        os.close(fd)
    return data


def _common_step(steps: list[float]) -> int:
    """The optimizer's step when every parameter's agrees (a whole number), else 0."""
    if steps and all(s == steps[0] for s in steps) and steps[0] >= 0 and float(steps[0]).is_integer():
        return int(steps[0])
    return 0
