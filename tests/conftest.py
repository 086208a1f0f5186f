"""Shared test helpers: where the committed fixtures are, the fixture script, the real ckptkit command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .fixture_scripts import fixture_script
from .cuda_fakes import fake_cuda  # noqa: F401  (a fixture for the ordering of CUDA copies)
from .s3server import s3_bucket, s3_server  # noqa: F401  (fixtures for the S3 tests)



def _ckptkit_command() -> list[str]:
    """Return the installed ``ckptkit`` console script (ckptkit.cli:main), or ``python -m ckptkit.cli``."""
    script = Path(sys.executable).with_name("ckptkit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ckptkit.cli"]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if k != "CKPTKIT_DEBUG"}, **(env or {})}
    return subprocess.run(
        [*_ckptkit_command(), *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def _run_in_pty(*args: str) -> tuple[int, str, str]:
    """Run ckptkit with stderr on a pseudo-terminal (stdout piped); return code, stdout, the terminal's text."""
    import pty

    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CKPTKIT_DEBUG"}
    proc = subprocess.Popen([*_ckptkit_command(), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    seen = b""
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the other end closed: the command has exited
            break
        if not data:
            break
        seen += data
    os.close(master)
    out = proc.stdout.read().decode() if proc.stdout else ""
    return proc.wait(timeout=120), out, seen.decode(errors="replace")


@pytest.fixture
def run_in_pty() -> Callable[..., tuple[int, str, str]]:
    """Return a function that runs ``ckptkit`` with stderr on a pseudo-terminal: (exit code, stdout, what the terminal showed)."""
    return _run_in_pty


@pytest.fixture
def run_ckptkit() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Return a function that runs the real ``ckptkit`` entry point in a fresh process (stdout, stderr apart)."""
    return _run


@pytest.fixture(scope="session")
def make_fixtures() -> ModuleType:
    """Return fixtures/make_fixtures.py as a module (its expected values and ``main``)."""
    return fixture_script("make_fixtures")


def cli_schema(name: str) -> dict[str, Any]:
    """The current JSON Schema of command `name`'s --json report (``schemas/cli/<name>.v<N>.schema.json``)."""
    from ckptkit.schemas import cli_schema_path

    return json.loads((Path(__file__).resolve().parents[1] / "schemas" / cli_schema_path(name)).read_text(encoding="utf-8"))
