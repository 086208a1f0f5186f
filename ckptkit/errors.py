"""Errors raised by ckptkit: one base class, a few leaves that also subclass the matching builtin."""

from __future__ import annotations

from collections.abc import Sequence


class CkptkitError(Exception):
    """Base class of every error ckptkit raises on purpose."""


class ManifestError(CkptkitError, ValueError):
    """A manifest is malformed, of an unknown format, or of a schema version this reader cannot read."""


class LayoutError(CkptkitError, ValueError):
    """Shards do not tile their tensor, or a requested layout is impossible."""


class IntegrityError(CkptkitError, ValueError):
    """Payload bytes disagree with the manifest (size, checksum, header)."""


class StorageError(CkptkitError, OSError):
    """A storage backend failed to read, write, list or delete."""


class CheckpointNotFoundError(CkptkitError, FileNotFoundError):
    """No committed checkpoint at the given location."""


class ForeignCheckpointError(CheckpointNotFoundError):
    """The location holds another tool's checkpoint (or an export ckptkit reads back), not a
    ckptkit one: ``kind`` says which (``ckptkit.io.kinds``); the commands that only read a
    checkpoint read it through its adapter, the others name the ``ckptkit convert`` that brings it in."""

    def __init__(self, message: str, *, kind: str, path: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.path = path


class CheckpointExistsError(CkptkitError, FileExistsError):
    """A committed checkpoint already exists where a new one would be written."""


class RunError(CkptkitError, ValueError):
    """A training run cannot start as asked (nothing to resume, resumed past its last step, or
    with another model)."""


SHOWN = 10  # problems a message lists before it counts the rest
WIDTH = 300  # characters of one problem a message shows


def summarize(problems: Sequence[str], *, limit: int = SHOWN, width: int = WIDTH) -> str:
    """Join the first `limit` problems, each cut at `width` characters, and count the rest: an
    error message stays one readable line however many findings there are."""
    shown = [p if len(p) <= width else p[: width - 3] + "..." for p in problems[:limit]]
    more = len(problems) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
