"""ShardedTensor: a rank's piece of a global tensor, as a box (no torch import)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..boxes import Box, flat_range_to_boxes
from ..errors import LayoutError


@dataclass(frozen=True, eq=False)
class ShardedTensor:
    """A local tensor that holds the box ``[global_offsets, global_offsets + local.shape)`` of a global tensor.

    Saved, it contributes that box; as a load target, it is filled in place with that box of
    the checkpoint's tensor, whatever sharding the checkpoint was written with. Several ranks
    may pass the same box (replicas): it is written once.
    """

    local: Any
    global_shape: tuple[int, ...]
    global_offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.local.shape)
        object.__setattr__(self, "global_shape", tuple(int(d) for d in self.global_shape))
        object.__setattr__(self, "global_offsets", tuple(int(d) for d in self.global_offsets))
        if not len(shape) == len(self.global_shape) == len(self.global_offsets):
            raise LayoutError(
                f"ShardedTensor: local shape {list(shape)}, global shape {list(self.global_shape)} and "
                f"offsets {list(self.global_offsets)} must have the same number of dims"
            )
        for o, n, g in zip(self.global_offsets, shape, self.global_shape):
            if o < 0 or o + n > g:
                raise LayoutError(
                    f"ShardedTensor: local shape {list(shape)} at offsets {list(self.global_offsets)} "
                    f"does not fit in global shape {list(self.global_shape)}"
                )

    @property
    def box(self) -> Box:
        return Box(self.global_offsets, tuple(int(d) for d in self.local.shape))

    @classmethod
    def from_flat(
        cls,
        local: Any,
        global_shape: Sequence[int],
        flat_offset: int,
        *,
        origin: Sequence[int] | None = None,
        extent: Sequence[int] | None = None,
    ) -> list[ShardedTensor]:
        """Describe a 1-D tensor that holds a flat row-major range of a tensor (ZeRO / FSDP).

        The range ``[flat_offset, flat_offset + local.numel())`` counts elements of the box
        at `origin` with shape `extent` (default: the whole global tensor; under TP, the
        rank's TP shard). Returns ShardedTensors (views of `local`, at most 2·ndim−1) for
        the boxes the range covers; save them, or load into them, as one list-valued leaf.
        """
        shape = tuple(int(d) for d in global_shape)
        base = tuple(int(d) for d in origin) if origin is not None else (0,) * len(shape)
        sub = tuple(int(d) for d in extent) if extent is not None else shape
        n = int(local.numel())
        if local.dim() != 1:
            raise LayoutError(f"from_flat: local tensor must be 1-D, got shape {list(local.shape)}")
        if not Box(base, sub).ndim == len(shape) or any(o + e > g for o, e, g in zip(base, sub, shape)):
            raise LayoutError(f"from_flat: box at {list(base)} of size {list(sub)} is outside shape {list(shape)}")
        if flat_offset < 0 or flat_offset + n > math.prod(sub):
            raise LayoutError(f"from_flat: range [{flat_offset}, {flat_offset + n}) is outside a box of size {list(sub)}")
        pieces = []
        pos = 0
        for box in flat_range_to_boxes(sub, flat_offset, flat_offset + n):
            view = local[pos : pos + box.volume].view(box.lengths)
            offsets = tuple(o + b for o, b in zip(box.offsets, base))
            pieces.append(cls(view, shape, offsets))
            pos += box.volume
        return pieces
