"""The commands over a root of checkpoints: ls, clean, prune."""

from __future__ import annotations


import click

import ckptkit

from .base import cli, emit_json


@cli.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def ls_cmd(root: str, as_json: bool) -> None:
    """List what ROOT holds: committed checkpoints (step, topology, size, time, latest), other
    directories named for what they are, leftovers of interrupted saves, and warnings.

    \b
    Examples:
      ckptkit ls demo-out/run
      ckptkit ls fixtures/megatron --json
    """
    report = ckptkit.list_checkpoints(root)
    if as_json:
        emit_json(report)
        return
    if report.kind == "run-root" and not report.checkpoints:
        click.echo(f"no committed checkpoint under {root}")
    for c in report.checkpoints:
        size = ckptkit.human_bytes(c.payload_bytes) if c.payload_bytes is not None else "?"
        topology = c.topology.describe() if c.topology is not None else "topology ?"
        mark = "\t<- latest" if c.is_latest else f"\t(read through the {c.read_through} adapter)" if c.read_through else ""
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

    \b
    Examples:
      ckptkit clean demo-out/run --dry-run
    """
    report = ckptkit.clean(root, dry_run=dry_run)
    if as_json:
        emit_json(report)
        return
    verb = "would remove" if dry_run else "removed"
    for item in report.removed:
        click.echo(f"{verb} {item.name}\t{item.reason}")
    for name in report.busy:
        click.echo(f"kept {name}\ta live read lease holds it")
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
    the newest, one a live read lease holds, or one whose files an incremental save that
    stays reads.

    \b
    Examples:
      ckptkit prune demo-out/run --keep-last 2 --keep-every 100 --dry-run
    """
    report = ckptkit.prune(root, keep_last=keep_last, keep_every=keep_every, dry_run=dry_run)
    if as_json:
        emit_json(report)
        return
    verb = "would delete" if dry_run else "deleted"
    for item in report.removed:
        click.echo(f"{verb} {item.name}\t{item.reason}")
    for name in report.busy:
        click.echo(f"kept {name}\ta live read lease holds it")
    for name in report.bases:
        click.echo(f"kept {name}\ta checkpoint that stays reads its files (an incremental save's base)")
    click.echo(f"{root}: {verb} {len(report.removed)} checkpoint(s), {len(report.kept)} kept")
