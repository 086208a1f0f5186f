"""ShardedTensor: a rank's piece of a global tensor, as a box (no torch import)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .boxes import Box, flat_range_to_boxes
from .errors import LayoutError


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
    def from_flat(cls, local: Any, global_shape: Sequence[int], flat_offset: int) -> list[ShardedTensor]:
        """Describe a 1-D tensor holding a flat row-major range of a global tensor (ZeRO / FSDP).

        Returns the ShardedTensors (views of `local`, at most 2·ndim−1) for the boxes the
        range covers; save them, or load into them, as one list-valued leaf.
        """
        shape = tuple(int(d) for d in global_shape)
        n = int(local.numel())
        if local.dim() != 1:
            raise LayoutError(f"from_flat: local tensor must be 1-D, got shape {list(local.shape)}")
        if flat_offset < 0 or flat_offset + n > math.prod(shape):
            raise LayoutError(f"from_flat: range [{flat_offset}, {flat_offset + n}) is outside shape {list(shape)}")
        pieces = []
        pos = 0
        for box in flat_range_to_boxes(shape, flat_offset, flat_offset + n):
            view = local[pos : pos + box.volume].view(box.lengths)
            pieces.append(cls(view, shape, box.offsets))
            pos += box.volume
        return pieces
