"""Export a checkpoint (any topology) to portable full weights: Hugging Face, torch DCP, zarr,
Megatron-Core, a DeepSpeed universal checkpoint.

Call order: open the source and plan the output (an unmapped or missing tensor fails before
anything is written); then stream the tensors one at a time (each read whole from whatever
boxes hold it, converted, written) into a temporary directory, add the format's other files
and the export report, and commit it as a checkpoint is committed (``ckptkit.io.commit``). The same logical state gives byte-identical
files whatever topology saved it. The Hugging Face writer is here; ``export_dcp`` and
``zarr_form`` hold the others.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import hf
from .convert import CONVERSIONS
from ..io.catalog import locate, refuse_nesting, still_committed
from ..io.commit import REPORT_NAME, commit, discard, staging
from ..io.checksum import checksum_of
from ..io.write import write_safetensors
from ..manifest.dtypes import itemsize
from ..errors import CheckpointExistsError, CkptkitError, LayoutError, StorageError
from .source import (
    ExportedFile,
    ExportedTensor,
    ExportReport,
    Source,
    Writer,
    Written,
    exported,
    report_bytes,
)
from ..layouts import Layout, layout_for
from ..io.payload import open_checkpoint, read_checked
from ..ops.convert import Progress
from ..storage import Storage
from .zarr_form import CHUNK_BYTES

__all__ = ["REPORT_NAME", "ExportReport", "export"]

DEFAULT_MAX_SHARD = 5 * 10**9


FORMATS = ("hf", "dcp", "zarr", "megatron", "deepspeed")
DCP_FORMS = ("fsdp2", "plain")


def export(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    format: str = "hf",
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD,
    include_optimizer: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
    storage: Storage | None = None,
    dst_storage: Storage | None = None,
    layout: Layout | None = None,
    progress: Progress | None = None,
    tp: int = 1,
    pp: int = 1,
    dcp_form: str | None = None,
    ep: int = 1,
) -> ExportReport:
    """Export the checkpoint at `src` to the directory `dst` in `format`.

    - ``hf``: a Hugging Face Llama directory (``config.json``, ``generation_config.json``,
      ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, the tokenizer).
      Weights come from the checkpoint's parameters (the fp32 master weights the reference
      trainer saves), converted to `dtype` (default bf16) with round-to-nearest-even. A
      checkpoint converted from Hugging Face (layout ``hf-llama`` or ``gpt2``) is written back
      under its original names with the ``config.json`` and ``generation_config.json`` it carries.
      A Megatron-Core GPT (layout ``megatron-gpt``, given as `layout` when the converted
      checkpoint records none) becomes a LlamaForCausalLM: q, k, v and gate, up are cut out of
      Megatron's fused tensors. The reference trainer's mixture of experts (layout
      ``llama-moe``) becomes a MixtralForCausalLM, its experts under the Hub's per-expert names.
    - ``dcp``: a torch.distributed.checkpoint directory, in their saved dtype unless `dtype` is
      given, in one of two forms (`dcp_form`; by default ``fsdp2`` for a checkpoint of the
      reference trainer's model, ``plain`` for any other). ``fsdp2``: the state dict
      ``get_state_dict(model, optimizer)`` gives for the reference trainer's model wrapped with
      FSDP2, as ``{"model": ..., "optim": ...}`` (module fqns, fused q/k/v and gate/up; with
      `include_optimizer` each parameter's moments and step and the AdamW parameter groups),
      which an FSDP2 job at any world size loads with ``dcp.load`` + ``set_state_dict`` (see
      ``ckptkit.exports.fsdp2``); layout ``llama`` only. ``plain``: any checkpoint's tensors
      under its own names (``model.<name>`` and, with `include_optimizer`,
      ``optimizer.exp_avg.<name>``, ...), for ``dcp.load`` into a plain state dict.
    - ``megatron``: a Megatron-Core ``dist_checkpointing`` directory (``torch_dist``) that
      megatron-core loads into a ``GPTModel`` at any TP/PP (see ``ckptkit.exports.megatron``):
      layers stacked, each chunk a TP rank's piece as megatron-core at `tp` x `pp` writes it
      (a target the layout must allow, `ep` too for a mixture of experts), with
      `include_optimizer` the distributed optimizer's ``fully_reshardable`` state; the layout
      is ``megatron-gpt`` (recorded, or `layout`), or the reference trainer's ``llama`` (with
      its optimizer state if asked) or ``llama-moe`` (model only: megatron-core's MoE layer,
      ``SequentialMLP`` experts).
    - ``deepspeed``: a DeepSpeed universal checkpoint (see ``ckptkit.exports.deepspeed``): each
      parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq`` whole under ``<tag>/zero/<name>/``,
      the model-states file and ``latest_universal``, which an engine with ``"checkpoint":
      {"load_universal": true}`` loads at ZeRO 1 or 2 and any data-parallel size; the source
      must be a checkpoint converted from DeepSpeed; the optimizer state always comes along,
      `dtype` must be None.
    - ``zarr``: the topology-free form (see ``ckptkit.exports.zarr_form``): every tensor as a zarr v3
      array with the manifest beside it, bit for bit; `dtype` must be None.

    Every format writes ``export_report.json`` (each tensor's source, dtypes and checksum, each
    file, the tensors left out). Tensors stream one at a time; `dst` appears only when complete.
    `progress` is called with (bytes read, bytes to read) as the source tensors are read.

    Raises:
        LayoutError: an unknown format or dtype, a model family with no HF export, or tensors
            that cannot be mapped (all are listed); nothing is written.
        CheckpointExistsError: something exists at `dst`.
        IntegrityError, StorageError: reading or writing failed; `dst` does not appear.
    """
    if format not in FORMATS:
        raise LayoutError(f"export format {format!r} is not available; available: {', '.join(FORMATS)}")
    if dtype is not None and dtype not in hf.DTYPES:
        raise LayoutError(f"dtype {dtype!r} is not one of {', '.join(hf.DTYPES)}")
    if format == "zarr" and dtype is not None:
        raise LayoutError("the zarr form keeps every tensor in its saved dtype; drop --dtype")
    if format == "deepspeed" and dtype is not None:
        raise LayoutError("the deepspeed format keeps the fp32 masters and moments, and the module in its saved dtype; drop --dtype")
    if format == "hf" and include_optimizer:
        raise LayoutError("the hf format holds model weights only; --include-optimizer applies to dcp and megatron")
    if format not in ("hf", "megatron") and layout is not None:
        raise LayoutError("a layout names the model for the hf and megatron formats; dcp, zarr and deepspeed keep the checkpoint's names")
    if format != "megatron" and (tp, pp, ep) != (1, 1, 1):
        raise LayoutError("--tp, --pp and --ep set the pieces of the megatron format; the other formats hold whole tensors")
    if dcp_form is not None and (format != "dcp" or dcp_form not in DCP_FORMS):
        raise LayoutError(f"dcp_form {dcp_form!r}: the dcp format's forms are {', '.join(DCP_FORMS)}; other formats have none")
    form = dcp_form if format == "dcp" else None
    out_dtype = hf.DTYPES[dtype or "bf16"] if format == "hf" else hf.DTYPES[dtype] if dtype else None
    started = time.perf_counter()
    src_loc, manifest = open_checkpoint(src, storage)
    with Source(src_loc, manifest, progress=progress) as source, still_committed(src_loc):
        return _export(source, dst, format, out_dtype, max_shard_bytes, include_optimizer, chunk_bytes, dst_storage, started,
                       layout, (tp, pp, ep), form)


def _export(
    source: Source, dst: str | os.PathLike[str], format: str, out_dtype: str | None, max_shard_bytes: int,
    include_optimizer: bool, chunk_bytes: int, dst_storage: Storage | None, started: float, layout: Layout | None = None,
    target: tuple[int, int, int] = (1, 1, 1), form: str | None = None,
) -> ExportReport:
    src_loc, manifest = source.loc, source.manifest
    writer: Writer
    if format == "hf":
        writer = _hf_writer(source, out_dtype or hf.DTYPES["bf16"], max_shard_bytes, layout)
    elif format == "dcp" and (form or _dcp_form(manifest, str(src_loc))) == "fsdp2":
        from .fsdp2 import fsdp2_writer

        form = "fsdp2"
        try:
            model = layout_for(manifest, where=str(src_loc))
        except LayoutError:
            raise LayoutError(f"{src_loc}: the fsdp2 form names the parameters as the reference trainer's model (layout llama), "
                              "and the checkpoint names no model; export with --dcp-form plain (the checkpoint's own names)") from None
        writer = fsdp2_writer(source, model, out_dtype, include_optimizer)
    elif format == "dcp":
        from .dcp import dcp_writer

        form = "plain"
        writer = dcp_writer(source, out_dtype, include_optimizer)
    elif format == "megatron":
        from .megatron import megatron_writer

        writer = megatron_writer(source, out_dtype, include_optimizer, layout or layout_for(manifest, where=str(src_loc)),
                                 *target)
    elif format == "deepspeed":
        from .deepspeed import deepspeed_writer

        writer = deepspeed_writer(source)
    else:
        from .zarr_form import zarr_writer

        writer = zarr_writer(source, chunk_bytes)
    dst_loc = locate(dst, dst_storage)
    refuse_nesting(src_loc, dst_loc)
    if dst_loc.storage.exists(dst_loc.name):
        raise CheckpointExistsError(f"{dst_loc}: already exists; choose another path or remove it")
    # Staged and committed as a checkpoint is, the files keeping their paths: under a temporary
    # name renamed at the end, or on an object store in place under this writer's claim.
    stage = staging(dst_loc, uuid.uuid4().hex[:12], fixed_paths=True)
    try:
        written = writer(source, dst_loc.storage, stage.root)
        report = ExportReport(
            format=format, form=form, dtype=out_dtype or "saved", source=str(src_loc), source_checkpoint_id=manifest.checkpoint_id,
            step=manifest.step, source_topology=manifest.topology, destination=str(dst_loc),
            tensors=written.tensors, files=sorted(written.files, key=lambda f: f.path), skipped=written.skipped,
            seconds=round(time.perf_counter() - started, 3),
        )
        data = report_bytes(report)
        if written.manifest is None:  # the report is the last file: it commits the export
            commit(dst_loc, stage, data, update_latest=False, marker_name=REPORT_NAME)
        else:  # the zarr form: the report is one of its files, its manifest commits it
            dst_loc.storage.write(stage.key(REPORT_NAME), [data])
            manifest_json = written.manifest(ExportedFile(path=REPORT_NAME, size=len(data), checksum=checksum_of(data)))
            commit(dst_loc, stage, manifest_json, update_latest=False)
    except BaseException as exc:
        discard(dst_loc.storage, stage)
        if isinstance(exc, OSError) and not isinstance(exc, CkptkitError):
            raise StorageError(f"{dst_loc}: export failed, nothing written: {exc}") from exc
        raise
    return report


def _dcp_form(manifest: Any, where: str) -> str:
    """The dcp form a checkpoint exports to by default: ``fsdp2`` for the reference trainer's
    model (the module names that form knows), ``plain`` for any other."""
    from .fsdp2 import MODULE_NAMES

    try:
        return "fsdp2" if layout_for(manifest, where=where).name in MODULE_NAMES else "plain"
    except LayoutError:
        return "plain"


def _hf_writer(source: Source, out_dtype: str, max_shard_bytes: int, layout: Layout | None = None) -> Writer:
    """Plan the HF export (failing before any write) and return its writer. `layout` overrides
    the one the checkpoint records."""
    manifest = source.manifest
    layout = layout or layout_for(manifest, where=str(source.loc))
    generation: dict[str, Any] | None = None
    if layout.name in hf.PASSTHROUGH:
        config = hf.carried_config(manifest.info, layout, str(source.loc), out_dtype)
        pieces: dict[str, hf.Piece] = {name: (fqn, None) for fqn, name in hf.passthrough_map(manifest.tensors, list(layout.tensors())).items()}
        carried = (manifest.info.config or {}).get("generation_config.json")
        generation = carried if isinstance(carried, dict) else hf.generation_config_json(None)
        max_len = config.get("max_position_embeddings") or config.get("n_positions") or 2048
    elif layout.name == "megatron-gpt":
        pieces = hf.megatron_map(manifest.tensors, layout)
        config = hf.megatron_config_json(layout, out_dtype)
        max_len = config["max_position_embeddings"]
    else:
        model = hf.llama_config(layout, str(source.loc))
        names = hf.name_map(manifest.tensors, list(layout.tensors()), hf.RENAMES[layout.name])
        pieces = {name: (fqn, None) for fqn, name in names.items()}
        config, max_len = hf.model_config_json(layout.name, model, out_dtype), model["max_seq_len"]
    shapes = {name: _piece_shape(manifest.tensors[fqn].shape, rows) for name, (fqn, rows) in pieces.items()}
    nbytes = {name: math.prod(shape) * itemsize(out_dtype) for name, shape in shapes.items()}
    shards = hf.plan_shards(nbytes, max_shard_bytes)
    sources = {fqn for fqn, _ in pieces.values()}
    odd = sorted(f"{fqn} ({manifest.tensors[fqn].dtype})" for fqn in sources if (manifest.tensors[fqn].dtype, out_dtype) not in CONVERSIONS
                 and manifest.tensors[fqn].dtype != out_dtype)
    if odd:
        raise LayoutError(f"export converts float32, bfloat16 and float16 weights; {len(odd)} are not: " + ", ".join(odd[:10]))

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        tensors: list[ExportedTensor] = []
        feed = _Sources(source, [pieces[n][0] for shard in shards for n in shard.names], out_dtype)
        files = [_write_shard(source, dst, tmp, shard, pieces, shapes, feed, out_dtype, tensors) for shard in shards]
        index = {"metadata": {"total_size": sum(nbytes.values())},
                 "weight_map": {name: shard.file for shard in shards for name in shard.names}}
        extra = {
            "model.safetensors.index.json": index,
            "config.json": config,
            "generation_config.json": generation if generation is not None else hf.generation_config_json(_eos_id(source)),
        }
        copied, tokenizer_extra = _tokenizer_files(source, dst, tmp, max_len)
        files += copied
        extra.update(tokenizer_extra)
        for path, doc in extra.items():
            data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            dst.write(f"{tmp}/{path}", [data])
            files.append(ExportedFile(path=path, size=len(data), checksum=checksum_of(data)))
        return Written(tensors, files, sorted(fqn for fqn in manifest.tensors if fqn not in sources))

    return write


def _piece_shape(shape: tuple[int, ...], rows: hf.Rows) -> tuple[int, ...]:
    return shape if rows is None else (sum(n for _, n in rows), *shape[1:])


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
    source: Source, dst: Storage, tmp: str, shard: hf.Shard, pieces: dict[str, hf.Piece], shapes: dict[str, tuple[int, ...]],
    feed: _Sources, out_dtype: str, report: list[ExportedTensor],
) -> ExportedFile:
    """Write one safetensors shard from its tensors' sources, each cut to its rows."""
    manifest = source.manifest

    def bodies() -> Iterator[memoryview]:
        for name in shard.names:
            fqn, rows = pieces[name]
            data = feed.take(fqn)
            if rows is not None:  # runs of rows of a fused tensor, in order
                whole = data.reshape(manifest.tensors[fqn].shape[0], -1)
                data = np.concatenate([whole[a:a + n] for a, n in rows]).reshape(-1)
            view = memoryview(data)
            report.append(exported(source, name, fqn, view, out_dtype, shard.file))
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
