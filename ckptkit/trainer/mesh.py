"""Ranks of a TP x DP x PP job: the documented rank order and the process groups.

Rank order, fastest-varying first: tp, then dp, then pp (``rank = tp_rank + tp * (dp_rank +
dp * pp_rank)``), the ``tp-cp-dp-pp`` order of the manifest's topology with cp = 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Mesh:
    tp: int
    dp: int
    pp: int
    rank: int

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


@dataclass(frozen=True)
class Groups:
    """The process groups this rank belongs to (None where the dimension has size 1)."""

    tp: Any
    dp: Any
    world: Any


def build_groups(mesh: Mesh) -> Groups:
    """Create every TP and DP group; all ranks must call this in the same order."""
    tp_group = dp_group = None
    for dp_rank in range(mesh.dp):
        for pp_rank in range(mesh.pp):
            ranks = [mesh.rank_of(t, dp_rank, pp_rank) for t in range(mesh.tp)]
            group = dist.new_group(ranks) if mesh.tp > 1 else None
            if mesh.rank in ranks:
                tp_group = group
    for tp_rank in range(mesh.tp):
        for pp_rank in range(mesh.pp):
            ranks = [mesh.rank_of(tp_rank, d, pp_rank) for d in range(mesh.dp)]
            group = dist.new_group(ranks) if mesh.dp > 1 else None
            if mesh.rank in ranks:
                dp_group = group
    return Groups(tp=tp_group, dp=dp_group, world=dist.group.WORLD if dist.is_initialized() else None)
