"""What a manifest describes rather than lists (schema 1.6): files in a packed table, and tensors
whose boxes follow from the layout and topology by a rule (pure).

In memory a manifest's ``files`` and ``tensors`` hold everything, listed or not: `FileList`
builds a table's entries as they are asked for, `TensorTable` a derived tensor's entry, and a
derived tensor's shards (`DerivedShards`) are found by its rule, for the box asked about only.
The rules live with the layouts (``ckptkit.layouts`` registers them): this layer knows them
only through `Derivation`.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, overload

from ..boxes import Box

if TYPE_CHECKING:
    import numpy as np

    from .model import FileEntry, FileTable, Manifest, Shard, TensorEntry

# The paths a file table describes: file i is ``rank<i, 5 digits or more>.safetensors``, as a save names a rank's file.
TABLE_PREFIX, TABLE_WIDTH, TABLE_SUFFIX = "rank", 5, ".safetensors"
# A manifest lists its files until this many of them form a table.
TABLE_MIN = 64
_CHECKSUM = "xxh3-128-blocks:"


def table_path(index: int) -> str:
    """The path of file `index` of a file table (the name a save gives rank `index`'s file)."""
    return f"{TABLE_PREFIX}{index:0{TABLE_WIDTH}d}{TABLE_SUFFIX}"


class Derivation(Protocol):
    """A rule's view of one manifest: the tensors it derives and where their boxes lie."""

    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every derived tensor (fqn) with its global shape, in order."""

    def find(self, fqn: str) -> tuple[str, str, tuple[int, ...]] | None:
        """(dtype, kind, shape) of a derived tensor, or None when the rule derives no such tensor."""

    def overlapping(self, fqn: str, box: Box) -> list[Shard]:
        """The shards of `fqn` that share an element with `box` (every shard for the whole box)."""

    def boxes_key(self, fqn: str) -> Hashable:
        """A key equal for derived tensors cut into the same boxes (their files and keys may
        differ): what a summary of each tensor's cut computes once per key."""

    def files(self) -> int:
        """How many files, from the first, hold derived shards (file i is rank i's)."""

    def file_keys(self, file: int) -> list[tuple[str, Box, str, str]]:
        """(fqn, box, key, dtype) of every derived shard file `file` holds, in its order."""


RULES: dict[str, Callable[[Manifest], Derivation]] = {}


def register_rule(name: str, factory: Callable[[Manifest], Derivation]) -> None:
    """Make the rule `name` of ``Manifest.derived`` known: `factory` builds its view of a manifest."""
    RULES[name] = factory


@dataclass(frozen=True, eq=False)
class DerivedShards:
    """The shards of a derived tensor (in memory only: never written, the manifest's ``derived``
    says where they are)."""

    fqn: str
    source: Derivation
    layout: str = "derived"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DerivedShards) and other.fqn == self.fqn

    def __hash__(self) -> int:
        return hash(self.fqn)


class TensorTable(Mapping[str, "TensorEntry"]):
    """A manifest's tensors: those it lists, then those its rule derives (entries made on demand)."""

    def __init__(self, listed: dict[str, TensorEntry], source: Derivation) -> None:
        self.listed = listed
        self.source = source
        self._made: dict[str, TensorEntry] = {}

    def __getitem__(self, fqn: str) -> TensorEntry:
        found = self.listed.get(fqn)
        if found is not None:
            return found
        found = self._made.get(fqn)
        if found is None:
            described = self.source.find(fqn)
            if described is None:
                raise KeyError(fqn)
            from .model import TensorEntry

            dtype, kind, shape = described
            found = self._made[fqn] = TensorEntry.model_construct(
                shape=shape, dtype=dtype, kind=kind, shards=DerivedShards(fqn, self.source), patches=())
        return found

    def __contains__(self, fqn: object) -> bool:
        return isinstance(fqn, str) and (fqn in self.listed or self.source.find(fqn) is not None)

    def __iter__(self) -> Iterator[str]:
        yield from self.listed
        yield from (fqn for fqn in self.source.shapes() if fqn not in self.listed)

    def __len__(self) -> int:
        return len(self.listed) + sum(1 for fqn in self.source.shapes() if fqn not in self.listed)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return len(self) == len(other) and all(k in other and other[k] == v for k, v in self.items())

    __hash__ = None  # type: ignore[assignment]


def listed_tensors(tensors: Mapping[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The tensors a manifest document lists (those no rule derives)."""
    if isinstance(tensors, TensorTable):
        return tensors.listed
    return {fqn: t for fqn, t in tensors.items() if not isinstance(t.shards, DerivedShards)}


def derivation_of(tensors: Mapping[str, TensorEntry]) -> Derivation | None:
    return tensors.source if isinstance(tensors, TensorTable) else None


# -- file tables ------------------------------------------------------------------------------


class FileList(Sequence["FileEntry"]):
    """A manifest's files: those of its table (entries made on demand), then those it lists."""

    def __init__(self, table: FileTable, listed: tuple[FileEntry, ...]) -> None:
        import numpy as np  # here: the package imports without numpy (the adapters' registry reads it at start)

        self.table = table
        self.listed = listed
        self.sizes = _array(table.sizes, "<u8", table.count).astype(np.int64)
        self.checksums = _array(table.checksums, "V16", table.count)
        self.block_sizes = _array(table.block_sizes, "<u4", table.count).astype(np.int64)
        self._made: dict[int, FileEntry] = {}

    def __len__(self) -> int:
        return self.table.count + len(self.listed)

    @overload
    def __getitem__(self, index: int) -> FileEntry: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[FileEntry, ...]: ...

    def __getitem__(self, index: int | slice) -> FileEntry | tuple[FileEntry, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        n = self.table.count
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        if index >= n:
            return self.listed[index - n]
        found = self._made.get(index)
        if found is None:
            from .model import BlockChecksums, FileEntry

            found = self._made[index] = FileEntry.model_construct(
                path=table_path(index), size=int(self.sizes[index]), checksum=_CHECKSUM + self.checksums[index].tobytes().hex(),
                role="tensors", encoding="safetensors", blocks=BlockChecksums.model_construct(size=int(self.block_sizes[index]), digests=None),
                base=None, contents=None)
        return found

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


def _array(text: str, dtype: str, count: int) -> np.ndarray:
    import numpy as np

    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raw = b""
    item = np.dtype(dtype).itemsize
    if len(raw) != item * count:
        raise ValueError(f"holds {len(raw)} bytes, not {count} of {item}")
    return np.frombuffer(raw, dtype=dtype)


def table_files(files: Sequence[FileEntry]) -> int:
    """How many of `files`, from the first, a table can describe (0 when fewer than TABLE_MIN)."""
    if isinstance(files, FileList):
        return files.table.count
    n = 0
    for i, f in enumerate(files):
        if (f.path != table_path(i) or f.role != "tensors" or f.encoding != "safetensors" or f.base is not None
                or f.contents is not None or f.blocks is None or f.blocks.digests is not None
                or not f.checksum.startswith(_CHECKSUM) or len(f.checksum) != len(_CHECKSUM) + 32):
            break
        n = i + 1
    return n if n >= TABLE_MIN else 0


def pack_table(files: Sequence[FileEntry], count: int) -> dict[str, Any]:
    """The ``file_table`` document of the first `count` files (as `table_files` found them)."""
    if isinstance(files, FileList) and count == files.table.count:
        return files.table.model_dump()  # the table read, written back as it was
    import numpy as np

    head = [files[i] for i in range(count)]
    sizes = np.fromiter((f.size for f in head), dtype="<u8", count=count)
    blocks = np.fromiter((f.blocks.size if f.blocks is not None else 0 for f in head), dtype="<u4", count=count)
    digests = b"".join(bytes.fromhex(f.checksum[len(_CHECKSUM):]) for f in head)
    return {"count": count, "sizes": _b64(sizes.tobytes()), "checksums": _b64(digests), "block_sizes": _b64(blocks.tobytes())}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def listed_files(files: Sequence[FileEntry], count: int) -> tuple[FileEntry, ...]:
    """The files after a table's first `count`."""
    if isinstance(files, FileList) and count == files.table.count:
        return files.listed
    return tuple(files[i] for i in range(count, len(files)))
