"""Payload checksums, computed while bytes stream past.

xxh3-128 is the default: it runs near 10 GB/s per core here (sha256: 1.4 GB/s), about 25 times
the durable write speed of the disk, so hashing while writing costs next to nothing, and 128
bits make an accidental collision negligible. It guards against corruption, not tampering;
sha256 is read too for manifests that ask for it.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import xxhash

from .errors import ManifestError

ALGORITHM = "xxh3-128"


class _Hash(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


class Hasher:
    """A running checksum; ``digest()`` gives ``"<algorithm>:<hex>"`` as the manifest stores it."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        self.algorithm = algorithm
        self._h: _Hash
        if algorithm == "xxh3-128":
            self._h = xxhash.xxh3_128()
        elif algorithm == "sha256":
            self._h = hashlib.sha256()
        else:
            raise ManifestError(f"unknown checksum algorithm {algorithm!r}; known: xxh3-128, sha256")

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def digest(self) -> str:
        return f"{self.algorithm}:{self._h.hexdigest()}"


def hasher_for(checksum: str) -> Hasher:
    """Return a fresh hasher of the algorithm named in a stored ``"<algorithm>:<hex>"`` checksum."""
    algorithm, sep, _ = checksum.partition(":")
    if not sep:
        raise ManifestError(f"checksum {checksum!r} is not '<algorithm>:<hex>'")
    return Hasher(algorithm)


def checksum_of(data: bytes | bytearray | memoryview, algorithm: str = ALGORITHM) -> str:
    h = Hasher(algorithm)
    h.update(data)
    return h.digest()
