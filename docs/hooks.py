"""mkdocs hooks: the CLI reference page's commands come from the click commands themselves."""

from __future__ import annotations

from typing import Any

MARK = "<!-- the commands' --help, generated -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARK not in markdown:
        return markdown
    from ckptkit.cli.reference import markdown as reference

    return markdown.replace(MARK, reference())
