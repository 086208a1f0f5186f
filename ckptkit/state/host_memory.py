"""Host tensors that a read fills at once: asked for in transparent huge pages.

A load into new tensors spends most of its time, when the checkpoint is in the page cache, in
the kernel faulting in the tensors' memory 4 KiB at a time (filling a new 1 GiB tensor: 0.51 s
here, against 0.05 s for memory already touched). Advised with ``MADV_HUGEPAGE`` before it is
touched, the same memory faults in 2 MiB pages: 0.10 s. The advice is only that: where the
kernel has no transparent huge pages, or on another system, nothing changes but the speed.

Only tensors of at least 32 MiB are advised: glibc gives an allocation that large a mapping of
its own (its mmap threshold never rises above 32 MiB), so the advice ends with the tensor, and
the two extra mappings each one costs stay far below the kernel's ``vm.max_map_count``. When
glibc serves one from a free chunk of its heap instead, the advice stays on that part of the
heap: later allocations there fault in huge pages too, which changes their speed, not their bytes.
``CKPTKIT_HUGE_PAGES=0`` turns the advice off (on a host whose memory is so fragmented that the
kernel's compaction for huge pages would cost more than it saves).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from collections.abc import Callable, Sequence

import torch

HUGE_PAGE = 2 << 20
MIN_ADVISED = 16 * HUGE_PAGE  # 32 MiB: glibc's largest mmap threshold, so the tensor has a mapping of its own
_MADV_HUGEPAGE = 14  # Linux's value on every architecture


def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Return an uninitialised CPU tensor, its memory advised into huge pages.

    Args:
        shape: the tensor's shape.
        dtype: its dtype.

    Returns:
        A new contiguous tensor; when it spans at least `MIN_ADVISED` bytes (and
        ``CKPTKIT_HUGE_PAGES`` is not ``0``), the whole huge pages inside it are advised.
    """
    tensor = torch.empty(tuple(shape), dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    wanted = nbytes >= MIN_ADVISED and os.environ.get("CKPTKIT_HUGE_PAGES", "1") != "0"
    madvise = _madvise() if wanted else None
    if madvise is not None:
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (tensor.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            madvise(start, end - start, _MADV_HUGEPAGE)  # an error (no huge pages here) changes nothing
    return tensor


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` on Linux, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call
