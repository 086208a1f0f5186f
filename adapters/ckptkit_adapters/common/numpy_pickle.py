"""NumPy arrays and ``bytes`` as pickles of numpy's generator states hold them, read through an
allowlist without numpy rebuilding anything (`NUMPY_ALLOWED`): Megatron-LM's ``np_rng_state``, a
Hugging Face ``Trainer``'s ``rng_state.pth``."""

from __future__ import annotations

import struct
from typing import Any
from ckptkit_adapters.common.safepickle import Record
from ckptkit_adapters.common.torchsave import encode_latin1


class NumpyDtype(Record):
    """``numpy.dtype('u4', False, True)`` and its state (the byte order is its second field)."""

    qualname = "numpy.dtype"


class NumpyArray(Record):
    """A NumPy array as ``numpy._core.multiarray._reconstruct`` and its state rebuild it (the
    NumPy generator's key in Megatron's ``np_rng_state``): read as a list of numbers."""

    qualname = "numpy.ndarray"

    def values(self) -> list[int] | None:
        """The elements of a 1-D little-endian uint32 array, else None."""
        state = self.state
        if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[2], NumpyDtype)
                and isinstance(state[4], bytes) and isinstance(state[1], tuple) and len(state[1]) == 1):
            return None
        kind, order = state[2].args[:1], state[2].state
        if kind != ("u4",) or not isinstance(order, tuple) or order[1:2] not in (("<",), ("|",), ("=",)):
            return None
        count = state[1][0]
        if not isinstance(count, int) or len(state[4]) != 4 * count:
            return None
        return list(struct.unpack(f"<{count}I", state[4]))


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> NumpyArray:
    if cls is not NumpyArray:
        raise ValueError("_reconstruct of something other than numpy.ndarray")
    return NumpyArray()


NUMPY_ALLOWED: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): encode_latin1,
    ("numpy", "dtype"): NumpyDtype,
    ("numpy", "ndarray"): NumpyArray,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
}
