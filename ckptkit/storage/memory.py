"""In-memory storage for tests: the same contract as the file-system backend, no disk."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ..errors import StorageError
from .base import Buffer, Capabilities, byte_view, check_key


class MemoryStorage:
    """A dict of bytes behind the storage protocol; thread-safe."""

    root = ""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(rename=True)

    def local_path(self, key: str) -> str:
        raise StorageError(f"{key}: an in-memory storage has no files")

    def _get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._data[key]
            except KeyError:
                raise StorageError(f"{key}: no such key") from None

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        data = self._get(key)
        end = len(data) if length is None else offset + length
        if end > len(data):
            raise StorageError(f"{key}: short read, wanted {end - offset} bytes at {offset}, have {len(data)}")
        return data[offset:end]

    def readinto(self, key: str, offset: int, buffer: memoryview) -> None:
        self.readv(key, offset, [buffer])

    def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [byte_view(b) for b in buffers]
        data = self._get(key)
        want = sum(len(v) for v in views)
        if offset + want > len(data):
            raise StorageError(f"{key}: short read, wanted {want} bytes at {offset}, have {len(data)}")
        for view in views:
            view[:] = data[offset : offset + len(view)]
            offset += len(view)

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        check_key(key)
        data = b"".join(bytes(memoryview(c).cast("B")) for c in chunks)
        with self._lock:
            if any(k.startswith(key + "/") for k in self._data):
                raise StorageError(f"{key}: is a prefix holding other keys")
            self._data[key] = data
        return len(data)

    def create(self, key: str, data: bytes) -> None:
        from ..errors import CheckpointExistsError

        check_key(key)
        with self._lock:
            if key in self._data or any(k.startswith(key + "/") for k in self._data):
                raise CheckpointExistsError(f"{key}: already exists (another writer got there first)")
            self._data[key] = bytes(data)

    def size(self, key: str) -> int:
        return len(self._get(key))

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._data or any(k.startswith(key + "/") for k in self._data)

    def is_prefix(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return any(k.startswith(key + "/") for k in self._data)

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
        head = f"{check_key(prefix)}/" if prefix else ""
        with self._lock:
            keys = [k for k in self._data if k.startswith(head)]
        if recursive:
            return sorted(keys)
        children = set()
        for k in keys:
            rest = k[len(head) :]
            first, sep, _ = rest.partition("/")
            children.add(head + first + ("/" if sep else ""))
        return sorted(children)

    def delete(self, prefix: str) -> None:
        check_key(prefix)
        with self._lock:
            for k in [k for k in self._data if k == prefix or k.startswith(prefix + "/")]:
                del self._data[k]

    def rename(self, src: str, dst: str) -> None:
        check_key(src)
        check_key(dst)
        with self._lock:
            if any(k == dst or k.startswith(dst + "/") for k in self._data):
                raise StorageError(f"{dst}: already exists, refusing to replace it")
            moved = {k: v for k, v in self._data.items() if k == src or k.startswith(src + "/")}
            if not moved:
                raise StorageError(f"{src}: no such key or prefix")
            for k, v in moved.items():
                del self._data[k]
                self._data[dst + k[len(src) :]] = v
