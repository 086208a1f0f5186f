"""Errors raised by ckptkit: one base class, a few leaves that also subclass the matching builtin."""

from __future__ import annotations


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


class CheckpointExistsError(CkptkitError, FileExistsError):
    """A committed checkpoint already exists where a new one would be written."""


class RunError(CkptkitError, ValueError):
    """A training run cannot start as asked (resumed past its last step, or with another model)."""
