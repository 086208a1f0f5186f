"""Data parallelism with ZeRO 0-3 over flat buffers, and AdamW.

Each unit of a stage (the embedding, each layer, the final norm and head) keeps its parameters
in one flat fp32 buffer, cut into `dp` equal contiguous ranges the way DeepSpeed and Megatron's
distributed optimizer partition theirs, so range boundaries fall at uneven places inside tensors.
Rank r of the data-parallel group owns range r:

- ZeRO 0: every rank keeps and updates everything (gradients all-reduced).
- ZeRO 1: gradients all-reduced; each rank updates its range (Adam moments only there); ranges all-gathered.
- ZeRO 2: as 1, but each rank keeps only its range of the reduced gradient (here the reduction
  is an all-reduce followed by a slice, which gloo supports everywhere; the arithmetic is that of
  a reduce-scatter).
- ZeRO 3: as 2, and parameters live only as ranges: each unit gathers its full parameters for its
  forward and again (recomputing) for its backward, whose gradient is reduce-scattered back.

Mixed precision (``compute`` bf16 or fp16): the flat fp32 buffer holds the master weights,
which the optimizer updates; the modules compute with a copy in the compute dtype, refreshed
from the masters after each update, and their gradients are accumulated in fp32 (a hook moves
each micro-batch's gradient into an fp32 buffer). Under ZeRO 3 the gathered fp32 parameters
are cast for the forward. The checkpoint holds the fp32 masters.

A unit of experts is partitioned over its expert-data-parallel group instead (the DP ranks
holding the same experts). Context-parallel ranks hold replicas: their gradients (partial
sums over their slices of the sequences) are summed over the CP group too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from ..layouts import ParamSpec, Part, partition, unit_offsets


@dataclass(frozen=True)
class DPContext:
    size: int
    rank: int
    group: Any = None


@dataclass(frozen=True)
class Slot:
    """A parameter's place in its unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    parts: tuple[Part, ...]
    decay: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _all_reduce(x: torch.Tensor, dp: DPContext) -> torch.Tensor:
    if dp.size > 1:
        dist.all_reduce(x, group=dp.group)
    return x


def _all_gather(chunk: torch.Tensor, dp: DPContext) -> torch.Tensor:
    if dp.size == 1:
        return chunk.clone()
    pieces = [torch.empty_like(chunk) for _ in range(dp.size)]
    dist.all_gather(pieces, chunk.contiguous(), group=dp.group)
    return torch.cat(pieces)


class _GatherUnit(torch.autograd.Function):
    """ZeRO-3: all-gather a unit's padded flat parameter ranges; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, dp: DPContext) -> torch.Tensor:  # type: ignore[override]
        ctx.dp = dp
        return _all_gather(shard.detach(), dp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        dp: DPContext = ctx.dp
        full = _all_reduce(grad.contiguous().clone(), dp)
        n = full.numel() // dp.size
        return full[dp.rank * n : (dp.rank + 1) * n].clone(), None


class Unit:
    """One module's parameters as a flat buffer partitioned over DP, with its optimizer state."""

    def __init__(self, module: nn.Module, params: list[tuple[str, nn.Parameter, list[Part]]], dp: DPContext, zero: int,
                 replicas: DPContext = DPContext(1, 0), *, compute: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.module = module
        self.dp = dp
        self.replicas = replicas  # the context-parallel group, whose gradients are summed too
        self.zero = zero
        self.compute = compute
        self.device = torch.device(device)
        self.specs = [ParamSpec(name, tuple(p.shape), tuple(parts)) for name, p, parts in params]
        offsets, offset = unit_offsets(self.specs)
        self.slots = [
            Slot(spec.name, spec.shape, o, spec.parts, len(spec.shape) >= 2) for spec, o in zip(self.specs, offsets)
        ]
        self.numel = offset
        self.chunk, self.lo, self.hi = partition(offset, dp.size, dp.rank)
        dev = self.device
        flat = torch.zeros(self.chunk * dp.size, device=dev)
        for slot, (_, p, _) in zip(self.slots, params):
            flat[slot.offset : slot.offset + slot.numel] = p.detach().reshape(-1)
        owned = (0, offset) if zero == 0 else (self.lo, self.hi)
        self.state_lo, self.state_hi = owned
        n = owned[1] - owned[0]
        self.exp_avg = torch.zeros(n, device=dev)
        self.exp_avg_sq = torch.zeros(n, device=dev)
        self.decay_mask = torch.zeros(offset, device=dev)
        for slot in self.slots:
            if slot.decay:
                self.decay_mask[slot.offset : slot.offset + slot.numel] = 1.0
        self.main_grad: torch.Tensor | None = None  # mixed precision: the fp32 sum of the micro-batches' gradients
        self.copy: torch.Tensor | None = None  # mixed precision: the parameters in the compute dtype
        if zero == 3:
            self.shard = nn.Parameter(flat[dp.rank * self.chunk : (dp.rank + 1) * self.chunk].clone())
            for _, p, _ in params:
                p.data = torch.empty(0, device=dev)  # the unit's parameters now live only as ranges
            self.flat = None
        else:
            self.flat = flat[:offset]
            held = self.flat
            if compute != torch.float32:
                self.copy = held = self.flat.to(compute)
                self.main_grad = torch.zeros(offset, device=dev)
            for slot, (_, p, _) in zip(self.slots, params):
                p.data = held[slot.offset : slot.offset + slot.numel].view(slot.shape)
                if self.main_grad is not None:
                    p.register_post_accumulate_grad_hook(self._accumulate(self.main_grad[slot.offset : slot.offset + slot.numel]))
        self.params = [p for _, p, _ in params]
        self.names = [n for n, _, _ in params]

    @staticmethod
    def _accumulate(into: torch.Tensor) -> Any:
        def hook(p: torch.Tensor) -> None:
            assert p.grad is not None
            into.add_(p.grad.reshape(-1))  # in fp32
            p.grad = None

        return hook

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots}

    def call(self, *args: Any) -> Any:
        """Run the unit's forward; under ZeRO 3 gather, and regather when recomputing for backward."""
        if self.zero != 3:
            return self.module(*args)

        def run(shard: torch.Tensor, *inputs: Any) -> Any:
            full = _GatherUnit.apply(shard, self.dp)
            return functional_call(self.module, self.views(full.to(self.compute)), inputs)

        return checkpoint(run, self.shard, *args, use_reentrant=False)

    def reduced_grad(self) -> torch.Tensor:
        """Return the data-parallel sum of this unit's gradient over the range this rank updates."""
        if self.zero == 3:
            assert self.shard.grad is not None
            return _all_reduce(self.shard.grad[: self.hi - self.lo], self.replicas)
        if self.main_grad is not None:
            grad = self.main_grad.clone()
        else:
            grad = torch.zeros(self.numel, device=self.device)
            for slot, p in zip(self.slots, self.params):
                if p.grad is not None:
                    grad[slot.offset : slot.offset + slot.numel] = p.grad.reshape(-1)
        _all_reduce(grad, self.dp)
        return _all_reduce(grad[self.state_lo : self.state_hi], self.replicas)

    def zero_grad(self) -> None:
        if self.zero == 3:
            self.shard.grad = None
        if self.main_grad is not None:
            self.main_grad.zero_()
        for p in self.params:
            p.grad = None

    def master_range(self) -> torch.Tensor:
        """Return the parameter values this rank updates (a view it may change in place)."""
        if self.zero == 3:
            return self.shard.data[: self.hi - self.lo]
        assert self.flat is not None
        return self.flat[self.state_lo : self.state_hi]

    def publish(self) -> None:
        """After an update of the owned range (or a load), give every rank the full parameters
        (ZeRO 1 and 2) and refresh the compute copy (mixed precision)."""
        if self.zero in (1, 2):
            assert self.flat is not None
            chunk = torch.zeros(self.chunk, device=self.device)
            chunk[: self.hi - self.lo] = self.flat[self.lo : self.hi]
            self.flat.copy_(_all_gather(chunk, self.dp)[: self.numel])
        if self.copy is not None:
            assert self.flat is not None
            self.copy.copy_(self.flat)  # the compute copy of the updated masters


@dataclass
class AdamW:
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    step: int = 0

    def update(self, unit: Unit, grad: torch.Tensor, lr: float, clip: float) -> None:
        """One AdamW step (decoupled weight decay, bias correction) on the unit's owned range."""
        b1, b2 = self.betas
        p = unit.master_range()
        g = grad * clip
        unit.exp_avg.mul_(b1).add_(g, alpha=1 - b1)
        unit.exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
        c1 = 1 - b1**self.step
        c2 = 1 - b2**self.step
        mask = unit.decay_mask[unit.state_lo : unit.state_hi]
        p.mul_(1 - lr * self.weight_decay * mask)
        denom = (unit.exp_avg_sq / c2).sqrt_().add_(self.eps)
        p.addcdiv_(unit.exp_avg, denom, value=-lr / c1)
