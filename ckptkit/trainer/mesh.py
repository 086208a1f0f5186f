"""Ranks of a TP x CP x DP x PP job: the documented rank order and the process groups.

Rank order, fastest-varying first: tp, then cp, then dp, then pp (``rank = tp_rank + tp *
(cp_rank + cp * (dp_rank + dp * pp_rank))``), the ``tp-cp-dp-pp`` order of the manifest's
topology. Expert parallelism is carved out of the data-parallel ranks, as Megatron does: DP
rank d is EP rank ``d % ep`` of its EP group (the ``ep`` consecutive DP ranks ``d // ep`` names)
and expert-data-parallel rank ``d // ep`` of the DP ranks that hold the same experts.
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
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.cp * self.dp)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: DP ranks holding the same experts."""
        return self.dp // self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int | None = None) -> int:
        cp_rank = self.cp_rank if cp_rank is None else cp_rank
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

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
    cp: Any = None
    ep: Any = None  # the EP ranks exchanging tokens
    edp: Any = None  # the DP ranks holding the same experts


def build_groups(mesh: Mesh) -> Groups:
    """Create every TP, CP, DP, EP and expert-DP group; all ranks must call this in the same order."""
    m = mesh
    coords = [(t, c, d, p) for p in range(m.pp) for d in range(m.dp) for c in range(m.cp) for t in range(m.tp)]

    def group(size: int, key: Any) -> Any:
        """Create the groups of ranks sharing `key(t, c, d, p)`; return the one holding this rank."""
        mine = None
        classes: dict[Any, list[int]] = {}
        for t, c, d, p in coords:
            classes.setdefault(key(t, c, d, p), []).append(m.rank_of(t, d, p, c))
        for ranks in classes.values():
            made = dist.new_group(sorted(ranks)) if size > 1 else None
            if m.rank in ranks:
                mine = made
        return mine

    return Groups(
        tp=group(m.tp, lambda t, c, d, p: (c, d, p)),
        dp=group(m.dp, lambda t, c, d, p: (t, c, p)),
        world=dist.group.WORLD if dist.is_initialized() else None,
        cp=group(m.cp, lambda t, c, d, p: (t, d, p)),
        ep=group(m.ep, lambda t, c, d, p: (t, c, p, d // m.ep)),
        edp=group(m.edp, lambda t, c, d, p: (t, c, p, d % m.ep)),
    )
