"""Checks every converter's tests share: a one-line CLI error, and no destination left behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def one_line_error(stderr: str) -> str:
    """The CLI's error line, asserting it is the only line and no traceback."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("ckptkit: error: ") and "Traceback" not in stderr
    return lines[0]


def assert_nothing_written(tmp_path: Path, dst: Path) -> None:
    """Neither `dst` nor a staging directory of it exists."""
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{dst.name}.tmp-")]


def megatron_common(path: Any) -> Any:
    """A Megatron-Core export's ``common.pt``, loaded as megatron-core loads it (its Megatron-LM
    ``args`` an ``argparse.Namespace``, which megatron-core allows)."""
    import argparse

    import torch

    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, weights_only=True)
