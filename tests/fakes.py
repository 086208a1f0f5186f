"""Storage fakes for tests: fault injection and byte counting over the in-memory backend."""

from __future__ import annotations

import errno
from collections.abc import Iterable, Sequence

from ckptkit.storage import MemoryStorage
from ckptkit.storage.base import Buffer


class FaultyStorage(MemoryStorage):
    """Fails the n-th write (1-based) with ENOSPC, after consuming part of its chunks."""

    def __init__(self, fail_write: int) -> None:
        super().__init__()
        self.fail_write = fail_write
        self.writes = 0

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        self.writes += 1
        if self.writes == self.fail_write:
            for _ in chunks:
                break
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(key, chunks)


class CountingStorage(MemoryStorage):
    """Counts the bytes read from each key."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read: dict[str, int] = {}

    def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:  # readinto calls it too
        super().readv(key, offset, buffers)
        self.bytes_read[key] = self.bytes_read.get(key, 0) + sum(b.nbytes for b in buffers)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        data = super().read(key, offset, length)
        self.bytes_read[key] = self.bytes_read.get(key, 0) + len(data)
        return data
