"""The commands that write a checkpoint or an export: reshard, export, convert."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import click

import ckptkit

from .. import CkptkitError
from .base import cli, emit_json, parse_size, progress, shows_progress, torchrun_job, usage


@cli.command("reshard")
@click.argument("src")
@click.argument("dst")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1), help="Target tensor-parallel degree.")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(1), help="Target pipeline stages.")
@click.option("--dp", default=1, show_default=True, type=click.IntRange(1), help="Target data-parallel degree.")
@click.option("--cp", default=1, show_default=True, type=click.IntRange(1), help="Target context-parallel degree.")
@click.option("--ep", default=1, show_default=True, type=click.IntRange(1),
              help="Target expert-parallel degree (within --dp; a model with experts).")
@click.option("--zero", default=0, show_default=True, type=int, help="Target ZeRO stage (0-3).")
@click.option("--threads", default=4, show_default=True, type=click.IntRange(1, 64), help="Files written at once per process.")
@click.option("--no-check", is_flag=True, help="Do not check the source checksums while copying.")
@click.option("--no-latest", is_flag=True,
              help="Leave the latest pointer of DST's root where it is (it only ever moves to a higher step, and only in a run root).")
@click.option("--layout", "layout_file", default=None, metavar="LAYOUT.json|NAME",
              help="The model's layout: a layout file, or a built-in layout's name built for SRC's model config "
                   "(default: the one SRC records).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def reshard_cmd(
    src: str, dst: str, tp: int, pp: int, dp: int, cp: int, ep: int, zero: int, threads: int, no_check: bool,
    no_latest: bool, layout_file: str | None, as_json: bool,
) -> None:
    """Write the checkpoint at SRC as the one a tp x pp x cp x dp (ZeRO, EP) job would have saved, at DST.

    Every tensor is copied bitwise; training assets and the tokenizer come along. The
    tensors are placed by the model's layout: the one SRC records (or the built-in one of
    the model family it names), or --layout FILE. Under torchrun the ranks split the files.
    Exit 0 when DST is committed, 1 on a ckptkit error (impossible target, a layout with
    mistakes, DST exists, source corrupt; nothing is committed), 2 on bad usage or when SRC
    holds no committed checkpoint.

    \b
    Examples:
      ckptkit reshard demo-out/run dp4 --tp 1 --pp 1 --dp 4 --zero 3
      ckptkit reshard converted tp1 --tp 1 --dp 2 --zero 1 --layout megatron-gpt
    """
    if zero not in (0, 1, 2, 3):
        usage(f"--zero: stage {zero} is not one of 0, 1, 2, 3")
    layout = _layout_of(layout_file, src)
    target = ckptkit.Topology(world_size=tp * pp * cp * dp, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero_stage=zero)
    with torchrun_job() as (rank, _), progress("resharding", rank == 0 and shows_progress(as_json)) as update:
        report = ckptkit.reshard(src, dst, target, threads=threads, check_source=not no_check, update_latest=not no_latest,
                                 layout=layout, progress=update)
    if rank != 0:
        return
    if as_json:
        emit_json(report)
        return
    mb = report.bytes_written / 1e6
    click.echo(
        f"{report.destination}: committed step {report.step} for {report.topology.describe()} "
        f"(from {report.source_topology.describe()}): {report.tensors} tensors, {report.files} files, "
        f"{mb:.1f} MB in {report.seconds:.2f} s ({mb / max(report.seconds, 1e-9):.0f} MB/s)"
    )
    if report.unplaced:
        click.echo(f"kept with their saved boxes: {', '.join(report.unplaced)}")
    click.echo(_latest_note(report, no_latest))


def _latest_note(report: ckptkit.ReshardReport, no_latest: bool) -> str:
    """Say what became of the destination root's ``latest`` pointer."""
    root = os.path.dirname(report.destination.rstrip("/")) or "."
    if report.latest_moved:
        return f"{root}/latest now names {os.path.basename(report.destination)}"
    if no_latest:
        return f"{root}/latest left as it was (--no-latest)"
    if report.latest:
        return f"{root}/latest left at {report.latest} (it names a step at or above {report.step})"
    return f"no latest pointer written: {root} is not a run root (it holds other files and no latest)"


def _layout_of(value: str | None, src: str) -> ckptkit.Layout | None:
    """--layout of a command reading SRC: a layout file, or a built-in layout's name built for
    the model config SRC records."""
    from ..layouts import manifest_config, named_layout

    return None if value is None else named_layout(value, lambda: manifest_config(ckptkit.read_manifest(src)),
                                                   origin=f"the model config {src} records")


def _key_values(pairs: tuple[str, ...], option: str) -> dict[str, Any]:
    """``KEY=VALUE`` options as a dict, each VALUE read as JSON (``4``, ``true``) or else kept as text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            usage(f"{option}: {pair!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(text)
        except ValueError:
            out[key.strip()] = text
    return out


def _offered(values: Callable[[Any], tuple[str, ...]]) -> list[str]:
    """The values of an option that some export format takes (its --dtype values, its forms), in the table's order."""
    return list(dict.fromkeys(v for f in ckptkit.EXPORT_FORMATS.values() for v in values(f)))


@cli.command("export")
@click.argument("src")
@click.argument("dst")
@click.option("--format", "fmt", default="hf", show_default=True, type=click.Choice(list(ckptkit.EXPORT_FORMATS)),
              help="; ".join(f"{f.name}: {f.help}" for f in ckptkit.EXPORT_FORMATS.values()) + ".")
@click.option("--dtype", default=None, type=click.Choice(_offered(lambda f: f.dtypes)),
              help="Output dtype. hf, dcp, megatron: default the saved dtype; zarr, deepspeed: always the saved dtype.")
@click.option("--max-shard-size", default="5GB", metavar="SIZE", show_default=True, help="hf: largest output file (5GB, 500MB, 2GiB, bytes).")
@click.option("--include-optimizer", is_flag=True, help="dcp, megatron, torchtitan: also export the optimizer state (zarr and deepspeed always have it).")
@click.option("--layout", "layout_file", default=None, metavar="LAYOUT.json|NAME",
              help="hf, megatron: the model's layout: a layout file, or a built-in layout's name built for SRC's model config "
                   "(default: the one SRC records).")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="megatron: the tensor-parallel size whose pieces the files hold (megatron-core loads them at any).")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(min=1),
              help="megatron: the pipeline-parallel size the layout must allow.")
@click.option("--ep", default=1, show_default=True, type=click.IntRange(min=1),
              help="megatron: the expert-parallel size the layout must allow (a mixture of experts; the files are the same at any).")
@click.option("--dcp-form", "dcp_form", default=None, type=click.Choice(_offered(lambda f: f.forms)),
              help="dcp: fsdp2 (the default for the reference trainer's checkpoints): the state dict FSDP2's get_state_dict "
                   "gives for its model, which an FSDP2 job at any world size loads with dcp.load + set_state_dict; plain "
                   "(the default for any other): the checkpoint's own tensor names, for dcp.load into a plain state dict.")
@click.option("--dp", default=None, type=click.IntRange(min=1), metavar="N",
              help="deepspeed: write a ZeRO-3 save's own per-rank files for N data-parallel ranks, which a ZeRO-3 engine of "
                   "N ranks loads as its own save (default: the universal checkpoint, loaded at any size with load_universal).")
@click.option("--allow-skip", is_flag=True,
              help="Export without the tensors of kinds the format holds that it cannot write, listing them "
                   "(default: any such tensor fails the export). Kinds a format does not hold are always left out and counted.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (the export report).")
def export_cmd(src: str, dst: str, fmt: str, dtype: str | None, max_shard_size: str, include_optimizer: bool, layout_file: str | None,
               tp: int, pp: int, ep: int, dcp_form: str | None, dp: int | None, allow_skip: bool, as_json: bool) -> None:
    """Export the checkpoint at SRC (any topology) to DST: a Hugging Face model directory, a
    Trainer checkpoint folder, a peft adapter folder, a torch DCP checkpoint, the zarr form
    (every tensor as a zarr v3 array, manifest beside it), a Megatron-Core torch_dist
    checkpoint, a DeepSpeed universal checkpoint, or a torchtitan checkpoint (DCP) its job
    starts or (--include-optimizer) resumes from.

    Exit 0 when DST is complete, 1 on a ckptkit error (unmapped or missing tensors, tensors of a
    kind the format holds left out without --allow-skip, DST exists; DST does not appear), 2 on
    bad usage or when SRC holds no committed checkpoint. Under torchrun the ranks split the
    files (hf: the shards; the other formats: rank 0 writes them), with one commit.

    \b
    Examples:
      ckptkit export demo-out/run hf-out --format hf --dtype bf16
      ckptkit export converted universal --format deepspeed
      ckptkit export converted zero3 --format deepspeed --dp 3
      ckptkit export converted mcore --format megatron --tp 2 --include-optimizer
      ckptkit export converted job/checkpoint/step-1000 --format torchtitan --include-optimizer
    """
    try:
        size = parse_size(max_shard_size)
    except CkptkitError as exc:
        usage(f"--max-shard-size: {exc}")
    problem = ckptkit.EXPORT_FORMATS[fmt].options_problem(dtype=dtype, include_optimizer=include_optimizer,
                                                           layout=layout_file is not None, tp=tp, pp=pp, ep=ep, dcp_form=dcp_form,
                                                           dp=dp)
    if problem:
        usage(problem)
    layout = _layout_of(layout_file, src)
    with torchrun_job() as (rank, _), progress("exporting", rank == 0 and shows_progress(as_json)) as update:
        report = ckptkit.export(src, dst, format=fmt, dtype=dtype, max_shard_bytes=size, include_optimizer=include_optimizer,
                                layout=layout, progress=update, tp=tp, pp=pp, ep=ep, dcp_form=dcp_form, allow_skip=allow_skip,
                                dp=dp)
    if rank:
        return
    for warning in report.warnings:
        click.echo(f"ckptkit: warning: {warning}", err=True)
    if as_json:
        emit_json(report)
        return
    total = sum(f.size for f in report.file_list)
    click.echo(
        f"{report.destination}: {report.tensors} tensors ({report.format}{f' {report.form}' if report.form else ''}, {report.dtype}) in "
        f"{report.files} file(s), {total / 1e6:.1f} MB "
        f"(step {report.step}; {_not_exported(report)})"
    )
    for fqn in report.left_out:
        click.echo(f"left out (--allow-skip): {fqn}")


def _not_exported(report: Any) -> str:
    """``81 tensors not exported: 78 optimizer, 3 rng``, and the values left out, if any."""
    tensors = sum(report.not_held.values()) + len(report.left_out)
    values = len(report.skipped) - tensors
    return f"{tensors} tensors{f' and {values} values' if values else ''} not exported{_not_held(report)}"


def _not_held(report: Any) -> str:
    """The tensors of kinds the export does not hold, counted by kind: ``: 78 optimizer, 3 rng``."""
    return ": " + ", ".join(f"{n} {kind}" for kind, n in report.not_held.items()) if report.not_held else ""


@cli.command("convert")
@click.argument("src")
@click.argument("dst")
@click.option("--from", "source_format", metavar="FORMAT", default="auto", show_default=True,
              help="The format of SRC: auto (recognise it from the files) or a converter's name (dcp, deepspeed, hf, megatron, peft, torchtitan).")
@click.option("--allow-skip", is_flag=True,
              help="Convert what can be converted and list the rest as skipped (default: any such entry fails).")
@click.option("--layout", "layout_file", default=None, metavar="LAYOUT.json|NAME",
              help="The model's layout, recorded in DST: a layout file, or a built-in layout's name built for "
                   "--model-config (default: the one the converter finds, if any).")
@click.option("--model-config", "model_config", multiple=True, metavar="KEY=VALUE",
              help="What SRC does not record of the model's config, from which the layout is found (repeatable; VALUE "
                   "is JSON or text): a Megatron-Core save without Megatron-LM's arguments needs num_attention_heads "
                   "and num_query_groups; a torchtitan save num_attention_heads (and rope_theta, rms_norm_eps where not "
                   "Llama 3's).")
@click.option("--max-file-size", "max_file_size", default="4GiB", show_default=True, metavar="SIZE",
              help="Start a new payload file when one would grow past SIZE (5GB, 500MB, 2GiB); under torchrun the "
                   "processes split the files, so smaller files split the work finer.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (the convert report).")
def convert_cmd(src: str, dst: str, source_format: str, allow_skip: bool, layout_file: str | None, model_config: tuple[str, ...],
                max_file_size: str, as_json: bool) -> None:
    """Convert another tool's checkpoint at SRC (a DeepSpeed, Megatron, torch DCP, torchtitan, Hugging Face model or `Trainer`, or peft directory) into a ckptkit checkpoint at DST.

    Every tensor and value of SRC is converted or listed as skipped with a reason; an entry
    that cannot be converted fails the conversion unless --allow-skip. --layout records the
    model's layout (e.g. `ckptkit layout builtin megatron-gpt model.json`), so that reshard and
    export need no --layout. Exit 0 when DST is committed, 1 on a ckptkit error (unknown
    format, unsafe or damaged source, a layout that does not fit, DST exists; DST does not
    appear), 2 on bad usage or when SRC is not a directory. Under torchrun the processes split
    the payload files, with one commit: the checkpoint is the same, file for file, as one
    process writes.

    \b
    Examples:
      ckptkit convert fixtures/deepspeed/zero3-fp32 converted
      ckptkit convert MCORE_SAVE converted --model-config num_attention_heads=32 --model-config num_query_groups=8
      ckptkit convert outputs/checkpoint/step-1000 converted --model-config num_attention_heads=32
      ckptkit convert BIG_SAVE converted --max-file-size 1GiB   # under torchrun: -m ckptkit.cli convert ...
    """
    from ..layouts import named_layout

    try:
        max_file_bytes = parse_size(max_file_size)
    except CkptkitError as exc:
        usage(f"--max-file-size: {exc}")
    config = _key_values(model_config, "--model-config")
    layout = named_layout(layout_file, lambda: config, origin="--model-config") if layout_file is not None else None
    names = ckptkit.list_converters()
    if source_format != "auto" and source_format not in names:
        usage(f"--from: no converter for {source_format!r}; choose auto or one of: {', '.join(names) or 'none installed'}")
    with torchrun_job() as (rank, _):
        if source_format == "auto":
            source_format = ckptkit.detect_format(src)
            if rank == 0:
                click.echo(f"ckptkit: {src}: converting from {source_format} ({names[source_format]})", err=True)
        with progress("converting", rank == 0 and shows_progress(as_json)) as update:
            report = ckptkit.convert(src, dst, source_format=source_format, allow_skip=allow_skip, progress=update, layout=layout,
                                     config=config, max_file_bytes=max_file_bytes)
    if rank:
        return
    for warning in report.warnings:
        click.echo(f"ckptkit: warning: {warning}", err=True)
    if as_json:
        emit_json(report)
        return
    click.echo(
        f"{report.destination}: committed step {report.step} from {report.format} {report.source}: "
        f"{report.tensors} tensors, {len(report.objects)} values, {report.files} file(s), "
        f"{report.bytes_written / 1e6:.1f} MB in {report.seconds:.2f} s; {len(report.skipped)} skipped"
    )
    for skipped in report.skipped:
        click.echo(f"skipped {skipped.name}: {skipped.reason}")


@cli.command("flush")
@click.argument("node_dir", metavar="NODE_DIR")
@click.argument("root")
@click.option("--deadline", "deadline_s", default=60.0, show_default=True, type=click.FloatRange(0), metavar="SECONDS",
              help="Give up after this long; nothing is committed then.")
@click.option("--offset", default=0, show_default=True, type=click.IntRange(0), metavar="N",
              help="Where in the snapshot's files to start (several flushers of one node: each its local rank).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def flush_cmd(node_dir: str, root: str, deadline_s: float, offset: int, as_json: bool) -> None:
    """Write the newest memory snapshot NODE_DIR holds that ROOT lacks into ROOT, as a committed checkpoint.

    NODE_DIR is one node's folder of a memory tier (``--memory-dir``'s ``<node>/``). Each file
    the node holds is checked before it is written; files the node lacks must come from the
    other nodes' flushes, which may run at the same time: whichever sees every file in ROOT
    commits (manifest, rename, then ``latest`` when newer). For a launcher or watchdog, once the
    training processes are gone; run it on each surviving node. Exit 1 when nothing could be
    committed (the message says why); what it wrote then stays under a hidden name, which
    ``ckptkit clean`` removes.

    \b
    Examples:
      ckptkit flush /dev/shm/job/node0 runs/job
    """
    report = ckptkit.flush_node(node_dir, root, deadline_s=deadline_s, offset=offset)
    if as_json:
        emit_json(report)
        return
    for note in report.notes:
        click.echo(f"ckptkit: note: {note}", err=True)
    click.echo(f"{report.committed} (step {report.step}) is committed in {root}; this flush wrote {len(report.written)} file(s)")
