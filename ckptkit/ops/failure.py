"""What a command prints on stdout with ``--json`` when it fails (``schemas/cli/error.v1.schema.json``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class ErrorReport(BaseModel):
    """A failed command: the error's class, its one-line message, and the exit code."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: Literal[False] = False
    error: str  # the error class (CheckpointNotFoundError, LayoutError, ...; UsageError for bad usage)
    message: str
    exit_code: int
