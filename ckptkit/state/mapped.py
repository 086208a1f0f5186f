"""Mapped loads (``ckptkit.load(path, mapped=True)``): tensors that are views of the payload files
themselves, mapped copy-on-write, every block checked through the mapping before they are returned.

Why: a load into new tensors has the kernel fault in and zero every page of them, and copy the page
cache into them; on a machine where new memory is slow that, not the disk, bounds the load. A mapped
tensor's pages are the page cache's own: nothing new is allocated, nothing is copied, and the bytes
are hashed where they lie (docs/PERFORMANCE.md measures both).

What it costs, said where it is offered:

- The pages are locked in memory (``mlock``, through a second, shared read-only mapping of the file:
  locking the private one would copy every page) before they are checked, so that the kernel
  cannot drop a checked page and read it again, unchecked, from the disk later. Locking needs
  ``CAP_IPC_LOCK`` or a ``RLIMIT_MEMLOCK`` as large as the files; where it is refused the load
  goes on unlocked and warns once (`UnlockedWarning`).
- A write to a mapped tensor copies that page first (private mapping): the file never changes. A
  process that rewrites a committed payload file in place (ckptkit never does) would change the
  tensors' pages it has not written; deleting the checkpoint does not (the mapping holds the file).
- Only a tensor held whole by one shard of a local file with block checksums, without patches, at
  an offset aligned to its item size, is mapped (`can_map`, decided before any file is mapped);
  every other one is read as a plain load reads it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import StorageError
from ..manifest.dtypes import itemsize
from ..plan.load import TargetPlan
from ..storage.local import open_regular
from ..io.read import Reader

CHUNK = 64 << 20  # the bytes one thread locks and checks at a time


class UnlockedWarning(RuntimeWarning):
    """A mapped load could not lock its pages in memory: a page the kernel drops and reads again
    from disk afterwards is not checked again."""


@dataclass(frozen=True, slots=True)
class Mapped:
    """A payload file mapped whole (copy-on-write), as one uint8 tensor over its bytes, and the
    address of its shared mapping, which is the one locked."""

    file: int
    data: torch.Tensor
    pinned: int


def can_map(reader: Reader, target: TargetPlan) -> bool:
    """Whether `target` (a whole tensor) is one shard's bytes in place in a file a mapped load
    maps: local, with block checksums, not raw-encoded, non-empty, the tensor without patches,
    its bytes at an offset aligned to its item size (the file's header read first)."""
    if not hasattr(mmap, "MAP_PRIVATE") or not reader.loc.storage.capabilities.local_files:
        return False
    if len(target.reads) != 1 or not target.box.volume:
        return False
    read = target.reads[0]
    entry = reader.manifest.files[read.file]
    tensor = reader.manifest.tensors[target.fqn]
    return (read.src_box == read.overlap == target.box and entry.blocks is not None and entry.encoding != "raw"
            and not tensor.patches and reader.begin(read, tensor.dtype) % itemsize(tensor.dtype) == 0)


def map_files(reader: Reader, files: Sequence[int], pool: Executor) -> dict[int, Mapped]:
    """Map each of `files` whole, then lock and check every block of each on `pool`; return the
    mappings by file (warning with `UnlockedWarning` where a page could not be locked).

    Raises:
        IntegrityError: a file is missing, of another size, or a block does not match its checksum.
        StorageError: a file cannot be opened or mapped.
    """
    mapped: dict[int, Mapped] = {}
    for file in files:
        reader.header_of(file)  # its size and header checked, as any read does first
        mapped[file] = _map(reader.loc.storage.local_path(reader.loc.file_key(reader.manifest.files[file])), file)
    lock = _mlock()
    tasks: list[tuple[Mapped, int, int]] = []
    for file, m in mapped.items():
        block = reader.manifest.files[file].blocks
        assert block is not None
        step = max(1, CHUNK // block.size) * block.size
        tasks += [(m, begin, min(len(m.data), begin + step)) for begin in range(0, len(m.data), step)]
    locked = all(list(pool.map(lambda task: _lock_and_check(reader, task[0], task[1], task[2], lock), tasks)))
    if not locked:
        warnings.warn("mapped load: the pages could not be locked in memory (needs CAP_IPC_LOCK or a RLIMIT_MEMLOCK as "
                      "large as the files); a page the kernel drops is read again from disk without a check",
                      UnlockedWarning, stacklevel=4)
    return mapped


def tensor_of(reader: Reader, mapped: dict[int, Mapped], target: TargetPlan, dtype: torch.dtype) -> torch.Tensor:
    """The tensor `target` (one `can_map` accepts) as a view of its file's mapping."""
    read = target.reads[0]
    saved = reader.manifest.tensors[target.fqn].dtype
    begin = reader.begin(read, saved)
    raw = mapped[read.file].data[begin : begin + target.box.volume * itemsize(saved)]
    return raw.view(dtype).view(target.box.lengths)


class _Private(mmap.mmap):
    """The copy-on-write mapping the tensors view, holding the read-only shared mapping of the
    same file whose lock keeps its page-cache pages in memory (`pin`) for as long as it lives."""

    pin: mmap.mmap


def _map(path: str, file: int) -> Mapped:
    """Map the file twice: shared and read-only, to be locked (locking the private mapping
    itself would copy every page, as a write does), and private for the tensors (the same
    page-cache pages until one is written)."""
    fd, size = open_regular(path)
    try:
        private = _Private(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        private.pin = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        raise StorageError(f"{path}: cannot be mapped ({exc})") from exc
    finally:
        os.close(fd)
    pinned = int(np.frombuffer(private.pin, np.uint8).ctypes.data)  # its address (the array is let go)
    return Mapped(file, torch.frombuffer(private, dtype=torch.uint8), pinned)  # the tensor keeps both mappings


def _lock_and_check(reader: Reader, m: Mapped, begin: int, end: int, lock: Callable[[int, int], int] | None) -> bool:
    """Lock bytes [begin, end) of a mapped file in memory, then check the blocks they hold;
    return whether they were locked."""
    locked = lock is not None and lock(m.pinned + begin, end - begin) == 0
    reader.check_blocks(m.file, m.data[begin:end].numpy().data, begin)
    return locked


def _mlock() -> Callable[[int, int], int] | None:
    """libc's ``mlock`` on Linux and macOS, or None."""
    if not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).mlock
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    call.restype = ctypes.c_int
    return call


__all__ = ["Mapped", "UnlockedWarning", "can_map", "map_files", "tensor_of"]
