"""The one writer: stream a payload file to storage while hashing it (block checksums, and the
file checksum derived from them), its block digests to the file's sidecar, and the manifest
entry of what was written."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ..manifest import SIDECAR_SUFFIX, BlockChecksums, FileEntry
from .safetensors import build_header
from ..storage import Storage
from .checksum import BlockHasher, FileHasher
from .commit import Staging

HEADER_METADATA = {"format": "pt", "producer": "ckptkit"}


@dataclass(frozen=True, slots=True)
class Written:
    """A file as written: its path (as planned), size, whole-file checksum and block checksums
    (None for a file written without them)."""

    path: str
    size: int
    checksum: str
    blocks: BlockChecksums | None

    def entry(self, path: str | None = None, role: str = "tensors") -> FileEntry:
        """The manifest entry of the file, under `path` (default: as planned)."""
        return FileEntry(path=self.path if path is None else path, size=self.size, checksum=self.checksum,
                         role=role, blocks=self.blocks)  # type: ignore[arg-type]  # role: a Literal


def blocks_of(hasher: BlockHasher) -> BlockChecksums:
    """The block checksums of a file, its digests in the manifest (the memory tier's, and a zarr chunk's)."""
    return BlockChecksums(size=hasher.block, digests=base64.b64encode(hasher.finish()).decode("ascii"))


def write_stream(
    storage: Storage, key: str, path: str, chunks: Iterable[memoryview], size: int, *, blocks: bool = True,
    sidecar: bool = True,
) -> Written:
    """Write `chunks` (exactly `size` bytes in all) as the file `key`, hashing them on the way
    (with `blocks`, also block by block, as every payload a ckptkit reader reads needs). The
    block digests go to the file's sidecar, ``key + SIDECAR_SUFFIX``, written after the file
    (with `sidecar` false, into the manifest entry instead).

    Raises:
        StorageError: the write failed (what was written under `key` is left to the caller's
            discard of its staging).
    """
    hasher = FileHasher(size, blocks=blocks)

    def hashed() -> Iterator[memoryview]:
        for chunk in chunks:
            hasher.update(chunk)
            yield chunk

    written = storage.write(key, hashed())
    if hasher.blocks is None:
        return Written(path, written, hasher.digest(), None)
    if not sidecar:
        return Written(path, written, hasher.digest(), blocks_of(hasher.blocks))
    digests = hasher.blocks.finish()
    storage.write(key + SIDECAR_SUFFIX, [memoryview(digests)])
    return Written(path, written, hasher.digest(), BlockChecksums(size=hasher.blocks.block))


def write_safetensors(
    storage: Storage, key: str, path: str, tensors: Sequence[tuple[str, str, tuple[int, ...]]], bodies: Iterable[memoryview],
    *, metadata: dict[str, str] | None = None, blocks: bool = True, sidecar: bool = True,
) -> Written:
    """Write a safetensors file of `tensors` ((key, dtype, shape), in file order) whose bytes come,
    in the same order, from `bodies`; hash it on the way (see `write_stream`)."""
    prefix, entries = build_header(list(tensors), HEADER_METADATA if metadata is None else metadata)
    size = max((e.end for e in entries.values()), default=len(prefix))

    def chunks() -> Iterator[memoryview]:
        yield memoryview(prefix)
        yield from bodies

    return write_stream(storage, key, path, chunks(), size, blocks=blocks, sidecar=sidecar)


def write_small(storage: Storage, stage: Staging, key: str, data: bytes, *, role: str) -> FileEntry:
    """Write a small non-payload file (a tokenizer file) under the staging `stage`, hashed whole;
    return its manifest entry."""
    written = write_stream(storage, stage.key(key), key, [memoryview(data)], len(data), blocks=False)
    return written.entry(stage.path(key), role=role)


def hash_padded(data: memoryview, pad: int) -> tuple[str, BlockChecksums]:
    """The checksums of a file holding `data` followed by `pad` zero bytes (a zarr chunk: its file
    checksum is the xxh3-128 of the whole file, which the export report gives for every file)."""
    hasher = FileHasher(len(data) + pad, whole=True)
    hasher.update(data)
    zeros = bytes(min(pad, 1 << 20))
    while pad > 0:
        hasher.update(memoryview(zeros)[: min(pad, len(zeros))])
        pad -= len(zeros)
    assert hasher.blocks is not None
    return hasher.digest(), blocks_of(hasher.blocks)


__all__ = ["Written", "blocks_of", "hash_padded", "write_safetensors", "write_small", "write_stream"]
