"""The mixture-of-experts MLP (Mixtral's structure) and expert parallelism.

A layer's router (replicated over TP, a parameter of the layer) scores every token against
every expert; each token goes to its ``top_k`` experts, weighted by their softmax scores
renormalised over the chosen ones; nothing is dropped. The experts (SwiGLU, cut over TP as the
dense MLP is) are a separate module, ``LocalExperts``, whose parameters are a ZeRO unit of
their own: under EP a rank holds the experts of its EP run only, and tokens travel to the rank
holding their expert and back by all-to-all within the EP group.

The auxiliary load-balancing loss is computed per sample (``E * sum_e f_e * P_e`` over the
sample's tokens, with ``f_e`` the share of its routing choices that went to expert e and
``P_e`` its mean router probability) and averaged over the global batch, so that its value and
gradient do not depend on how the batch is split over DP ranks, micro-batches or CP ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from ..layouts import replicated_parts
from .tp import ColumnParallelLinear, RowParallelLinear, TPContext, copy_to_tp, init_global, reduce_from_tp

STD = 0.02


@dataclass(frozen=True)
class Axis:
    """This rank's place along one parallel dimension (context or expert parallelism)."""

    size: int = 1
    rank: int = 0
    group: Any = None


class _AllToAll(torch.autograd.Function):
    """Rows of `x` in runs of `send[r]` go to rank r of the group, `recv[r]` rows come from it;
    backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.args = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        send, recv, group = ctx.args
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send, recv, group=group)
        return out, None, None, None


class _WithAux(torch.autograd.Function):
    """Identity on the layer's output; backward also gives the auxiliary loss its gradient (1,
    times the loss scale under fp16), so that the loss of every layer on every pipeline stage
    trains the router."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.aux_shape, ctx.scale = aux.shape, scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


class Router(nn.Module):
    """The router's weight [experts, hidden], replicated over TP."""

    def __init__(self, cfg: ModelConfig, name: str, seed: int):
        super().__init__()
        shape = (cfg.num_experts, cfg.hidden_size)
        self.weight = nn.Parameter(init_global(name, shape, STD, seed))
        self.parts = replicated_parts(name, shape)


class Expert(nn.Module):
    """One SwiGLU expert, cut over TP as the dense MLP: fused gate/up by rows, down by columns."""

    def __init__(self, cfg: ModelConfig, layer: int, expert: int, tp: TPContext, seed: int):
        super().__init__()
        p = f"layers.{layer}.mlp.experts.{expert}."
        f = cfg.intermediate_size
        self.gate_up = ColumnParallelLinear(cfg.hidden_size, [p + "gate.weight", p + "up.weight"], [f, f], tp, std=STD, seed=seed)
        self.down = RowParallelLinear(f, cfg.hidden_size, p + "down.weight", tp, std=STD / math.sqrt(2 * cfg.num_layers), seed=seed)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This TP rank's partial output for tokens `x` (summed over TP by the caller)."""
        gate, up = torch.split(F.linear(x, self.gate_up.weight), self.gate_up.splits, dim=-1)
        return F.linear(F.silu(gate) * up, self.down.weight)


class LocalExperts(nn.Module):
    """The experts of one layer that this rank's EP run holds (a ZeRO unit of their own)."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, ep: Axis, seed: int):
        super().__init__()
        per = cfg.num_experts // ep.size
        self.tp = tp
        self.first = ep.rank * per
        self.experts = nn.ModuleList(Expert(cfg, layer, e, tp, seed) for e in range(self.first, self.first + per))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Tokens `x` [n, hidden] grouped by local expert (`counts[i]` rows for the i-th) to
        their experts' outputs, in the same order; every TP rank holds the same tokens."""
        x = copy_to_tp(x, self.tp)
        experts: list[Expert] = list(self.experts)  # type: ignore[arg-type]
        outs = [expert.local(chunk) for expert, chunk in zip(experts, torch.split(x, counts))]
        return reduce_from_tp(torch.cat(outs), self.tp)


class MoE(nn.Module):
    """The mixture-of-experts MLP of one layer: the router here, the experts in `experts`
    (not a submodule: its parameters are their own unit), reached through `run_experts`."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, ep: Axis, cp: Axis, seed: int):
        super().__init__()
        self.cfg = cfg
        self.ep, self.cp = ep, cp
        self.router = Router(cfg, f"layers.{layer}.mlp.router.weight", seed)
        self.local_experts = (LocalExperts(cfg, layer, tp, ep, seed),)  # a tuple: not registered here
        self.run_experts: Callable[[torch.Tensor, list[int]], torch.Tensor] = self._run_here
        self.aux_weight = cfg.aux_loss_coef  # the weight of the summed per-sample losses: coef / global batch
        self.aux_sink: list[torch.Tensor] | None = None  # where the forward records its auxiliary loss
        self.loss_scale = 1.0  # fp16: the scale the loss's gradient carries

    @property
    def experts(self) -> LocalExperts:
        return self.local_experts[0]

    def _run_here(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self.local_experts[0](x, counts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        k, n_experts = self.cfg.top_k, self.cfg.num_experts
        tokens = x.reshape(-1, h)
        probs = torch.softmax(F.linear(tokens, self.router.weight).float(), dim=-1)
        weights, chosen = probs.topk(k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # the (token, slot) choices grouped by expert
        counts = torch.bincount(flat, minlength=n_experts)
        out = self._exchange(tokens[order // k], counts)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = (out[inverse].view(-1, k, h) * weights.unsqueeze(-1)).sum(dim=1).view(b, s, h)
        aux = self._aux_loss(probs.view(b, s, n_experts), chosen.view(b, s, k)) * self.aux_weight
        if self.aux_sink is not None:
            self.aux_sink.append(aux.detach())
        return _WithAux.apply(y, aux, self.loss_scale)

    def _exchange(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run `rows` (grouped by expert, `counts` per expert) through their experts, on the
        ranks of the EP group that hold them; return the outputs in the same order."""
        ep = self.ep
        if ep.size == 1:
            return self.run_experts(rows, counts.tolist())
        per = self.cfg.num_experts // ep.size
        every = [torch.empty_like(counts) for _ in range(ep.size)]
        dist.all_gather(every, counts, group=ep.group)
        grid = torch.stack(every)[:, ep.rank * per : (ep.rank + 1) * per]  # [source rank, local expert]
        send = [int(n) for n in counts.view(ep.size, per).sum(dim=1)]
        recv = [int(n) for n in grid.sum(dim=1)]
        got = _AllToAll.apply(rows, send, recv, ep.group)  # source-major, then by expert
        pieces = torch.split(got, grid.reshape(-1).tolist())
        by_expert = torch.cat([pieces[j * per + i] for i in range(per) for j in range(ep.size)])
        done = self.run_experts(by_expert, [int(n) for n in grid.sum(dim=0)])
        pieces = torch.split(done, grid.t().reshape(-1).tolist())  # expert-major, then by source
        by_source = torch.cat([pieces[i * ep.size + j] for j in range(ep.size) for i in range(per)])
        return _AllToAll.apply(by_source, recv, send, ep.group)

    def _aux_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The load-balancing losses of this micro-batch's samples, summed (this CP rank's share)."""
        n_experts, k = self.cfg.num_experts, self.cfg.top_k
        counts = F.one_hot(chosen, n_experts).sum(dim=(1, 2)).to(probs.dtype)  # [b, experts], choices per sample
        if self.cp.size > 1:  # a sample's tokens lie on every CP rank
            dist.all_reduce(counts, group=self.cp.group)
        length = probs.shape[1] * self.cp.size
        share = counts / (length * k)
        return n_experts * (share * probs.sum(dim=1) / length).sum()
