"""Summarize a checkpoint: step, topology, tensors and bytes by kind and dtype, assets, versions (no torch)."""

from __future__ import annotations

import math
import os
from collections import Counter

from pydantic import BaseModel, ConfigDict

from ..io.payload import open_checkpoint
from ..manifest.dtypes import itemsize
from ..manifest import CheckpointInfo, Producer, Topology
from ..manifest.shards import shard_count


class InspectReport(BaseModel):
    """What ``ckptkit inspect`` shows, as data."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    checkpoint_id: str
    step: int
    created_at: str
    schema_version: str
    producer: Producer
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

    def render(self) -> str:
        """Return the report as a few readable lines."""
        report = self
        t = report.topology
        lines = [
            f"checkpoint  {report.path}",
            f"step        {report.step}   (id {report.checkpoint_id[:12]}, {report.created_at}, schema {report.schema_version})",
            f"topology    world {t.world_size} = tp {t.tp} x pp {t.pp} x dp {t.dp} x cp {t.cp}, ep {t.ep}, zero {t.zero_stage}",
            f"tensors     {report.tensors} ({report.shards} shards in {report.files} files, "
            f"{human_bytes(report.payload_bytes)} on disk)",
        ]
        for kind, nbytes in report.bytes_by_kind.items():
            lines.append(f"  {kind:<10}{report.tensors_by_kind[kind]:>7} tensors  {human_bytes(nbytes):>11}")
        lines.append("dtypes      " + ", ".join(f"{d} {human_bytes(n)}" for d, n in report.bytes_by_dtype.items()))
        if report.largest_tensor:
            lines.append(f"largest     {report.largest_tensor}")
        info = report.info
        if info.model:
            lines.append(f"model       {info.model.family}")
        if info.optimizer:
            lines.append(f"optimizer   {info.optimizer.type} ({len(info.optimizer.param_groups)} param groups)")
        if info.data_progress:
            d = info.data_progress
            lines.append(f"data        epoch {d.epoch}, {d.consumed_samples} samples, {d.consumed_tokens} tokens consumed")
        lines.append("tokenizer   " + (", ".join(report.tokenizer) if report.tokenizer else "none"))
        code = info.code
        versions = f"ckptkit {report.producer.ckptkit}, torch {report.producer.torch}"
        if code and code.git_commit:
            versions += f", code {code.git_commit[:12]}{' (dirty)' if code.dirty else ''}"
        if info.data and (info.data.dataset_id or info.data.fingerprint):
            versions += f", data {info.data.dataset_id or ''} {(info.data.fingerprint or '')[:16]}".rstrip()
        lines.append(f"versions    {versions}")
        if report.objects:
            lines.append("objects     " + ", ".join(report.objects[:12]) + (" ..." if len(report.objects) > 12 else ""))
        return "\n".join(lines)


def inspect(path: str | os.PathLike[str]) -> InspectReport:
    """Return the summary of the committed checkpoint at `path` (or a root's latest).

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest cannot be read, or is inconsistent with itself.
    """
    loc, m = open_checkpoint(path)
    by_kind: Counter[str] = Counter()
    by_dtype: Counter[str] = Counter()
    count_kind: Counter[str] = Counter()
    shards = 0
    largest: tuple[int, str | None] = (0, None)
    for fqn, t in m.tensors.items():
        nbytes = math.prod(t.shape) * itemsize(t.dtype)
        by_kind[t.kind] += nbytes
        by_dtype[t.dtype] += nbytes
        count_kind[t.kind] += 1
        shards += shard_count(t)
        if nbytes > largest[0] or largest[1] is None:
            largest = (nbytes, fqn)
    return InspectReport(
        path=str(loc),
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
    )


def human_bytes(n: int) -> str:
    """Return `n` bytes as a short human string (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
