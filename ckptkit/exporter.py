"""Export a checkpoint (any topology) to portable full weights: Hugging Face safetensors shards.

Call order: open the source and map every parameter to its output name (an unmapped or
missing tensor fails before anything is written); plan the output files; then stream the
tensors one at a time (each read whole from whatever boxes hold it, converted, written) into
a temporary directory, add the index, configs, tokenizer and the export report, and rename
it into place. The same logical state gives byte-identical files whatever topology saved it.
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from collections.abc import Iterator
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from . import hf
from .catalog import Location, discard, locate, refuse_nesting, temp_name
from .checksum import Hasher, checksum_of
from .dtypes import itemsize
from .errors import CheckpointExistsError, LayoutError, StorageError
from .loader import fill
from .manifest import Manifest, Topology
from .payload import open_checkpoint, read_checked
from .safetensors_format import build_header
from .sharded import ShardedTensor
from .storage import Storage
from .torch_io import byte_view, torch_dtype

REPORT_NAME = "export_report.json"
DEFAULT_MAX_SHARD = 5 * 10**9


class ExportedTensor(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    source: str
    shape: list[int]
    source_dtype: str
    dtype: str
    file: str
    checksum: str


class ExportedFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    size: int
    checksum: str


class ExportReport(BaseModel):
    """What ``ckptkit export --json`` prints, also written as ``export_report.json`` in DST."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: str
    dtype: str
    source: str
    source_checkpoint_id: str
    step: int
    source_topology: Topology
    destination: str
    tensors: list[ExportedTensor]
    files: list[ExportedFile]
    skipped: list[str]


def parse_size(text: str) -> int:
    """Parse a size such as ``5GB``, ``500MB``, ``2GiB`` or a plain number of bytes.

    Raises:
        LayoutError: the text is not a positive size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
    if not match or match.group(2) not in units or float(match.group(1)) <= 0:
        raise LayoutError(f"{text!r} is not a size (examples: 5GB, 500MB, 2GiB, 1000000)")
    return int(float(match.group(1)) * units[match.group(2)])


def export(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str = "hf",
    dtype: str = "bf16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD,
    storage: Storage | None = None,
    dst_storage: Storage | None = None,
) -> ExportReport:
    """Export the model weights of the checkpoint at `src` to the directory `dst`.

    ``format="hf"``: a Hugging Face Llama directory (``config.json``, ``generation_config.json``,
    ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, the tokenizer).
    Weights come from the checkpoint's parameters (the fp32 master weights the reference
    trainer saves), converted to `dtype` (bf16, fp16 or fp32) with round-to-nearest-even.

    Raises:
        LayoutError: the model family has no export, or a parameter is unmapped or missing
            (all are listed); nothing is written.
        CheckpointExistsError: something exists at `dst`.
        IntegrityError, StorageError: reading or writing failed; `dst` does not appear.
    """
    if format != "hf":
        raise LayoutError(f"export format {format!r} is not available; available: hf")
    if dtype not in hf.DTYPES:
        raise LayoutError(f"dtype {dtype!r} is not one of {', '.join(hf.DTYPES)}")
    src_loc, manifest = open_checkpoint(src, storage)
    model = _llama_config(manifest, str(src_loc))
    from .trainer.config import ModelConfig
    from .trainer.layout import logical_param_names

    names = hf.name_map(manifest.tensors, logical_param_names(ModelConfig(**model)))
    out_dtype = hf.DTYPES[dtype]
    sizes = {names[fqn]: manifest.tensors[fqn].shape for fqn in names}
    nbytes = {name: math.prod(shape) * itemsize(out_dtype) for name, shape in sizes.items()}
    shards = hf.plan_shards(nbytes, max_shard_bytes)
    dst_loc = locate(dst, dst_storage)
    refuse_nesting(src_loc, dst_loc)
    if dst_loc.storage.exists(dst_loc.name):
        raise CheckpointExistsError(f"{dst_loc}: already exists; choose another path or remove it")
    tmp = temp_name(dst_loc.name, uuid.uuid4().hex[:12])
    source_of = {name: fqn for fqn, name in names.items()}
    try:
        tensors: list[ExportedTensor] = []
        files = [_write_shard(src_loc, manifest, dst_loc.storage, tmp, shard, source_of, out_dtype, tensors) for shard in shards]
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {name: shard.file for shard in shards for name in shard.names}}
        extra = {
            "model.safetensors.index.json": index,
            "config.json": hf.config_json(model, out_dtype),
            "generation_config.json": hf.generation_config_json(_eos_id(src_loc, manifest)),
        }
        copied, tokenizer_extra = _tokenizer_files(src_loc, manifest, dst_loc.storage, tmp, model)
        files += copied
        extra.update(tokenizer_extra)
        for path, doc in extra.items():
            data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            dst_loc.storage.write(f"{tmp}/{path}", [data])
            files.append(ExportedFile(path=path, size=len(data), checksum=checksum_of(data)))
        skipped = sorted(fqn for fqn in manifest.tensors if fqn not in names)
        report = ExportReport(
            format=format, dtype=out_dtype, source=str(src_loc), source_checkpoint_id=manifest.checkpoint_id,
            step=manifest.step, source_topology=manifest.topology, destination=str(dst_loc),
            tensors=tensors, files=sorted(files, key=lambda f: f.path), skipped=skipped,
        )
        dst_loc.storage.write(f"{tmp}/{REPORT_NAME}", [report.model_dump_json(indent=2).encode()])
        dst_loc.storage.rename(tmp, dst_loc.name)
    except BaseException as exc:
        discard(dst_loc.storage, tmp)
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise StorageError(f"{dst_loc}: export failed, nothing written: {exc}") from exc
        raise
    return report


def _llama_config(manifest: Manifest, where: str) -> dict[str, Any]:
    model = manifest.info.model
    if model is None or model.family != "llama":
        family = "no model (info.model)" if model is None else f"model family {model.family!r}"
        raise LayoutError(f"{where}: the checkpoint names {family}; export knows the family llama")
    return dict(model.config)


def _write_shard(
    src_loc: Location, manifest: Manifest, dst: Storage, tmp: str, shard: hf.Shard, source_of: dict[str, str],
    out_dtype: str, report: list[ExportedTensor],
) -> ExportedFile:
    header, _ = build_header([(name, out_dtype, manifest.tensors[source_of[name]].shape) for name in shard.names], {"format": "pt"})
    hasher = Hasher()

    def chunks() -> Iterator[memoryview]:
        hasher.update(header)
        yield memoryview(header)
        for name in shard.names:
            fqn = source_of[name]
            entry = manifest.tensors[fqn]
            whole = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
            fill(src_loc, manifest, {fqn: [ShardedTensor(whole, entry.shape, (0,) * len(entry.shape))]})
            out = whole.to(torch_dtype(out_dtype)).contiguous()
            del whole
            view = byte_view(out)
            hasher.update(view)
            report.append(ExportedTensor(name=name, source=fqn, shape=list(entry.shape), source_dtype=entry.dtype,
                                         dtype=out_dtype, file=shard.file, checksum=checksum_of(view)))
            yield view

    size = dst.write(f"{tmp}/{shard.file}", chunks())
    return ExportedFile(path=shard.file, size=size, checksum=hasher.digest())


def _tokenizer_files(
    src_loc: Location, manifest: Manifest, dst: Storage, tmp: str, model: dict[str, Any]
) -> tuple[list[ExportedFile], dict[str, Any]]:
    """Copy the checkpoint's tokenizer files (checked) to the output; return them and the JSON
    files to add (a ``tokenizer_config.json`` when the checkpoint has none)."""
    copied: dict[str, bytes] = {}
    files: list[ExportedFile] = []
    for entry in manifest.files:
        if entry.role != "tokenizer":
            continue
        data = read_checked(src_loc, entry)
        name = entry.path.removeprefix("tokenizer/")
        dst.write(f"{tmp}/{name}", [data])
        copied[name] = data
        files.append(ExportedFile(path=name, size=len(data), checksum=entry.checksum))
    if "tokenizer.json" in copied and "tokenizer_config.json" not in copied:
        config = hf.tokenizer_config_json(json.loads(copied["tokenizer.json"]), model["max_seq_len"])
        return files, {"tokenizer_config.json": config}
    return files, {}


def _eos_id(src_loc: Location, manifest: Manifest) -> int | None:
    for entry in manifest.files:
        if entry.path == "tokenizer/tokenizer.json":
            vocab = json.loads(src_loc.storage.read(src_loc.key(entry.path))).get("model", {}).get("vocab", {})
            eos = vocab.get("<eos>")
            return eos if isinstance(eos, int) else None
    return None
