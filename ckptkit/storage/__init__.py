"""Storage backends: a narrow protocol over keys relative to a root, and the backends that implement it."""

from __future__ import annotations

import os
from collections.abc import Callable

from ..errors import StorageError
from .base import Capabilities, Storage, check_key, plain_name
from .local import LocalStorage
from .memory import MemoryStorage

__all__ = [
    "SCHEMES", "Capabilities", "LocalStorage", "MemoryStorage", "Storage", "check_key", "local_path", "open_storage", "plain_name",
    "register_scheme",
]


def local_path(storage: Storage, key: str, purpose: str) -> str:
    """Return the filesystem path of `key`, for writers that need one (tensorstore, torch DCP).

    Raises:
        StorageError: the storage's keys are not local files.
    """
    if not storage.capabilities.local_files:
        raise StorageError(f"{storage!r}: {purpose} is written to a local directory only")
    return storage.local_path(key)


# URL scheme -> the backend of a root URL with that scheme; local paths have none.
SCHEMES: dict[str, Callable[[str], Storage]] = {}


def register_scheme(scheme: str, factory: Callable[[str], Storage]) -> None:
    """Make `open_storage` open root URLs ``scheme://...`` with `factory` (called with the URL)."""
    SCHEMES[scheme] = factory


def _s3(url: str) -> Storage:
    from .s3 import S3Storage

    return S3Storage(url)


register_scheme("file", lambda url: LocalStorage(url[len("file://") :]))
register_scheme("s3", _s3)


def open_storage(url: str | os.PathLike[str]) -> Storage:
    """Return the storage backend for a root URL or local path.

    Raises:
        StorageError: the URL scheme has no backend.
    """
    text = os.fspath(url)
    if "://" not in text:
        return LocalStorage(text)
    scheme = text.split("://", 1)[0]
    factory = SCHEMES.get(scheme)
    if factory is None:
        supported = ", ".join(f"{s}://" for s in sorted(SCHEMES))
        raise StorageError(f"{text}: no storage backend for scheme {scheme!r} (supported: local paths, {supported})")
    return factory(text)
