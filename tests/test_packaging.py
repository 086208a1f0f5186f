"""The distribution ships every package of the source tree (an editable install would hide a miss)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_for_the_wheel() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "ckptkit").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert found and found <= listed, sorted(found - listed)
