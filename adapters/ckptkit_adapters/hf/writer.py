"""The Hugging Face writer: a model directory of safetensors shards, its index, configs and tokenizer.

``hf_writer`` plans the whole export (names, shapes, shards; an unmapped tensor or a dtype it
cannot convert fails here, before any write) and returns the writer that streams each source
tensor once, cut into the rows each Hugging Face tensor takes (see ``hf`` for the names and
configs), then adds the index, ``config.json``, ``generation_config.json`` and the tokenizer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from ckptkit.errors import LayoutError
from ckptkit.exports.convert import CONVERSIONS
from ckptkit.exports.source import ExportedFile, ExportedTensor, Source, Writer, Written, exported
from ckptkit.io.checksum import checksum_of
from ckptkit.io.payload import read_checked
from ckptkit.io.write import write_safetensors
from ckptkit.layouts import Layout, layout_for
from ckptkit.manifest.dtypes import itemsize
from ckptkit.models.compose import Run
from ckptkit.models.reference import model_of
from ckptkit.storage import Storage
from ckptkit_adapters.hf import mapping as hf
from ckptkit_adapters.hf.view import TIED_WEIGHTS


def hf_writer(source: Source, dtype: str | None, max_shard_bytes: int, layout: Layout | None = None) -> Writer:
    """Plan the HF export (failing before any write) and return its writer: the weights in
    `dtype`, or (None) in the dtype they are saved in. `layout` overrides the one the checkpoint
    records."""
    manifest = source.manifest
    layout = layout or layout_for(manifest, where=str(source.loc))
    carried = manifest.info.config or {}
    try:
        found = carried.get("config.json")
        spec, view = model_of(layout, found if isinstance(found, dict) else None)
        runs = hf.hf_runs(manifest.tensors, spec, view)
    except LayoutError as e:
        raise LayoutError(f"{source.loc}: {e}") from None
    sources = {r.fqn for rs in runs.values() for r in rs}
    out_dtype = dtype or _saved_dtype(source, sources)
    config = hf.config_json(spec, out_dtype)
    generation = carried.get("generation_config.json") if hf.passthrough(layout) else None
    max_len = config.get("max_position_embeddings") or config.get("n_positions") or 2048
    shapes = {name: _shape(manifest.tensors[rs[0].fqn].shape, rs) for name, rs in runs.items()}
    nbytes = {name: math.prod(shape) * itemsize(out_dtype) for name, shape in shapes.items()}
    shards = hf.plan_shards(nbytes, max_shard_bytes)
    odd = sorted(f"{fqn} ({manifest.tensors[fqn].dtype})" for fqn in sources if (manifest.tensors[fqn].dtype, out_dtype) not in CONVERSIONS
                 and manifest.tensors[fqn].dtype != out_dtype)
    if odd:
        raise LayoutError(f"export converts float32, bfloat16 and float16 weights; {len(odd)} are not: " + ", ".join(odd[:10]))

    def write(source: Source, dst: Storage, tmp: str, rank: int = 0, ranks: int = 1) -> Written:
        """Write shards rank, rank + ranks, ... and (rank 0) the index, configs and tokenizer."""
        tensors: list[ExportedTensor] = []
        mine = shards[rank::ranks]
        feed = _Sources(source, [r.fqn for shard in mine for n in shard.names for r in runs[n]], out_dtype)
        files = [_write_shard(source, dst, tmp, shard, runs, shapes, feed, out_dtype, tensors) for shard in mine]
        if rank:
            return Written(tensors, files)
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {name: shard.file for shard in shards for name in shard.names}}
        extra = {
            "model.safetensors.index.json": index,
            "config.json": config,
            "generation_config.json": generation if isinstance(generation, dict) else hf.generation_config_json(_eos_id(source)),
        }
        copied, tokenizer_extra = _tokenizer_files(source, dst, tmp, max_len)
        files += copied
        extra.update(tokenizer_extra)
        for path, doc in extra.items():
            data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            dst.write(f"{tmp}/{path}", [data])
            files.append(ExportedFile(path=path, size=len(data), checksum=checksum_of(data)))
        return Written(tensors, files)

    tied = frozenset({TIED_WEIGHTS} & set(manifest.objects))  # the tie is the config's tie_word_embeddings
    return Writer(sorted(fqn for fqn in manifest.tensors if fqn not in sources), write, tied, write_part=write)


def _saved_dtype(source: Source, fqns: set[str]) -> str:
    """The one dtype the exported weights are saved in (what an export writes unless asked otherwise).

    Raises:
        LayoutError: they are saved in several.
    """
    dtypes = sorted({source.manifest.tensors[fqn].dtype for fqn in fqns})
    if len(dtypes) != 1:
        raise LayoutError(f"{source.loc}: the weights are saved in {', '.join(dtypes)}; say which to write with --dtype")
    return dtypes[0]


def _shape(shape: tuple[int, ...], runs: list[Run]) -> tuple[int, ...]:
    """The shape of a tensor made of `runs` of rows of tensors of `shape` (all of one, as it is)."""
    rows = sum(r.count for r in runs)
    return shape if len(runs) == 1 and rows == (shape[0] if shape else 1) else (rows, *shape[1:])


class _Sources:
    """The source tensors of the exported ones, in the order they are needed: each read (and
    converted) once, and kept only until its last exported tensor (q, k and v of a fused
    tensor) has taken its rows."""

    def __init__(self, source: Source, needed: list[str], dtype: str) -> None:
        self.uses: dict[str, int] = {}
        for fqn in needed:
            self.uses[fqn] = self.uses.get(fqn, 0) + 1
        source.expect(self.uses)
        self.stream = source.stream(list(self.uses), lambda fqn: dtype)  # first-use order
        self.held: dict[str, Any] = {}

    def take(self, fqn: str) -> Any:
        if fqn not in self.held:
            got, data = next(self.stream)
            assert got == fqn
            self.held[fqn] = data
        data = self.held[fqn]
        self.uses[fqn] -= 1
        if not self.uses[fqn]:
            del self.held[fqn]
        return data


def _write_shard(
    source: Source, dst: Storage, tmp: str, shard: hf.Shard, runs: dict[str, list[Run]], shapes: dict[str, tuple[int, ...]],
    feed: _Sources, out_dtype: str, report: list[ExportedTensor],
) -> ExportedFile:
    """Write one safetensors shard from its tensors' sources, each cut to its rows."""
    manifest = source.manifest

    def bodies() -> Iterator[memoryview]:
        for name in shard.names:
            parts = []
            for r in runs[name]:
                data = feed.take(r.fqn)
                shape = manifest.tensors[r.fqn].shape
                if len(runs[name]) > 1 or r.count != (shape[0] if shape else 1):  # runs of rows of fused tensors, in order
                    data = data.reshape(shape[0], -1)[r.src_row:r.src_row + r.count].reshape(-1)
                parts.append(data)
            view = memoryview(parts[0] if len(parts) == 1 else np.concatenate(parts))  # type: ignore[arg-type]
            fqns = list(dict.fromkeys(r.fqn for r in runs[name]))
            report.append(exported(source, name, fqns[0], view, out_dtype, shard.file, shapes[name], " + ".join(fqns)))
            yield view

    tensors = [(name, out_dtype, shapes[name]) for name in shard.names]
    written = write_safetensors(dst, f"{tmp}/{shard.file}", shard.file, tensors, bodies(), metadata={"format": "pt"},
                                blocks=False)
    return ExportedFile(path=shard.file, size=written.size, checksum=written.checksum)


def _tokenizer_files(
    source: Source, dst: Storage, tmp: str, max_len: int
) -> tuple[list[ExportedFile], dict[str, Any]]:
    """Copy the checkpoint's tokenizer files (checked) to the output; return them and the JSON
    files to add (a ``tokenizer_config.json`` when the checkpoint has none)."""
    copied: dict[str, bytes] = {}
    files: list[ExportedFile] = []
    for entry in source.manifest.files:
        if entry.role != "tokenizer":
            continue
        data = read_checked(source.loc, entry)
        name = entry.path.partition("tokenizer/")[2]  # a save to an object store prefixes its paths
        dst.write(f"{tmp}/{name}", [data])
        copied[name] = data
        files.append(ExportedFile(path=name, size=len(data), checksum=entry.checksum))
    if "tokenizer.json" in copied and "tokenizer_config.json" not in copied:
        config = hf.tokenizer_config_json(json.loads(copied["tokenizer.json"]), max_len)
        return files, {"tokenizer_config.json": config}
    return files, {}


def _eos_id(source: Source) -> int | None:
    for entry in source.manifest.files:
        if entry.role == "tokenizer" and entry.path.endswith("tokenizer/tokenizer.json"):
            vocab = json.loads(read_checked(source.loc, entry)).get("model", {}).get("vocab", {})
            eos = vocab.get("<eos>")
            return eos if isinstance(eos, int) else None
    return None
