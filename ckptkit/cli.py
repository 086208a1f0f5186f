"""The ``ckptkit`` command: a thin click layer over the library.

Exit codes, the same for the same mistake in every command:

- 0: success (verify: sound; diff: equal).
- 1: a ckptkit error (a damaged or refused checkpoint, an existing destination, an impossible
  layout, a run that cannot start as asked); verify: problems found; diff: the checkpoints differ.
- 2: bad usage (an unknown option, a missing argument, a value out of range, options that do
  not go together), or no checkpoint (or root) at a path the command was given.
- 3: an internal error (a bug: please report it; CKPTKIT_DEBUG=1 shows the traceback).
- 130: interrupted.

Every error is one line on stderr; with ``--json`` a failed command also prints an error object
(``schemas/cli/error.v1.schema.json``) on stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click

import ckptkit

from . import CheckpointNotFoundError, CkptkitError, LayoutError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


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


def exit_code_of(exc: BaseException) -> int:
    """The exit code of a failure (see the module docstring)."""
    if isinstance(exc, (CheckpointNotFoundError, click.UsageError)):
        return EXIT_USAGE
    if isinstance(exc, click.ClickException):
        return int(exc.exit_code)
    return EXIT_FAILED if isinstance(exc, CkptkitError) else EXIT_INTERNAL


class Failure(click.ClickException):
    """A command failed: what to say, the exit code, and whether it was asked for JSON. Shown
    the same by the entry point and by click's standalone mode."""

    def __init__(self, error: str, message: str, code: int, as_json: bool) -> None:
        super().__init__(message)
        self.error, self.as_json = error, as_json
        self.exit_code = code  # type: ignore[misc]  # click declares it per class; a failure sets its own

    def show(self, file: Any = None) -> None:
        if self.as_json:
            _emit_json(ckptkit.ErrorReport(error=self.error, message=self.message, exit_code=self.exit_code))
        click.echo(f"ckptkit: error: {self.message}", err=True)


class _Command(click.Command):
    """A command whose ckptkit errors become a `Failure` that knows whether --json was given."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (CkptkitError, click.UsageError) as exc:
            message = exc.format_message() if isinstance(exc, click.UsageError) else str(exc)
            error = "UsageError" if isinstance(exc, click.UsageError) else type(exc).__name__
            raise Failure(error, message, exit_code_of(exc), bool(ctx.params.get("as_json"))) from exc


class _Group(click.Group):
    command_class = _Command
    group_class = type


def _fail(message: str, code: int, *, error: str = "CkptkitError", as_json: bool = False) -> NoReturn:
    Failure(error, message, code, as_json).show()
    sys.exit(code)


def _usage(message: str) -> NoReturn:
    """Refuse options that do not go together (exit 2, like any bad usage)."""
    raise click.UsageError(message)


@contextlib.contextmanager
def _progress(label: str, show: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A (done, total) callback drawing a progress bar on stderr, or None when `show` is False
    (piped, or --json): long work shows progress on a terminal and stays quiet otherwise."""
    if not show:
        yield None
        return
    with contextlib.ExitStack() as stack:
        bar: list[Any] = []

        def update(done: int, total: int) -> None:
            if not bar:
                bar.append(stack.enter_context(click.progressbar(length=max(total, 1), label=label, file=sys.stderr)))
            bar[0].update(min(done, total) - bar[0].pos)

        yield update


def _shows_progress(as_json: bool) -> bool:
    return not as_json and sys.stderr.isatty()


def _emit_json(model: Any) -> None:
    data = model.model_dump(mode="json") if hasattr(model, "model_dump") else model
    click.echo(json.dumps(data, indent=2, sort_keys=False))


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptkit")
def cli() -> None:
    """Checkpoints for sharded large-model training: list, inspect, verify, diff, reshard, export, convert, layout, clean, prune, train, demo."""


@cli.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def ls_cmd(root: str, as_json: bool) -> None:
    """List what ROOT holds: committed checkpoints (step, topology, size, time, latest), other
    directories named for what they are, leftovers of interrupted saves, and warnings."""
    report = ckptkit.list_checkpoints(root)
    if as_json:
        _emit_json(report)
        return
    if report.kind == "run-root" and not report.checkpoints:
        click.echo(f"no committed checkpoint under {root}")
    for c in report.checkpoints:
        size = ckptkit.human_bytes(c.bytes) if c.bytes is not None else "?"
        topology = c.topology.describe() if c.topology is not None else "topology ?"
        mark = "\t<- latest" if c.latest else ""
        click.echo(f"{c.name}\tstep {c.step}\t{topology}\t{size}\t{c.created_at or '?'}{mark}")
    for other in report.others:
        click.echo(f"{other.name}\t{other.kind}: {other.detail}")
    for left in report.leftovers:
        click.echo(f"{left.name}\tleftover: {left.reason}")
    for warning in report.warnings:
        click.echo(f"ckptkit: warning: {warning}", err=True)


@cli.command("clean")
@click.argument("root")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def clean_cmd(root: str, dry_run: bool, as_json: bool) -> None:
    """Remove the leftovers of interrupted saves under ROOT, and leases of readers that are gone.

    Never a committed checkpoint, one a live read lease holds, or a directory ckptkit does not
    know. Run it while no save into ROOT is in progress (a save being written looks like an
    interrupted one).
    """
    report = ckptkit.clean(root, dry_run=dry_run)
    if as_json:
        _emit_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    for item in report.removed:
        click.echo(f"{verb} {item.name}\t{item.reason}")
    for item in report.kept:
        click.echo(f"kept {item.name}\t{item.reason}")
    click.echo(f"{root}: {verb} {len(report.removed)} leftover(s) and {report.stale_leases} stale lease(s)")


@cli.command("prune")
@click.argument("root")
@click.option("--keep-last", required=True, type=click.IntRange(1), help="Keep the newest N committed checkpoints.")
@click.option("--keep-every", default=None, type=click.IntRange(1), help="Also keep every step divisible by M.")
@click.option("--dry-run", is_flag=True, help="Only list what would be deleted.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def prune_cmd(root: str, keep_last: int, keep_every: int | None, dry_run: bool, as_json: bool) -> None:
    """Delete the committed checkpoints under ROOT that --keep-last / --keep-every do not keep.

    The rules CheckpointManager applies after each save: never the checkpoint latest names,
    the newest, or one a live read lease holds.
    """
    report = ckptkit.prune(root, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run)
    if as_json:
        _emit_json(report)
        return
    verb = "would delete" if dry_run else "deleted"
    for name in report.deleted:
        click.echo(f"{verb} {name}")
    for name in report.busy:
        click.echo(f"kept {name}\ta live read lease holds it")
    click.echo(f"{root}: {verb} {len(report.deleted)} checkpoint(s), {len(report.kept)} kept")


@cli.command("inspect")
@click.argument("path")
@click.option("--tensors", "show_tensors", is_flag=True, help="Also list every tensor: dtype, shape, kind, bytes, how it is cut.")
@click.option("--match", "match", default="*", show_default=True, help="List only the tensors whose names match this glob (implies --tensors).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (it always lists the tensors).")
def inspect_cmd(path: str, show_tensors: bool, match: str, as_json: bool) -> None:
    """Show what the checkpoint at PATH holds: step, topology, the model, tensors, bytes, assets, versions."""
    report = ckptkit.inspect(path, match=match)
    if as_json:
        _emit_json(report)
    else:
        click.echo(report.render(tensors=show_tensors or match != "*"))


@cli.command("verify")
@click.argument("path")
@click.option("--quick", is_flag=True, help="Skip checksums; check presence, sizes, headers and tiling.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--workers", default=4, show_default=True, type=click.IntRange(1, 64), help="Threads reading ahead of the hashing.")
def verify_cmd(path: str, quick: bool, as_json: bool, workers: int) -> None:
    """Check the checkpoint at PATH against its manifest.

    Exit 0 when sound, 1 when problems were found, 2 on bad usage or when PATH holds no
    committed checkpoint.
    """
    report = _with_progress(path, quick, workers, show=_shows_progress(as_json))
    if as_json:
        _emit_json(report)
    else:
        for f in report.findings:
            click.echo(f"[{f.code}] {f.where}: {f.message}")
        state = "sound" if report.ok else f"{len(report.findings)} problem(s)"
        checks = "sizes, headers, tiling" + ("" if quick else ", checksums")
        click.echo(f"{report.path}: {state} ({report.files_checked} files, {report.tensors} tensors; {checks})")
    sys.exit(0 if report.ok else 1)


def _with_progress(path: str, quick: bool, workers: int, *, show: bool) -> ckptkit.VerifyReport:
    if not show or quick:
        return ckptkit.verify(path, quick=quick, workers=workers)
    try:
        total = sum(f.size for f in ckptkit.read_manifest(path).files)
    except CkptkitError:
        return ckptkit.verify(path, quick=quick, workers=workers)
    hashed = [0]
    with _progress("hashing", show) as update:
        assert update is not None

        def add(n: int) -> None:
            hashed[0] += n
            update(hashed[0], total)

        return ckptkit.verify(path, quick=quick, workers=workers, progress=add)


@cli.command("diff")
@click.argument("a")
@click.argument("b")
@click.option("--atol", default=0.0, show_default=True, type=click.FloatRange(min=0), help="Absolute tolerance.")
@click.option("--rtol", default=0.0, show_default=True, type=click.FloatRange(min=0), help="Relative tolerance.")
@click.option("--include-rng", is_flag=True, help="Also compare RNG states (they differ between topologies).")
@click.option("--limit", default=10, show_default=True, type=click.IntRange(0), help="Differences to print (and to list in --json).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def diff_cmd(a: str, b: str, atol: float, rtol: float, include_rng: bool, limit: int, as_json: bool) -> None:
    """Compare checkpoints A and B as logical tensors, whatever their topologies.

    Bitwise by default; --atol/--rtol allow |a - b| <= atol + rtol * |b|. Exit 0 when equal,
    1 when different, 2 on bad usage or when A or B holds no committed checkpoint.
    """
    kinds = ("param", "optimizer", "buffer", "other") + (("rng",) if include_rng else ())
    with _progress("comparing", _shows_progress(as_json)) as update:
        report = ckptkit.diff(a, b, atol=atol, rtol=rtol, kinds=kinds, progress=update)
    if as_json:
        _emit_json(report.model_copy(update={"differences": report.differences[:limit]}))
    else:
        for d in report.differences[:limit]:
            detail = f"{d.mismatched}/{d.numel} differ, max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}" if d.numel else d.problem
            click.echo(f"{d.name}: {detail}")
        if len(report.differences) > limit:
            click.echo(f"... and {len(report.differences) - limit} more")
        if not report.objects_equal:
            click.echo("non-tensor values differ")
        verdict = "equal" if report.equal else f"{len(report.differences)} tensor(s) differ"
        click.echo(f"{verdict} ({report.tensors_compared} tensors compared)")
    sys.exit(0 if report.equal else 1)


@cli.command("reshard")
@click.argument("src")
@click.argument("dst")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1), help="Target tensor-parallel degree.")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(1), help="Target pipeline stages.")
@click.option("--dp", default=1, show_default=True, type=click.IntRange(1), help="Target data-parallel degree.")
@click.option("--zero", default=0, show_default=True, type=int, help="Target ZeRO stage (0-3).")
@click.option("--threads", default=4, show_default=True, type=click.IntRange(1, 64), help="Files written at once per process.")
@click.option("--no-check", is_flag=True, help="Do not check the source checksums while copying.")
@click.option("--no-latest", is_flag=True,
              help="Leave the latest pointer of DST's root where it is (it only ever moves to a higher step, and only in a run root).")
@click.option("--layout", "layout_file", default=None, help="A layout file for the model (default: the one SRC records).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def reshard_cmd(
    src: str, dst: str, tp: int, pp: int, dp: int, zero: int, threads: int, no_check: bool, no_latest: bool,
    layout_file: str | None, as_json: bool,
) -> None:
    """Write the checkpoint at SRC as the one a tp x pp x dp (ZeRO) job would have saved, at DST.

    Every tensor is copied bitwise; training assets and the tokenizer come along. The
    tensors are placed by the model's layout: the one SRC records (or the built-in one of
    the model family it names), or --layout FILE. Under torchrun the ranks split the files.
    Exit 0 when DST is committed, 1 on a ckptkit error (impossible target, a layout with
    mistakes, DST exists, source corrupt; nothing is committed), 2 on bad usage or when SRC
    holds no committed checkpoint.
    """
    from .layouts import load_layout

    if zero not in (0, 1, 2, 3):
        _usage(f"--zero: stage {zero} is not one of 0, 1, 2, 3")
    layout = load_layout(layout_file) if layout_file is not None else None
    target = ckptkit.Topology(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, zero_stage=zero)
    dist = _init_torchrun()
    rank = dist.get_rank() if dist is not None else 0
    try:
        with _progress("resharding", rank == 0 and _shows_progress(as_json)) as update:
            report = ckptkit.reshard(src, dst, target, threads=threads, check_source=not no_check, update_latest=not no_latest,
                                     layout=layout, progress=update)
    finally:
        if dist is not None:
            dist.destroy_process_group()
    if rank != 0:
        return
    if as_json:
        _emit_json(report)
        return
    mb = report.bytes_written / 1e6
    click.echo(
        f"{report.destination}: committed step {report.step} for {report.topology.describe()} "
        f"(from {report.source_topology.describe()}): {report.tensors} tensors, {report.files} files, "
        f"{mb:.1f} MB in {report.seconds:.2f} s ({mb / max(report.seconds, 1e-9):.0f} MB/s)"
    )
    if report.kept:
        click.echo(f"kept with their saved boxes: {', '.join(report.kept)}")
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


@cli.group("layout")
def layout_group() -> None:
    """Model layouts: how a model's tensors are cut over TP, PP and ZeRO (see ckptkit.layouts)."""


@layout_group.command("show")
@click.argument("path")
def layout_show_cmd(path: str) -> None:
    """Print the layout of the checkpoint at PATH as a layout file (JSON).

    The layout the checkpoint records, or for a checkpoint written before layouts were
    recorded, the built-in layout of the model family its manifest names. Exit 0, 1 when
    the checkpoint has no layout, 2 when PATH holds no committed checkpoint.
    """
    from .layouts import layout_for

    checkpoint = ckptkit.open(path)
    click.echo(json.dumps(layout_for(checkpoint.manifest, where=str(checkpoint.location)).to_json(), indent=2))


@layout_group.command("builtin")
@click.argument("family")
@click.argument("config")
def layout_builtin_cmd(family: str, config: str) -> None:
    """Print the built-in layout of model FAMILY for the model config in the JSON file CONFIG.

    Families: llama, hf-llama, gpt2, megatron-gpt (each with its own config keys; see the
    README). For a checkpoint that records no layout: `ckptkit layout builtin megatron-gpt
    model.json > layout.json`, then `reshard --layout` or `export --layout`. Exit 0, 1 on an
    unknown family or a config that lacks what the layout needs, or a CONFIG that is not a JSON
    object.
    """
    from .layouts import builtin

    try:
        with open(config, "rb") as f:
            values = json.loads(f.read(1 << 20))
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{config}: cannot read a JSON model config ({exc})") from None
    if not isinstance(values, dict):
        raise LayoutError(f"{config}: a model config is a JSON object")
    click.echo(json.dumps(builtin(family, values).to_json(), indent=2))


@layout_group.command("check")
@click.argument("file")
@click.option("--tp", default=None, type=click.IntRange(1), help="Also check that the layout fits this tensor-parallel degree.")
@click.option("--pp", default=None, type=click.IntRange(1), help="... this number of pipeline stages.")
@click.option("--dp", default=None, type=click.IntRange(1), help="... this data-parallel degree.")
@click.option("--cp", default=None, type=click.IntRange(1), help="... this context-parallel degree.")
@click.option("--zero", default=None, type=click.IntRange(0, 3), help="... this ZeRO stage.")
def layout_check_cmd(file: str, tp: int | None, pp: int | None, dp: int | None, cp: int | None, zero: int | None) -> None:
    """Check the layout file FILE (and, with --tp/--pp/--dp/--cp/--zero, that it fits that topology).

    Prints one line per problem. Exit 0 when sound, 1 when problems were found or FILE
    cannot be read.
    """
    from .layouts import layout_problems, parse_layout, topology_problems

    try:
        with open(file, "rb") as f:
            data = f.read(1 << 26)
    except OSError as exc:
        raise LayoutError(f"{file}: cannot read the layout file ({exc.strerror or exc})") from None
    problems = layout_problems(data)
    if not problems and any(n is not None for n in (tp, pp, dp, cp, zero)):
        t, p, d, c = tp or 1, pp or 1, dp or 1, cp or 1
        topology = ckptkit.Topology(world_size=t * p * d * c, tp=t, pp=p, dp=d, cp=c, zero_stage=zero or 0)
        problems = topology_problems(parse_layout(data, source=file), topology)
    for problem in problems:
        click.echo(f"ckptkit: error: {file}: {problem}", err=True)
    if problems:
        sys.exit(1)
    layout = parse_layout(data, source=file)
    click.echo(f"{file}: sound ({layout.name}: {len(layout.tensors())} tensors, {layout.num_layers} layers)")


def _init_torchrun() -> Any:
    """Join the torchrun job this process belongs to (gloo), or return None when run alone."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist


@cli.command("export")
@click.argument("src")
@click.argument("dst")
@click.option("--format", "fmt", default="hf", show_default=True, type=click.Choice(["hf", "dcp", "zarr"]),
              help="hf: Hugging Face model directory; dcp: torch.distributed.checkpoint; zarr: the topology-free form.")
@click.option("--dtype", default=None, type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Output dtype. hf: default bf16; dcp: default the saved dtype; zarr: always the saved dtype.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="hf: largest output file (5GB, 500MB, 2GiB, bytes).")
@click.option("--include-optimizer", is_flag=True, help="dcp: also export the optimizer state (zarr always has it).")
@click.option("--layout", "layout_file", default=None,
              help="hf: a layout file naming the model (default: the one SRC records), e.g. megatron-gpt for a converted Megatron GPT.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (the export report).")
def export_cmd(src: str, dst: str, fmt: str, dtype: str | None, max_shard_size: str, include_optimizer: bool, layout_file: str | None,
               as_json: bool) -> None:
    """Export the checkpoint at SRC (any topology) to DST: a Hugging Face model directory, a
    torch DCP checkpoint, or the zarr form (every tensor as a zarr v3 array, manifest beside it).

    Exit 0 when DST is complete, 1 on a ckptkit error (unmapped or missing tensors, DST exists;
    DST does not appear), 2 on bad usage or when SRC holds no committed checkpoint.
    """
    try:
        size = parse_size(max_shard_size)
    except CkptkitError as exc:
        _usage(f"--max-shard-size: {exc}")
    if fmt == "zarr" and dtype is not None:
        _usage("--dtype: the zarr form keeps every tensor in its saved dtype")
    if fmt == "hf" and include_optimizer:
        _usage("--include-optimizer: the hf format holds model weights only (use --format dcp or zarr)")
    if fmt != "hf" and layout_file is not None:
        _usage("--layout: names the model for --format hf; dcp and zarr keep the checkpoint's names")
    from .layouts import load_layout

    layout = load_layout(layout_file) if layout_file is not None else None
    with _progress("exporting", _shows_progress(as_json)) as update:
        report = ckptkit.export(src, dst, format=fmt, dtype=dtype, max_shard_bytes=size, include_optimizer=include_optimizer,
                                layout=layout, progress=update)
    if as_json:
        _emit_json(report)
        return
    total = sum(f.size for f in report.files)
    click.echo(
        f"{report.destination}: {len(report.tensors)} tensors ({report.format}, {report.dtype}) in "
        f"{len(report.files)} file(s), {total / 1e6:.1f} MB "
        f"(step {report.step}; {len(report.skipped)} tensors not exported)"
    )


@cli.command("convert")
@click.argument("src")
@click.argument("dst")
@click.option("--from", "source_format", default="auto", show_default=True,
              help="The format of SRC: auto (recognise it from the files) or a converter's name (dcp, deepspeed, hf, megatron).")
@click.option("--allow-skip", is_flag=True,
              help="Convert what can be converted and list the rest as skipped (default: any such entry fails).")
@click.option("--layout", "layout_file", default=None,
              help="A layout file for the model, recorded in DST (default: the one the converter knows, if any).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (the convert report).")
def convert_cmd(src: str, dst: str, source_format: str, allow_skip: bool, layout_file: str | None, as_json: bool) -> None:
    """Convert another tool's checkpoint at SRC (a torch DCP, DeepSpeed, Hugging Face or Megatron-Core directory) into a ckptkit checkpoint at DST.

    Every tensor and value of SRC is converted or listed as skipped with a reason; an entry
    that cannot be converted fails the conversion unless --allow-skip. --layout records the
    model's layout (e.g. `ckptkit layout builtin megatron-gpt model.json`), so that reshard and
    export need no --layout. Exit 0 when DST is committed, 1 on a ckptkit error (unknown
    format, unsafe or damaged source, a layout that does not fit, DST exists; DST does not
    appear), 2 on bad usage.
    """
    from .layouts import load_layout

    layout = load_layout(layout_file) if layout_file is not None else None
    names = ckptkit.list_converters()
    if source_format != "auto" and source_format not in names:
        _usage(f"--from: no converter for {source_format!r}; choose auto or one of: {', '.join(names) or 'none installed'}")
    if source_format == "auto":
        source_format = ckptkit.detect_format(src)
        click.echo(f"ckptkit: {src}: converting from {source_format} ({names[source_format]})", err=True)
    with _progress("converting", _shows_progress(as_json)) as update:
        report = ckptkit.convert(src, dst, source_format=source_format, allow_skip=allow_skip, progress=update, layout=layout)
    if as_json:
        _emit_json(report)
        return
    click.echo(
        f"{report.destination}: committed step {report.step} from {report.format} {report.source}: "
        f"{len(report.tensors)} tensors, {len(report.objects)} values, {report.files} file(s), "
        f"{report.bytes_written / 1e6:.1f} MB in {report.seconds:.2f} s; {len(report.skipped)} skipped"
    )
    for skipped in report.skipped:
        click.echo(f"skipped {skipped.source}: {skipped.reason}")


@cli.command("train")
@click.option("--tp", default=1, show_default=True, type=click.IntRange(1), help="Tensor-parallel degree.")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(1), help="Pipeline stages.")
@click.option("--dp", default=1, show_default=True, type=click.IntRange(1), help="Data-parallel degree.")
@click.option("--zero", default=0, show_default=True, type=click.IntRange(0, 3), help="ZeRO stage (0-3).")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(0), help="Global step to stop at.")
@click.option("--save-every", default=0, show_default=True, type=click.IntRange(0), help="Save every K steps and at the end (0: never).")
@click.option("--out", default="runs/train", show_default=True, help="Directory of the run's checkpoints.")
@click.option("--resume", default=None, help="A checkpoint to resume from, or 'latest' (under --out); nothing to resume is an error.")
@click.option("--resume-if-present", is_flag=True, help="With --resume latest: start a new run when --out holds no checkpoint yet.")
@click.option("--model", default="tiny", show_default=True, type=click.Choice(["tiny", "small", "base"]))
@click.option("--seed", default=1234, show_default=True, type=int)
@click.option("--log-jsonl", default=None, help="Append one JSON object per step (and per save, with \"event\": \"save\") to this file.")
@click.option("--sync-save", is_flag=True, help="Save in the training loop instead of in the background (to compare stalls).")
@click.option("--global-batch", default=8, show_default=True, type=click.IntRange(1), help="Samples per step.")
@click.option("--micro-batches", default=2, show_default=True, type=click.IntRange(1), help="Micro-batches per step and rank.")
@click.option("--seq-len", default=32, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=3e-3, show_default=True, type=float)
@click.option("--corpus", default=None, help="A text file to train on (default: the generated corpus).")
@click.option("--tie-embeddings", is_flag=True, help="Share the embedding and output head weights (pp 1 only).")
@click.option("--quiet", is_flag=True, help="Print nothing per step.")
def train_cmd(**options: Any) -> None:
    """Train the reference Llama-style model with TP x PP x DP (ZeRO 0-3), checkpointing through ckptkit.

    A new run (no --resume) into an --out that holds checkpoints is refused before anything is
    written: continue that run with --resume latest, or choose another --out.
    """
    from .trainer.train import config_from, launch, prepare

    quiet = options.pop("quiet")
    cfg = config_from(**options, echo=not quiet)
    start = prepare(cfg)
    first = os.environ.get("RANK", "0") == "0"
    if start.resume is not None and first:
        click.echo(f"ckptkit: train: {start.banner}", err=True)
    if start.resume is not None and start.step >= cfg.steps:
        if first:
            click.echo(f"ckptkit: train: {start.resume} is at step {start.step}, which is --steps: nothing to train", err=True)
        return
    launch(cfg, start)


@cli.command("demo")
@click.argument("out_dir", default="demo-out", required=False)
def demo_cmd(out_dir: str) -> None:
    """Train the tiny model on 8 ranks (TP 2 x PP 2 x DP 2, ZeRO-1) into OUT_DIR, then list, inspect, verify, diff and reload what it saved."""
    from .trainer.demo import run

    ok = run(out_dir, click.echo)
    sys.exit(0 if ok else 1)


def main() -> None:
    """Entry point: run the CLI, turning every failure into one line (and, with --json, an error object)."""
    try:
        cli.main(prog_name="ckptkit", standalone_mode=False)
    except Failure as failure:
        failure.show()
        sys.exit(failure.exit_code)
    except click.exceptions.Abort:
        _fail("aborted", EXIT_FAILED)
    except click.ClickException as exc:  # bad usage found while parsing, before the command ran
        where = f" (see '{exc.ctx.command_path} --help')" if isinstance(exc, click.UsageError) and exc.ctx else ""
        _fail(exc.format_message().rstrip(".") + where, exit_code_of(exc), error="UsageError", as_json="--json" in sys.argv[1:])
    except CkptkitError as exc:
        _fail(str(exc), exit_code_of(exc), error=type(exc).__name__)
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)
    except SystemExit:
        raise
    except Exception as exc:  # a bug, not a user mistake: say so in one line
        if os.environ.get("CKPTKIT_DEBUG"):
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (set CKPTKIT_DEBUG=1 for a traceback)", EXIT_INTERNAL,
              error="InternalError", as_json="--json" in sys.argv[1:])


if __name__ == "__main__":
    main()
