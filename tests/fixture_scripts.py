"""The fixture-generating scripts under ``fixtures/`` as modules (their models, configs and expected values)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def fixture_script(name: str) -> ModuleType:
    """Return ``fixtures/<name>.py`` as a module, leaving no ``__pycache__`` in fixtures/."""
    spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    dont_write, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = dont_write
    return module
