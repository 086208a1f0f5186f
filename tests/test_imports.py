"""Imports go one way: the library never imports the reference trainer (the trainer, the CLI and the demo are its users)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckptkit"
USERS = {"cli.py", "demo.py"}  # application modules, above the library


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, absolute (``ckptkit.x.y``)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            out += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return out


def test_no_library_module_imports_the_trainer() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "trainer" or str(rel) in USERS:
            continue
        offenders += [f"{rel}: {m}" for m in _imports(path) if m == "ckptkit.trainer" or m.startswith("ckptkit.trainer.")]
    assert offenders == []


def test_the_import_walk_sees_relative_imports() -> None:
    assert "ckptkit.trainer.train" in _imports(PACKAGE / "demo.py")
    assert "ckptkit.layouts.reference_llama" in _imports(PACKAGE / "trainer" / "config.py")
