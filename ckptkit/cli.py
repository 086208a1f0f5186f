"""The ``ckptkit`` command: a thin click layer over the library.

Exit codes: 0 success; 1 a ckptkit error (or, for verify, problems found); 2 bad usage or,
for verify, no checkpoint at the path; 3 an internal error (a bug: please report it).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from .errors import CheckpointNotFoundError, CkptkitError

F = TypeVar("F", bound=Callable[..., Any])


def _fail(message: str, code: int) -> None:
    click.echo(f"ckptkit: error: {message}", err=True)
    sys.exit(code)


def _emit_json(model: Any) -> None:
    data = model.model_dump(mode="json") if hasattr(model, "model_dump") else model
    click.echo(json.dumps(data, indent=2, sort_keys=False))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptkit")
def cli() -> None:
    """Checkpoints for sharded large-model training: list, inspect, verify, demo."""


@cli.command("ls")
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def ls_cmd(root: str, as_json: bool) -> None:
    """List the committed checkpoints under ROOT and name the leftovers."""
    from .catalog import list_root
    from .reports import listing_report

    report = listing_report(list_root(root))
    if as_json:
        _emit_json(report)
        return
    if not report.checkpoints:
        click.echo(f"no committed checkpoint under {root}")
    for c in report.checkpoints:
        mark = "  <- latest" if c.name == report.latest else ""
        click.echo(f"{c.name}\tstep {c.step}{mark}")
    for left in report.leftovers:
        click.echo(f"{left.name}\tleftover: {left.reason}")


@cli.command("inspect")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def inspect_cmd(path: str, as_json: bool) -> None:
    """Show what the checkpoint at PATH holds: step, topology, tensors, bytes, assets, versions."""
    from .inspector import inspect, render

    report = inspect(path)
    if as_json:
        _emit_json(report)
    else:
        click.echo(render(report))


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
    try:
        report = _with_progress(path, quick, workers, show=not as_json and sys.stderr.isatty())
    except CheckpointNotFoundError as exc:
        _fail(str(exc), 2)
        return
    if as_json:
        _emit_json(report)
    else:
        for f in report.findings:
            click.echo(f"[{f.code}] {f.where}: {f.message}")
        state = "sound" if report.ok else f"{len(report.findings)} problem(s)"
        checks = "sizes, headers, tiling" + ("" if quick else ", checksums")
        click.echo(f"{report.path}: {state} ({report.files_checked} files, {report.tensors} tensors; {checks})")
    sys.exit(0 if report.ok else 1)


def _with_progress(path: str, quick: bool, workers: int, *, show: bool) -> Any:
    from .verifier import verify

    if not show or quick:
        return verify(path, quick=quick, workers=workers)
    from .catalog import read_manifest, resolve

    try:
        total = sum(f.size for f in read_manifest(resolve(path)).files)
    except CkptkitError:
        return verify(path, quick=quick, workers=workers)
    with click.progressbar(length=total, label="hashing", file=sys.stderr) as bar:
        return verify(path, quick=quick, workers=workers, progress=bar.update)


@cli.command("demo")
@click.argument("out_dir", default="demo-out", required=False)
def demo_cmd(out_dir: str) -> None:
    """Save a small sharded checkpoint from 4 ranks into OUT_DIR, then list, inspect, verify and load it."""
    from .demo import run

    ok = run(out_dir, click.echo)
    sys.exit(0 if ok else 1)


def main() -> None:
    """Entry point: run the CLI, turning ckptkit errors into one-line messages."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        _fail("aborted", 1)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except CkptkitError as exc:
        _fail(str(exc), 1)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except SystemExit:
        raise
    except Exception as exc:  # a bug, not a user mistake: say so in one line
        if os.environ.get("CKPTKIT_DEBUG"):
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (set CKPTKIT_DEBUG=1 for a traceback)", 3)


if __name__ == "__main__":
    main()
