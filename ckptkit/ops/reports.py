"""What several commands' reports share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class SkippedEntry(BaseModel):
    """An entry that was not brought across, and why: of a source not converted (convert, and
    verify and inspect of another tool's checkpoint, which say what convert would skip), or of a
    checkpoint not exported (export). Every report lists skipped entries as these."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str  # the entry's name where it was (the source's key; the checkpoint's tensor for export)
    reason: str
