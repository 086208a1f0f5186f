"""Export a checkpoint (any topology) to portable full weights: Hugging Face, torch DCP, zarr,
Megatron-Core, a DeepSpeed universal checkpoint.

Call order: open the source and plan the output (an unmapped or missing tensor fails before
anything is written); then stream the tensors one at a time (each read whole from whatever
boxes hold it, converted, written) into a temporary directory, add the format's other files
and the export report, and commit it as a checkpoint is committed (``ckptkit.io.commit``). The
same logical state gives byte-identical files whatever topology saved it. Which formats there
are and which options each takes is ``formats``; each format's writer is in its own module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import os
import time
import uuid
from collections import Counter

from ..io.catalog import Location, locate, refuse_nesting, still_committed
from ..io.commit import REPORT_NAME, Staging, commit, discard, staging
from ..io.checksum import checksum_of
from ..errors import CheckpointExistsError, CkptkitError, LayoutError, StorageError, summarize
from .formats import CHUNK_BYTES, EXPORT_FORMATS, ExportFormat, ExportOptions
from .source import LEFT_OUT, OPTIMIZER_PARTS, ExportedFile, ExportReport, Source, Writer, Written, report_bytes
from ..ops.collective import Collective, default_collective, first_error, guard, unwrap
from ..ops.reports import SkippedEntry
from ..layouts import Layout
from ..manifest import Manifest
from ..io.payload import open_checkpoint
from ..storage import Storage

if TYPE_CHECKING:  # a type alias: the export's start imports none of the converters' contract
    from ..ops.convert import Progress

__all__ = ["REPORT_NAME", "ExportReport", "export"]

DEFAULT_MAX_SHARD = 5 * 10**9


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
    allow_skip: bool = False,
    dp: int | None = None,
    process_group: Any = None,
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
      ``ckptkit_adapters.dcp.fsdp2``); layout ``llama`` or a converted Hugging Face model.
      ``plain``: every tensor and value of any checkpoint under its own name (``model.<name>``,
      ``rng.<name>``; the optimizer's, ``optimizer.exp_avg.<name>``, ..., only with
      `include_optimizer`), for ``dcp.load`` into a plain state dict: a converted DCP save
      goes back whole.
    - ``megatron``: a Megatron-Core ``dist_checkpointing`` directory (``torch_dist``) that
      megatron-core loads into a ``GPTModel`` at any TP/PP (see ``ckptkit_adapters.megatron.writer``):
      layers stacked, each chunk a TP rank's piece as megatron-core at `tp` x `pp` writes it
      (a target the layout must allow, `ep` too for a mixture of experts), with
      `include_optimizer` the distributed optimizer's ``fully_reshardable`` state; the layout
      is ``megatron-gpt`` (recorded, or `layout`), or the reference trainer's ``llama`` (with
      its optimizer state if asked) or ``llama-moe`` (model only: megatron-core's MoE layer,
      ``SequentialMLP`` experts).
    - ``deepspeed``: a DeepSpeed universal checkpoint (see ``ckptkit_adapters.deepspeed.writer``): each
      parameter's fp32 master, ``exp_avg`` and ``exp_avg_sq`` whole under ``<tag>/zero/<name>/``,
      the model-states file and ``latest_universal``, which an engine with ``"checkpoint":
      {"load_universal": true}`` loads at ZeRO 1 or 2 and any data-parallel size; the source
      is a checkpoint converted from DeepSpeed, or one of a model whose modules are known
      (``models.modules_of``) with its AdamW state, each parameter under its module name; the
      optimizer state always comes along, `dtype` must be None. With `dp`, instead, a ZeRO-3
      save's own per-rank files at that data-parallel size (see ``ckptkit_adapters.deepspeed.zero3``),
      which a ZeRO-3 engine of `dp` ranks loads as it loads its own save, each parameter group
      with its own hyper-parameters; the source is a checkpoint converted from DeepSpeed.
    - ``zarr``: the topology-free form (see ``ckptkit_adapters.zarr.writer``): every tensor as a zarr v3
      array with the manifest beside it, bit for bit; `dtype` must be None.

    Every format writes ``export_report.json`` (each tensor's source, dtypes and checksum, each
    file, the tensors left out). Tensors stream one at a time; `dst` appears only when complete.
    `progress` is called with (bytes read, bytes to read) as the source tensors are read. Under
    torch.distributed (`process_group`, or the default group when one is up) every rank of the
    group calls this: the ranks split the files (the ``hf`` shards; another format's, rank 0
    writes them) and rank 0 commits once; every rank returns the report, or raises the first
    rank's error. A
    tensor left out of a kind the format holds (``ExportFormat.held``: the model's tensors, the
    optimizer's when it is written, everything for the plain DCP and zarr forms) fails the export
    before anything is written unless `allow_skip`; every tensor or value left out is listed in
    ``skipped`` as ``{name, reason}``, those of held kinds with a reason starting ``left out
    (--allow-skip):`` (``ExportReport.left_out``), the others (the optimizer state of a Hugging
    Face model, RNG states) with why the format does not hold them.

    Raises:
        LayoutError: an unknown format or dtype, options the format does not take (its entry in
            ``EXPORT_FORMATS`` says which it takes; all are listed), a model family with no HF
            export, or tensors that cannot be mapped (all are listed); nothing is written. Tensors
            of kinds the format holds that it would leave out, without `allow_skip` (all are
            listed; `dst` does not appear).
        CheckpointExistsError: something exists at `dst`.
        IntegrityError, StorageError: reading or writing failed; `dst` does not appear.
    """
    fmt = EXPORT_FORMATS.get(format)
    if fmt is None:
        raise LayoutError(f"export format {format!r} is not available; available: {', '.join(EXPORT_FORMATS)}")
    problem = fmt.options_problem(dtype=dtype, include_optimizer=include_optimizer, layout=layout is not None, tp=tp, pp=pp, ep=ep,
                                  dcp_form=dcp_form, dp=dp)
    if problem:
        raise LayoutError(problem)
    options = ExportOptions(dtype=fmt.out_dtype(dtype), include_optimizer=include_optimizer, layout=layout, tp=tp, pp=pp, ep=ep,
                            form=dcp_form, max_shard_bytes=max_shard_bytes, chunk_bytes=chunk_bytes, dp=dp)
    started = time.perf_counter()
    coll = default_collective(process_group)
    if coll.world_size == 1:
        src_loc, manifest = open_checkpoint(src, storage)
        with Source(src_loc, manifest, progress=progress) as source, still_committed(src_loc):
            return _export(source, dst, fmt, options, dst_storage, started, allow_skip)
    opened = guard(lambda: open_checkpoint(src, storage))
    unwrap(first_error(coll, opened))
    src_loc, manifest = opened[1]
    with Source(src_loc, manifest, progress=progress) as source, still_committed(src_loc):
        return _export_ranks(coll, source, dst, fmt, options, dst_storage, started, allow_skip)


def _planned(source: Source, dst: str | os.PathLike[str], fmt: ExportFormat, options: ExportOptions, dst_storage: Storage | None,
             allow_skip: bool) -> tuple[Writer, str | None, Location, list[str], list[str], list[str]]:
    """The writer of the export and its form, the destination, the checkpoint's entries it
    leaves out (tensors and values), those of kinds it holds (`dropped`) and every tensor left out.

    Raises:
        CheckpointExistsError: something exists at `dst`.
        LayoutError: the format refuses the checkpoint, or it would leave out tensors of kinds
            it holds without `allow_skip`.
    """
    src_loc, manifest = source.loc, source.manifest
    writer, form = fmt.build(source, options)
    dst_loc = locate(dst, dst_storage)
    refuse_nesting(src_loc, dst_loc)
    if dst_loc.storage.exists(dst_loc.name):
        raise CheckpointExistsError(f"{dst_loc}: already exists; choose another path or remove it")
    held = fmt.held(form, options.include_optimizer)
    left = [name for name in writer.skipped if name in manifest.tensors]
    skipped = sorted({*left, *(set(manifest.objects) - writer.values)})  # and every value the writer does not carry
    dropped = [fqn for fqn in left if manifest.tensors[fqn].kind in held]
    if dropped and not allow_skip:  # refused from the plan, before a byte is written
        raise LayoutError(f"{src_loc}: the {fmt.name} export would leave out {len(dropped)} tensor(s) of kinds it holds "
                          f"({', '.join(sorted({manifest.tensors[f].kind for f in dropped}))}): {summarize(dropped)}; "
                          "pass --allow-skip to export without them")
    return writer, form, dst_loc, skipped, dropped, left


def _export_ranks(
    coll: Collective, source: Source, dst: str | os.PathLike[str], fmt: ExportFormat, options: ExportOptions,
    dst_storage: Storage | None, started: float, allow_skip: bool,
) -> ExportReport:
    """`_export` under torch.distributed: every rank plans; each writes its part of the files
    (`Writer.write_part`: shards ``rank``, ``rank + world``, ...; a format without parts, rank 0
    all of them); rank 0 joins the parts into the one report and commits."""
    planned = guard(lambda: _planned(source, dst, fmt, options, dst_storage, allow_skip))
    unwrap(first_error(coll, planned))
    writer, form, dst_loc, skipped, dropped, left = planned[1]
    stage = unwrap(coll.broadcast(guard(lambda: staging(dst_loc, uuid.uuid4().hex[:12], fixed_paths=True)) if coll.rank == 0 else None))
    part = writer.write_part
    if part is not None:
        mine = guard(lambda: part(source, dst_loc.storage, stage.root, coll.rank, coll.world_size))
    else:
        mine = guard(lambda: writer.write(source, dst_loc.storage, stage.root)) if coll.rank == 0 else ("ok", None)
    parts = coll.gather(("ok", None) if coll.rank == 0 else mine)  # rank 0 keeps its own part
    outcome: tuple[str, Any] = ("ok", None)
    if parts is not None:
        failed = next((p for p in (mine, *parts[1:]) if p[0] != "ok"), None)
        if failed is not None:
            discard(dst_loc.storage, stage)
            outcome = failed
        else:
            written = mine[1]
            if part is not None:
                others = [p[1] for p in parts[1:]]
                tensors = sorted((t for w in (written, *others) for t in w.tensors), key=lambda t: t.file)
                written = Written(tensors, [f for w in (written, *others) for f in w.files], written.manifest)
            outcome = guard(lambda: _report_and_commit(source, fmt, options, form, writer, written, dst_loc, stage, skipped,
                                                       dropped, left, started))
    report: ExportReport = unwrap(coll.broadcast(outcome))
    return report


def _export(
    source: Source, dst: str | os.PathLike[str], fmt: ExportFormat, options: ExportOptions, dst_storage: Storage | None,
    started: float, allow_skip: bool,
) -> ExportReport:
    writer, form, dst_loc, skipped, dropped, left = _planned(source, dst, fmt, options, dst_storage, allow_skip)
    # Staged and committed as a checkpoint is, the files keeping their paths: under a temporary
    # name renamed at the end, or on an object store in place under this writer's claim.
    stage = staging(dst_loc, uuid.uuid4().hex[:12], fixed_paths=True)
    try:
        written = writer.write(source, dst_loc.storage, stage.root)
        return _report_and_commit(source, fmt, options, form, writer, written, dst_loc, stage, skipped, dropped, left, started)
    except BaseException as exc:
        discard(dst_loc.storage, stage)
        if isinstance(exc, OSError) and not isinstance(exc, CkptkitError):
            raise StorageError(f"{dst_loc}: export failed, nothing written: {exc}") from exc
        raise


def _report_and_commit(
    source: Source, fmt: ExportFormat, options: ExportOptions, form: str | None, writer: Writer, written: Written,
    dst_loc: Location, stage: Staging, skipped: list[str], dropped: list[str], left: list[str], started: float,
) -> ExportReport:
    """The export's report of what was `written`, committed as its last file (the zarr form's
    manifest after it). The caller discards the stage if this fails."""
    src_loc, manifest = source.loc, source.manifest
    report = ExportReport(
        format=fmt.name, form=form, dtype=options.dtype or "saved", source=str(src_loc), source_checkpoint_id=manifest.checkpoint_id,
        step=manifest.step, source_topology=manifest.topology, destination=str(dst_loc),
        tensors=len(written.tensors), tensor_list=written.tensors, files=len(written.files),
        file_list=sorted(written.files, key=lambda f: f.path),
        skipped=[SkippedEntry(name=f, reason=writer.reasons.get(f) or _why_skipped(f, fmt, options.include_optimizer, manifest, dropped))
                 for f in skipped],
        not_held=dict(sorted(Counter(manifest.tensors[f].kind for f in left if f not in dropped).items())),
        warnings=list(writer.warnings), seconds=round(time.perf_counter() - started, 3),
    )
    data = report_bytes(report)
    if written.manifest is None:  # the report is the last file: it commits the export
        commit(dst_loc, stage, data, update_latest=False, marker_name=REPORT_NAME)
    else:  # the zarr form: the report is one of its files, its manifest commits it
        dst_loc.storage.write(stage.key(REPORT_NAME), [data])
        manifest_json = written.manifest(ExportedFile(path=REPORT_NAME, size=len(data), checksum=checksum_of(data)))
        commit(dst_loc, stage, manifest_json, update_latest=False)
    return report


def _why_skipped(name: str, fmt: ExportFormat, include_optimizer: bool, manifest: Manifest, dropped: list[str]) -> str:
    """Why an export left an entry of the checkpoint out: a tensor of a kind it holds but could
    not write (allowed by --allow-skip), the optimizer's when it was not asked for, a tensor of a
    kind it does not hold, or a value."""
    asked = "" if include_optimizer or fmt.optimizer != "optional" else " without --include-optimizer"
    if name not in manifest.tensors:
        of_optimizer = asked and name.split("/")[0] in OPTIMIZER_PARTS
        return f"an optimizer value, which the {fmt.name} export writes only with --include-optimizer" if of_optimizer else f"a value the {fmt.name} export does not write"
    kind = manifest.tensors[name].kind
    if name in dropped:
        return f"{LEFT_OUT} the {fmt.name} export holds {kind} tensors but could not write it"
    return f"the {fmt.name} export holds no {kind} tensors{asked if kind == 'optimizer' else ''}"
