"""The zarr form of a checkpoint: one zarr v3 array per logical tensor, with the manifest beside it.

The directory is a zarr v3 group: tensor ``model/layers.0.attn.q.weight`` is the array at that
path (its parents are groups), written by tensorstore, uncompressed, in chunks of whole rows
along dim 0 (at most `chunk_bytes` each). An uncompressed chunk file is the C-order bytes of
its box, the last one padded with zeros to the full chunk: ``manifest.json`` lists every chunk
as a ``raw`` payload file holding one shard, and every ``zarr.json`` as a ``format`` file. So
the zarr form is also an ordinary committed checkpoint: load, reshard, export, diff and verify
read it through the manifest, and any zarr v3 reader (zarr-python, tensorstore) reads the arrays.

Planning (`plan_arrays`, `zarr_metadata`) is pure; `write_array` and `zarr_writer` do the I/O.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptkit import __version__
from ckptkit.boxes import Box
from ckptkit.errors import LayoutError, StorageError, summarize
from ckptkit.exports.formats import CHUNK_BYTES
from ckptkit.exports.source import (
    ExportedFile,
    ExportedTensor,
    Source,
    Writer,
    Written,
    exported,
)
from ckptkit.io.checksum import checksum_of
from ckptkit.io.payload import read_checked
from ckptkit.io.write import hash_padded
from ckptkit.manifest import (
    MANIFEST_NAME,
    BoxShard,
    BoxShards,
    FileEntry,
    Producer,
    TensorEntry,
    manifest_to_json,
)
from ckptkit.manifest.dtypes import itemsize
from ckptkit.storage import Storage, local_path

GROUP_DOC = {"zarr_format": 3, "node_type": "group", "attributes": {}}
# Names the checkpoint's own files take at the top of the directory.
RESERVED_TOP = ("manifest.json", "zarr.json", "tokenizer", "export_report.json", "latest")

# manifest dtype -> zarr v3 data type (bfloat16 and float8 are the zarr extension names tensorstore uses)
ZARR_DTYPES = {
    "float64": "float64", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
    "int64": "int64", "int32": "int32", "int16": "int16", "int8": "int8",
    "uint64": "uint64", "uint32": "uint32", "uint16": "uint16", "uint8": "uint8", "bool": "bool",
}


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk file of an array: its path in the checkpoint, the box it holds, its size with padding."""

    path: str
    box: Box
    size: int


@dataclass(frozen=True, slots=True)
class ArrayPlan:
    """Where tensor `fqn` goes: its array path, chunk rows along dim 0 and chunk files."""

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    chunk_rows: int
    chunks: tuple[Chunk, ...]

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return (self.chunk_rows, *(max(d, 1) for d in self.shape[1:])) if self.shape else ()


def plan_arrays(tensors: dict[str, TensorEntry], chunk_bytes: int = CHUNK_BYTES) -> list[ArrayPlan]:
    """Plan the array of every tensor, in name order.

    Raises:
        LayoutError: a tensor name cannot be a zarr path (or takes a reserved name), or its
            dtype has no zarr data type; every such name is listed.
    """
    problems = [p for fqn in tensors for p in _name_problems(fqn)]
    problems += [f"{fqn}: dtype {t.dtype} has no zarr data type" for fqn, t in tensors.items() if t.dtype not in ZARR_DTYPES]
    if problems:
        raise LayoutError(f"cannot write the zarr form: {len(problems)} problem(s): " + summarize(problems))
    return [_plan_array(fqn, tensors[fqn], chunk_bytes) for fqn in sorted(tensors)]


def _name_problems(fqn: str) -> list[str]:
    parts = fqn.split("/")
    if any(p in ("", ".", "..") or p.startswith("__") or p == "zarr.json" for p in parts):
        return [f"{fqn!r} is not a valid zarr path (empty, '.', '..', 'zarr.json' or '__' segments)"]
    if parts[0] in RESERVED_TOP:
        return [f"{fqn!r} starts with the reserved name {parts[0]!r}"]
    return []


def _plan_array(fqn: str, entry: TensorEntry, chunk_bytes: int) -> ArrayPlan:
    shape = tuple(entry.shape)
    if not shape:
        return ArrayPlan(fqn, shape, entry.dtype, 0, (Chunk(f"{fqn}/c", Box((), ()), itemsize(entry.dtype)),))
    row = math.prod(shape[1:]) * itemsize(entry.dtype)
    rows = max(1, min(shape[0], chunk_bytes // row if row else shape[0]))
    if not row or not shape[0]:
        return ArrayPlan(fqn, shape, entry.dtype, rows, ())  # no elements, no chunk files
    tail = "/0" * (len(shape) - 1)
    chunks = tuple(
        Chunk(f"{fqn}/c/{i}{tail}", Box((i * rows, *(0,) * (len(shape) - 1)), (min(rows, shape[0] - i * rows), *shape[1:])), rows * row)
        for i in range(math.ceil(shape[0] / rows))
    )
    return ArrayPlan(fqn, shape, entry.dtype, rows, chunks)


def zarr_metadata(plan: ArrayPlan) -> dict[str, Any]:
    """The zarr v3 array metadata of a planned array (uncompressed, little-endian, fill value 0)."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(plan.shape),
        "data_type": ZARR_DTYPES[plan.dtype],
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(plan.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "fill_value": False if plan.dtype == "bool" else 0,
    }


def group_paths(plans: list[ArrayPlan]) -> list[str]:
    """Every group of the hierarchy ("" for the root), parents first."""
    groups = {""}
    for plan in plans:
        parts = plan.fqn.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(groups, key=lambda g: (g.count("/") + bool(g), g))


def tensor_entry(plan: ArrayPlan, kind: Any, first_file: int) -> TensorEntry:
    """The manifest entry of an array whose chunk files are numbered from `first_file`."""
    boxes = tuple(
        BoxShard(offsets=c.box.offsets, lengths=c.box.lengths, file=first_file + i, key=plan.fqn)
        for i, c in enumerate(plan.chunks)
    )
    return TensorEntry(shape=plan.shape, dtype=plan.dtype, kind=kind, shards=BoxShards(boxes=boxes))


def chunk_views(plan: ArrayPlan, data: memoryview) -> Iterator[tuple[Chunk, memoryview, int]]:
    """Yield each chunk with its bytes in `data` (the tensor, C order) and its padding length."""
    pos = 0
    for chunk in plan.chunks:
        n = chunk.box.volume * itemsize(plan.dtype)
        yield chunk, data[pos : pos + n], chunk.size - n
        pos += n


def write_array(storage: Storage, root: str, plan: ArrayPlan, data: np.ndarray[Any, Any]) -> list[FileEntry]:
    """Write the array of `plan` under `root` with tensorstore from its bytes `data` (flat, C
    order); return the manifest entries of its chunk files (checksums of the bytes given plus
    padding) and its ``zarr.json`` (read back as tensorstore wrote it).

    Raises:
        StorageError: the storage is not a local directory, or tensorstore failed.
    """
    import tensorstore as ts

    path = f"{root}/{plan.fqn}"
    spec = {
        "driver": "zarr3",
        "kvstore": kvstore(storage, path),
        "metadata": zarr_metadata(plan),
        "create": True,
        # A chunk equal to the fill value (a zero tensor) is written all the same: every chunk
        # the manifest lists exists.
        "store_data_equal_to_fill_value": True,
    }
    try:
        store = ts.open(spec, context=ts.Context({"cache_pool": {"total_bytes_limit": 0}})).result()
        if plan.chunks:
            store.write(typed(data, plan.dtype, plan.shape)).result()
    except ValueError as exc:
        raise StorageError(f"{path}: tensorstore could not write the array: {str(exc).splitlines()[0][:300]}") from exc
    files = []
    for chunk, view, pad in chunk_views(plan, data.data):
        checksum, blocks = hash_padded(view, pad)
        files.append(FileEntry(path=chunk.path, size=chunk.size, checksum=checksum, encoding="raw", blocks=blocks))
    meta = storage.read(f"{root}/{plan.fqn}/zarr.json")
    files.append(FileEntry(path=f"{plan.fqn}/zarr.json", size=len(meta), checksum=checksum_of(meta), role="format"))
    return files


def kvstore(storage: Storage, key: str) -> dict[str, Any]:
    """The tensorstore kvstore spec of `key` under `storage`: a local directory, or S3 (endpoint,
    region and credentials from the standard AWS environment, as for boto3).

    Raises:
        StorageError: another backend.
    """
    from ckptkit.storage.s3 import S3Storage

    if isinstance(storage, S3Storage):
        spec: dict[str, Any] = {"driver": "s3", "bucket": storage.bucket, "path": storage.prefix + key + "/",
                                "aws_credentials": {"type": "environment"}}
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint
        if region:
            spec["aws_region"] = region
        return spec
    return {"driver": "file", "path": local_path(storage, key, "the zarr form")}


def typed(data: np.ndarray[Any, Any], dtype: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """View flat bytes as a numpy array of `dtype` and `shape` (bfloat16 and float8 as the
    ml_dtypes types tensorstore reads)."""
    if dtype in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        kind: Any = getattr(ml_dtypes, dtype)
    else:
        kind = np.dtype(dtype)
    out: np.ndarray[Any, Any] = data.view(kind).reshape(shape)
    return out


def write_groups(storage: Storage, root: str, plans: list[ArrayPlan], attributes: dict[str, Any]) -> list[FileEntry]:
    """Write the ``zarr.json`` of every group (the root's carries `attributes`); return their entries."""
    files = []
    for group in group_paths(plans):
        doc = dict(GROUP_DOC, attributes=attributes if not group else {})
        data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
        rel = f"{group}/zarr.json" if group else "zarr.json"
        storage.write(f"{root}/{rel}", [data])
        files.append(FileEntry(path=rel, size=len(data), checksum=checksum_of(data), role="format"))
    return files


def zarr_writer(source: Source, chunk_bytes: int = CHUNK_BYTES) -> Writer:
    """Plan the zarr form of `source` (failing before any write) and return its writer.

    The writer puts every tensor's array, the groups and the tokenizer files under the
    temporary name; once the export report is there, the manifest goes last (a new checkpoint
    id; step, topology, objects and info as saved).
    """
    try:
        import tensorstore  # noqa: F401
    except ImportError:
        raise LayoutError("the zarr form is written with tensorstore: pip install 'ckptkit[zarr]'") from None
    manifest = source.manifest
    plans = plan_arrays(manifest.tensors, chunk_bytes)

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        files: list[FileEntry] = []
        tensors: dict[str, TensorEntry] = {}
        report: list[ExportedTensor] = []
        source.expect(p.fqn for p in plans)
        for plan, (fqn, data) in zip(plans, source.stream([p.fqn for p in plans], lambda fqn: None)):
            report.append(exported(source, fqn, fqn, data.data, manifest.tensors[fqn].dtype, fqn))
            tensors[fqn] = tensor_entry(plan, manifest.tensors[fqn].kind, len(files))
            files += write_array(dst, tmp, plan, data)
            del data
        attributes = {"ckptkit": {"form": "zarr", "manifest": MANIFEST_NAME, "step": manifest.step,
                                  "source_checkpoint_id": manifest.checkpoint_id}}
        files += write_groups(dst, tmp, plans, attributes)
        for carried in manifest.files:
            if carried.role in ("tokenizer", "asset"):
                dst.write(f"{tmp}/{carried.path}", [read_checked(source.loc, carried)])
                files.append(carried)

        def manifest_of(report_file: ExportedFile) -> bytes:
            listed = (*files, FileEntry(path=report_file.path, size=report_file.size, checksum=report_file.checksum, role="format"))
            form = manifest.model_copy(update={
                "checkpoint_id": uuid.uuid4().hex,
                "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "producer": Producer(ckptkit=__version__, python=platform.python_version()),
                "files": listed, "tensors": tensors, "derived": None,  # the form lists its chunks
            })
            return manifest_to_json(form)

        out = [ExportedFile(path=f.path, size=f.size, checksum=f.checksum) for f in files]
        return Written(report, out, manifest_of)

    return Writer([], write, frozenset(source.manifest.objects))
