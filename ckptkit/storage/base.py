"""The storage protocol every backend implements, and key rules shared by all of them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import StorageError

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do beyond the basics.

    ``rename``: a prefix can be renamed atomically, so a checkpoint can be written under a
    temporary name and appear whole. ``local_files``: every key is a file of a local directory,
    whose path ``local_path(key)`` gives (for writers that need paths: tensorstore, torch DCP).
    """

    rename: bool
    local_files: bool = False


@runtime_checkable
class Storage(Protocol):
    """Byte storage under a root, addressed by relative POSIX keys.

    Writes are atomic per key: a reader sees the whole value or nothing, and a write that
    returned is durable. Call order for a checkpoint: write payloads, write the manifest,
    then (where ``capabilities.rename``) rename the temporary prefix.
    """

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def root(self) -> str:
        """Where the storage is, as users name it: a local directory or a URL ('' in memory)."""

    def local_path(self, key: str) -> str:
        """The file-system path of `key` where ``capabilities.local_files``.

        Raises:
            StorageError: the keys are not local files.
        """

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Return `length` bytes from `offset` (to the end when `length` is None)."""

    def readinto(self, key: str, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the bytes at `offset`; fail if the value is shorter."""

    def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill `buffers`, in order, with the consecutive bytes from `offset`, in one request (one
        open and vectored reads; one ranged GET); fail if the value is shorter. ``readinto`` is
        ``readv`` of one buffer: a wrapper counting reads overrides this one."""

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        """Store the concatenated chunks under `key` atomically and durably; return the size.

        The caller may reuse a chunk's buffer once the next chunk is requested: a backend
        that keeps chunks longer (to upload in parts) copies them."""

    def size(self, key: str) -> int:
        """Return the size of the value under `key`."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
        """Return the keys under `prefix` ('' for all), sorted.

        With ``recursive=False``, return only the immediate children, prefixes ending in '/'.
        """

    def is_prefix(self, key: str) -> bool:
        """Return True when `key` names a prefix that holds keys (a directory)."""

    def delete(self, prefix: str) -> None:
        """Delete `prefix` and every key under it; deleting nothing is not an error."""

    def rename(self, src: str, dst: str) -> None:
        """Move prefix `src` to `dst` atomically; `dst` must not exist."""

    def create(self, key: str, data: bytes) -> None:
        """Store `data` under `key` atomically and durably, only if `key` does not exist.

        Raises:
            CheckpointExistsError: `key` exists (another writer got there first).
        """


def byte_view(buffer: memoryview) -> memoryview:
    """`buffer` as a flat view of bytes (format ``B``, one dim)."""
    return buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative POSIX key, else raise StorageError.

    Refused: empty keys, absolute paths, backslashes, NUL, and '.' or '..' segments.
    """
    if not key or key.startswith("/") or "\\" in key or "\0" in key:
        raise StorageError(f"unsafe storage key {key!r}: keys are relative POSIX paths")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"unsafe storage key {key!r}: no empty, '.' or '..' segments")
    return key


def plain_name(name: str) -> bool:
    """Whether `name` is one plain name under a root (a checkpoint's): one path segment,
    printable, not hidden, not `.` or `..`."""
    return bool(name) and name.isprintable() and "/" not in name and "\\" not in name and not name.startswith(".")
