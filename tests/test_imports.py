"""Imports go one way: the library never imports the reference trainer; the trainer and the CLI use only public names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckptkit"
USERS = {"cli"}  # the command (a package), above the library (the trainer and its demo live in trainer/)


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
        if rel.parts[0] == "trainer" or rel.parts[0] in USERS:
            continue
        offenders += [f"{rel}: {m}" for m in _imports(path) if m == "ckptkit.trainer" or m.startswith("ckptkit.trainer.")]
    assert offenders == []


def test_the_import_walk_sees_relative_imports() -> None:
    assert "ckptkit.trainer.train" in _imports(PACKAGE / "cli" / "training.py")
    assert "ckptkit.layouts.reference_llama" in _imports(PACKAGE / "trainer" / "config.py")


def _public() -> dict[str, set[str]]:
    import ckptkit
    import ckptkit.layouts

    return {"ckptkit": set(ckptkit.__all__), "ckptkit.layouts": set(ckptkit.layouts.__all__)}


def _private_uses(path: Path) -> list[str]:
    """The names `path` takes from ckptkit that are not public (the trainer's and the command's own modules aside)."""
    public = _public()
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if not module.startswith("ckptkit") or module.startswith(("ckptkit.trainer", "ckptkit.cli")):
                continue
            if module not in public:
                out.append(f"from {module}")
            else:
                out += [f"{module}.{a.name}" for a in node.names if a.name not in public[module]]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("ckptkit.") and not a.name.startswith("ckptkit.trainer")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ckptkit":
            if node.attr not in public["ckptkit"]:
                out.append(f"ckptkit.{node.attr}")
    return out


def test_the_trainer_and_the_cli_use_only_public_names() -> None:
    offenders = {}
    for path in [*sorted((PACKAGE / "trainer").glob("*.py")), *sorted((PACKAGE / "cli").glob("*.py"))]:
        found = _private_uses(path)
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}


def test_every_public_name_resolves_and_dir_lists_the_lazy_ones() -> None:
    import ckptkit

    for module, names in _public().items():
        loaded = __import__(module, fromlist=["_"])
        for name in names:
            assert getattr(loaded, name) is not None, f"{module}.{name}"
    assert {"save", "load", "open", "CheckpointManager", "VerifyReport"} <= set(dir(ckptkit))
