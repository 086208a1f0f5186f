"""Tensor-parallel building blocks: communication functions, parallel linears and embedding, parallel cross entropy.

Every parameter records its logical parts (``ckptkit.layouts.Part``): which rows of the local tensor hold which
box of which logical (unfused, unpadded) global tensor. Checkpoints are written from the parts,
so a TP change is a box intersection and export is a rename.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..layouts import column_parts, row_parts, vocab_parts, vocab_rows


@dataclass(frozen=True)
class TPContext:
    """This rank's place in its tensor-parallel group."""

    size: int
    rank: int
    group: Any = None


def _all_reduce(x: torch.Tensor, ctx: TPContext, op: Any = None) -> torch.Tensor:
    if ctx.size > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM, group=ctx.group)
    return x


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (the input feeds every TP rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _all_reduce(grad.contiguous().clone(), ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum of partial results); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPContext) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x.contiguous().clone(), tp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _CopyToTP.apply(x, tp) if tp.size > 1 else x


def reduce_from_tp(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp) if tp.size > 1 else x


def init_global(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    """Return the initial value of a logical tensor: the same whatever the topology."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sum((i + 1) * b for i, b in enumerate(name.encode())))
    if std == 0.0:
        return torch.ones(shape)
    return torch.randn(shape, generator=gen) * std


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (outputs) split over TP; several logical weights fused row-wise.

    Args:
        names: logical names of the fused parts (e.g. q, k, v), each [out_i, in_features].
        outs: the logical output sizes of the parts; each is split evenly over TP.
    """

    def __init__(self, in_features: int, names: list[str], outs: list[int], tp: TPContext, *, std: float, seed: int):
        super().__init__()
        self.tp = tp
        self.parts = column_parts(names, outs, in_features, tp.size, tp.rank)
        blocks = []
        for part in self.parts:
            full = init_global(part.name, part.global_shape, std, seed)
            blocks.append(full[part.offsets[0] : part.offsets[0] + part.lengths[0]])
        self.weight = nn.Parameter(torch.cat(blocks))
        self.splits = [p.row1 - p.row0 for p in self.parts]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = F.linear(copy_to_tp(x, self.tp), self.weight)
        return list(torch.split(y, self.splits, dim=-1))


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (inputs) split over TP; partial outputs summed across TP."""

    def __init__(self, in_features: int, out_features: int, name: str, tp: TPContext, *, std: float, seed: int):
        super().__init__()
        self.tp = tp
        self.parts = row_parts(name, in_features, out_features, tp.size, tp.rank)
        first, local = self.parts[0].offsets[1], self.parts[0].lengths[1]
        full = init_global(name, (out_features, in_features), std, seed)
        self.weight = nn.Parameter(full[:, first : first + local].contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.tp)


class VocabParallel(nn.Module):
    """A [vocab, hidden] weight whose vocab rows are split over TP: embedding lookup or output head."""

    def __init__(self, vocab: int, hidden: int, name: str, tp: TPContext, *, std: float, seed: int):
        super().__init__()
        self.tp = tp
        self.vocab = vocab
        per_rank, self.start, real = vocab_rows(vocab, tp.size, tp.rank)
        self.end = self.start + per_rank
        full = init_global(name, (vocab, hidden), std, seed)
        local = torch.zeros(per_rank, hidden)
        local[:real] = full[self.start : self.start + real]
        self.weight = nn.Parameter(local)
        self.parts = vocab_parts(name, vocab, hidden, tp.size, tp.rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids give embeddings; hidden states give vocab-split logits (as the output head)."""
        return self.logits(x) if x.is_floating_point() else self.embed(x)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(copy_to_tp(x, self.tp), self.weight)
        pad = self.end - max(self.start, min(self.end, self.vocab))
        if pad:
            out = out.clone()
            out[..., out.shape[-1] - pad :] = float("-inf")
        return out


class _ParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over vocab-split logits without gathering them (sums and maxes across TP)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int, tp: TPContext) -> torch.Tensor:  # type: ignore[override]
        logits = logits.float()
        peak = logits.max(dim=-1).values
        _all_reduce(peak, tp, dist.ReduceOp.MAX)
        shifted = logits - peak.unsqueeze(-1)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), tp)
        local_t = target - start
        inside = (local_t >= 0) & (local_t < logits.shape[-1])
        local_t = local_t.masked_fill(~inside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        _all_reduce(picked, tp)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local_t, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0], device=g.device)
        g[rows, local_t] -= inside.to(g.dtype)
        return g * grad.unsqueeze(-1), None, None, None


def parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, head: VocabParallel) -> torch.Tensor:
    """Per-token loss of flattened [N, vocab_local] logits against global target ids [N]."""
    return _ParallelCrossEntropy.apply(logits, target, head.start, head.tp)
