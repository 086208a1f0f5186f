"""The CLI reference: every command's ``--help``, the one text the docs site's reference page
is made of (``docs/hooks.py``), so the page and the terminal never say different things."""

from __future__ import annotations

import click

from .base import cli

WIDTH = 100  # the page's column width; a terminal wraps to its own


def commands(group: click.Group = cli, prefix: str = "") -> list[tuple[str, click.Command]]:
    """Every command by its full name (``layout show``), in order, walked from the click group."""
    out: list[tuple[str, click.Command]] = []
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            out.extend(commands(command, f"{prefix}{name} "))
        else:
            out.append((f"{prefix}{name}", command))
    return out


def help_text(name: str, command: click.Command, columns: int | None = None) -> str:
    """What ``ckptkit NAME --help`` prints on a terminal `columns` wide (default: this one), where
    click wraps two columns short of the edge."""
    width = None if columns is None else max(columns - 2, 50)
    root = click.Context(cli, info_name="ckptkit", max_content_width=columns, terminal_width=width, **cli.context_settings)
    with click.Context(command, info_name=name, parent=root) as ctx:
        return command.get_help(ctx)


def markdown() -> str:
    """The reference page's generated part: a section per command, its help verbatim."""
    parts = []
    for name, command in commands():
        summary = command.get_short_help_str(limit=200)
        parts.append(f"## `ckptkit {name}`\n\n{summary}\n\n```text\n{help_text(name, command, WIDTH)}\n```\n")
    return "\n".join(parts)
