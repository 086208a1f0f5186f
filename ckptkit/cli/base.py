"""What every ``ckptkit`` command shares: the exit codes, failures shown as one line (and an
error object with --json), progress bars, JSON output, and the command group itself."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click

import ckptkit

from .. import CheckpointNotFoundError, CkptkitError, LayoutError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
SHOWN = 10  # problems a command prints before it counts the rest (as the library's messages do)


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
            emit_json(ckptkit.ErrorReport(error=self.error, message=self.message, exit_code=self.exit_code))
        click.echo(f"ckptkit: error: {self.message}", err=True)


class Command(click.Command):
    """A command whose ckptkit errors become a `Failure` that knows whether --json was given."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (CkptkitError, click.UsageError) as exc:
            message = exc.format_message() if isinstance(exc, click.UsageError) else str(exc)
            error = "UsageError" if isinstance(exc, click.UsageError) else type(exc).__name__
            raise Failure(error, message, exit_code_of(exc), bool(ctx.params.get("as_json"))) from exc


class Group(click.Group):
    command_class = Command
    group_class = type


def fail(message: str, code: int, *, error: str = "CkptkitError", as_json: bool = False) -> NoReturn:
    Failure(error, message, code, as_json).show()
    sys.exit(code)


def usage(message: str) -> NoReturn:
    """Refuse options that do not go together (exit 2, like any bad usage)."""
    raise click.UsageError(message)


@contextlib.contextmanager
def progress(label: str, show: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A (done, total) callback drawing a progress bar on stderr, or None when `show` is False
    (piped, or --json): long work shows progress on a terminal and stays quiet otherwise.

    The label shows at once (``exporting ...``), before the work imports torch or plans, so a
    terminal never sits blank; the bar draws over it, and it is cleared if no bar came. A warning
    raised meanwhile gets a line of its own (the label is drawn again after it)."""
    if not show:
        yield None
        return
    sys.stderr.write(f"{label} ...")
    sys.stderr.flush()
    with contextlib.ExitStack() as stack:
        bar: list[Any] = []
        stack.callback(lambda: None if bar else (sys.stderr.write("\r\033[K"), sys.stderr.flush()))
        shown = warnings.showwarning

        def show_apart(*args: Any, **kwargs: Any) -> None:
            sys.stderr.write("\n" if bar else "\r\033[K")
            shown(*args, **kwargs)
            if not bar:
                sys.stderr.write(f"{label} ...")
            sys.stderr.flush()

        warnings.showwarning = show_apart
        stack.callback(setattr, warnings, "showwarning", shown)

        def update(done: int, total: int) -> None:
            if not bar:
                bar.append(stack.enter_context(click.progressbar(length=max(total, 1), label=label, file=sys.stderr)))
            bar[0].update(min(done, total) - bar[0].pos)

        yield update


def shows_progress(as_json: bool) -> bool:
    return not as_json and sys.stderr.isatty()


def emit_json(model: Any) -> None:
    data = model.model_dump(mode="json") if hasattr(model, "model_dump") else model
    click.echo(json.dumps(data, indent=2, sort_keys=False))


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="ckptkit")
def cli() -> None:
    """Checkpoints for sharded large-model training: list, inspect, verify, diff, reshard, export, convert, layout, clean, prune, train, demo."""



@contextlib.contextmanager
def torchrun_job() -> Iterator[tuple[int, int]]:
    """Run the command's work in the torchrun job this process belongs to (gloo; alone: rank 0 of
    1): yield (rank, world size), leave the process group at the end. A ckptkit error on a rank
    other than 0 ends that process with the error's exit code, unsaid: rank 0 says it, once."""
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        yield 0, 1
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        yield rank, dist.get_world_size()
    except CkptkitError as exc:
        if rank:
            sys.exit(exit_code_of(exc))
        raise
    finally:
        dist.destroy_process_group()



def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None) -> str:
    return f"ckptkit: warning: {str(message).removeprefix('ckptkit: ')}\n"


def main() -> None:
    """Entry point: run the CLI, turning every failure into one line (and, with --json, an error
    object), and every warning into one line."""
    warnings.formatwarning = _one_line_warning
    try:
        cli.main(prog_name="ckptkit", standalone_mode=False)
    except Failure as failure:
        failure.show()
        sys.exit(failure.exit_code)
    except click.exceptions.Abort:
        fail("aborted", EXIT_FAILED)
    except click.ClickException as exc:  # bad usage found while parsing, before the command ran
        where = f" (see '{exc.ctx.command_path} --help')" if isinstance(exc, click.UsageError) and exc.ctx else ""
        fail(exc.format_message().rstrip(".") + where, exit_code_of(exc), error="UsageError", as_json="--json" in sys.argv[1:])
    except CkptkitError as exc:
        fail(str(exc), exit_code_of(exc), error=type(exc).__name__)
    except KeyboardInterrupt:
        fail("interrupted", EXIT_INTERRUPTED)
    except SystemExit:
        raise
    except Exception as exc:  # a bug, not a user mistake: say so in one line
        if os.environ.get("CKPTKIT_DEBUG"):
            raise
        fail(f"internal error: {type(exc).__name__}: {exc} (set CKPTKIT_DEBUG=1 for a traceback)", EXIT_INTERNAL,
              error="InternalError", as_json="--json" in sys.argv[1:])


