"""The commands that read one checkpoint (or two): inspect, verify, diff, and the layout commands."""

from __future__ import annotations

import json
import sys

import click

import ckptkit

from .. import CkptkitError, LayoutError
from .base import SHOWN, cli, emit_json, progress, shows_progress, torchrun_job


@cli.command("inspect")
@click.argument("path")
@click.option("--tensors", "show_tensors", is_flag=True, help="Also list every tensor: dtype, shape, kind, bytes, how it is cut.")
@click.option("--match", "match", metavar="GLOB", default="*", show_default=True, help="List only the tensors whose names match this glob (implies --tensors).")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (it always lists the tensors).")
def inspect_cmd(path: str, show_tensors: bool, match: str, as_json: bool) -> None:
    """Show what the checkpoint at PATH holds: step, topology, the model, tensors, bytes, assets, versions.

    Another tool's checkpoint is read through its adapter (what ``ckptkit convert`` would bring
    in, and what it would skip), nothing written.

    \b
    Examples:
      ckptkit inspect demo-out/run
      ckptkit inspect fixtures/deepspeed/zero3-fp32
      ckptkit inspect demo-out/run --tensors --match 'optimizer/*'
    """
    report = ckptkit.inspect(path, match=match)
    if as_json:
        emit_json(report)
    else:
        click.echo(report.render(tensors=show_tensors or match != "*"))


@cli.command("verify")
@click.argument("path")
@click.option("--quick", is_flag=True, help="Skip checksums; check presence, sizes, headers and tiling.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--workers", default=4, show_default=True, type=click.IntRange(1, 64), help="Threads reading ahead of the hashing.")
def verify_cmd(path: str, quick: bool, as_json: bool, workers: int) -> None:
    """Check the checkpoint at PATH against its manifest.

    Another tool's checkpoint (DeepSpeed, Megatron, DCP, Hugging Face, peft) is read through its
    adapter: its metadata, and every tensor checked against it (it has no checksums). Under
    torchrun (`torchrun --nproc-per-node 4 -m ckptkit.cli verify PATH`) the ranks split the files
    by bytes; rank 0 reports, every rank exits alike.

    Exit 0 when sound, 1 when problems were found, 2 on bad usage or when PATH holds no
    committed checkpoint.

    \b
    Examples:
      ckptkit verify demo-out/run
      ckptkit verify --quick --json demo-out/run/step_00000010
    """
    with torchrun_job() as (rank, world):  # no bar under torchrun: each rank hashes a share of the bytes
        report = _withprogress(path, quick, workers, show=world == 1 and shows_progress(as_json))
    if rank != 0:
        sys.exit(0 if report.ok else 1)
    if as_json:
        emit_json(report)
    else:
        for f in report.findings[:SHOWN]:
            click.echo(f"[{f.code}] {f.where}: {f.message}")
        state = "sound" if report.ok else f"{len(report.findings)} problem(s)"
        if len(report.findings) > SHOWN:
            state += f", the first {SHOWN} shown (--json lists all)"
        if report.read_through is None:
            checks = "sizes, headers, tiling" + ("" if quick else ", checksums")
        else:
            checks = (f"read through the {report.read_through} adapter: metadata" + ("" if quick else ", every tensor's bytes")
                      + "; the format has no checksums")
        click.echo(f"{report.source}: {state} ({report.files} files, {report.tensors} tensors; {checks})")
        if report.skipped:
            click.echo(f"note: {len(report.skipped)} entr{'y' if len(report.skipped) == 1 else 'ies'} `ckptkit convert` would "
                       f"refuse without --allow-skip (ckptkit inspect lists them)")
    sys.exit(0 if report.ok else 1)


def _withprogress(path: str, quick: bool, workers: int, *, show: bool) -> ckptkit.VerifyReport:
    if not show or quick:
        return ckptkit.verify(path, quick=quick, workers=workers)
    try:
        total = sum(f.size for f in ckptkit.read_manifest(path).files)
    except CkptkitError:
        return ckptkit.verify(path, quick=quick, workers=workers)
    hashed = [0]
    with progress("hashing", show) as update:
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

    \b
    Examples:
      ckptkit diff demo-out/run/step_00000010 demo-out/run/step_00000020
      ckptkit diff A B --atol 1e-6 --limit 5
    """
    kinds = ("param", "optimizer", "buffer", "other") + (("rng",) if include_rng else ())
    with progress("comparing", shows_progress(as_json)) as update:
        report = ckptkit.diff(a, b, atol=atol, rtol=rtol, kinds=kinds, progress=update)
    if as_json:
        emit_json(report.model_copy(update={"differences": report.differences[:limit]}))
    else:
        for d in report.differences[:limit]:
            detail = f"{d.mismatched}/{d.numel} differ, max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}" if d.numel else d.problem
            click.echo(f"{d.name}: {detail}")
        if len(report.differences) > limit:
            click.echo(f"... and {len(report.differences) - limit} more")
        if not report.objects_equal:
            click.echo("non-tensor values differ")
        verdict = "equal" if report.ok else f"{len(report.differences)} tensor(s) differ"
        click.echo(f"{verdict} ({report.tensors} tensors compared)")
    sys.exit(0 if report.ok else 1)



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

    \b
    Examples:
      ckptkit layout show demo-out/run > layout.json
    """
    from ..layouts import layout_for

    checkpoint = ckptkit.open(path)
    click.echo(json.dumps(layout_for(checkpoint.manifest, where=str(checkpoint.location)).to_json(), indent=2))


@layout_group.command("builtin")
@click.argument("family")
@click.argument("config")
def layout_builtin_cmd(family: str, config: str) -> None:
    """Print the built-in layout of model FAMILY for the model config in the JSON file CONFIG.

    Families: llama, llama-moe, hf, hf-llama, gpt2, megatron-gpt, torchtitan-llama,
    torchtitan-qwen3 (each with its own config keys; see the docs' Layouts and models page). For a checkpoint that records no layout: `ckptkit layout builtin megatron-gpt
    model.json > layout.json`, then `reshard --layout` or `export --layout`. Exit 0, 1 on an
    unknown family or a config that lacks what the layout needs, or a CONFIG that is not a JSON
    object.

    \b
    Examples:
      ckptkit layout builtin megatron-gpt config.json > layout.json
    """
    from ..layouts import builtin

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
@click.option("--ep", default=None, type=click.IntRange(1), help="... this expert-parallel degree (within --dp).")
@click.option("--zero", default=None, type=click.IntRange(0, 3), help="... this ZeRO stage.")
def layout_check_cmd(file: str, tp: int | None, pp: int | None, dp: int | None, cp: int | None, ep: int | None,
                     zero: int | None) -> None:
    """Check the layout file FILE (and, with --tp/--pp/--dp/--cp/--ep/--zero, that it fits that topology).

    Prints one line per problem. Exit 0 when sound, 1 when problems were found or FILE
    cannot be read.

    \b
    Examples:
      ckptkit layout check layout.json --tp 2 --pp 2 --dp 2 --zero 1
    """
    from ..layouts import layout_problems, parse_layout, topology_problems

    try:
        with open(file, "rb") as f:
            data = f.read(1 << 26)
    except OSError as exc:
        raise LayoutError(f"{file}: cannot read the layout file ({exc.strerror or exc})") from None
    problems = layout_problems(data)
    if not problems and any(n is not None for n in (tp, pp, dp, cp, ep, zero)):
        t, p, d, c = tp or 1, pp or 1, dp or 1, cp or 1
        topology = ckptkit.Topology(world_size=t * p * d * c, tp=t, pp=p, dp=d, cp=c, ep=ep or 1, zero_stage=zero or 0)
        problems = topology_problems(parse_layout(data, source=file), topology)
    for problem in problems:
        click.echo(f"ckptkit: error: {file}: {problem}", err=True)
    if problems:
        sys.exit(1)
    layout = parse_layout(data, source=file)
    click.echo(f"{file}: sound ({layout.name}: {len(layout.tensors())} tensors, {layout.num_layers} layers)")


@cli.command("compact")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def compact_cmd(path: str, as_json: bool) -> None:
    """Rewrite the incremental checkpoint at PATH as a full one, in place.

    Every tensor is written whole (its patches applied, every byte read checked) into new files
    of the checkpoint, then its manifest is replaced in one atomic write: it keeps its name, step
    and content, and reads no earlier checkpoint any more (retention may then release them). A
    full checkpoint is left as it is. Cut off before the end, nothing it holds has changed;
    `ckptkit clean` removes the files left behind.

    \b
    Examples:
      ckptkit compact runs/a/step_00000020
    """
    report = ckptkit.compact(path)
    if as_json:
        emit_json(report)
        return
    if not report.compacted:
        click.echo(f"{report.checkpoint}: a full checkpoint already (it reads no earlier one); nothing written")
        return
    click.echo(f"{report.checkpoint}: rewritten whole ({report.files_written} file(s), {ckptkit.human_bytes(report.bytes_written)}); "
               f"it read {', '.join(report.bases_before) or 'no earlier checkpoint'}"
               + (f" and {report.patches_before} patch(es)" if report.patches_before else "")
               + (f"; {report.kept_files} earlier file(s) kept for the checkpoints that read them" if report.kept_files else ""))
