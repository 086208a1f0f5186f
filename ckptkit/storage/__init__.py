"""Storage backends: a narrow protocol over keys relative to a root, and the backends that implement it."""

from __future__ import annotations

import os

from .base import Capabilities, Storage, check_key
from .local import LocalStorage
from .memory import MemoryStorage

__all__ = ["Capabilities", "LocalStorage", "MemoryStorage", "Storage", "check_key", "local_path", "open_storage"]


def local_path(storage: Storage, key: str, purpose: str) -> str:
    """Return the filesystem path of `key`, for writers that need one (tensorstore, torch DCP).

    Raises:
        StorageError: the storage is not a local directory.
    """
    from ..errors import StorageError

    if not isinstance(storage, LocalStorage):
        raise StorageError(f"{storage!r}: {purpose} is written to a local directory only")
    return storage.path(key)


def open_storage(url: str | os.PathLike[str]) -> Storage:
    """Return the storage backend for a root URL or local path.

    Raises:
        StorageError: the URL scheme has no backend.
    """
    from ..errors import StorageError

    text = os.fspath(url)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme == "file":
            return LocalStorage(text[len("file://") :])
        if scheme == "s3":
            from .s3 import S3Storage

            return S3Storage(text)
        raise StorageError(f"{text}: no storage backend for scheme {scheme!r} (supported: local paths, file://, s3://)")
    return LocalStorage(text)
