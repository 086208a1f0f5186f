"""One rank of the trainer: its pipeline stage, ZeRO units, the GPipe schedule and the optimizer step.

The loss is the sum of the per-token cross entropies over the global batch divided by its
tokens, plus (a mixture of experts) every layer's auxiliary load-balancing loss; every rank
reports the same value.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import ModelConfig, TrainConfig
from .mesh import Groups, Mesh
from .model import Stage
from .moe import Axis, MoE
from .precision import DTYPES, LossScaler
from ..layouts import Part
from .tp import TPContext, parallel_cross_entropy
from .zero import AdamW, DPContext, Unit


def module_params(module: nn.Module) -> list[tuple[str, nn.Parameter, list[Part]]]:
    """Return (name, parameter, logical parts) of every parameter of `module`, in a fixed order."""
    owners = {id(m.weight): m for m in module.modules() if hasattr(m, "parts") and hasattr(m, "weight")}
    return [(n, p, getattr(owners[id(p)], "parts")) for n, p in module.named_parameters()]


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at ``total_steps``."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(cfg.warmup_steps, 1)
    progress = min(1.0, (step - cfg.warmup_steps) / max(cfg.total_steps - cfg.warmup_steps, 1))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class Engine:
    """The model shard, optimizer and schedule of one rank."""

    def __init__(self, cfg: TrainConfig, model: ModelConfig, mesh: Mesh, groups: Groups):
        self.cfg = cfg
        self.model_cfg = model
        self.mesh = mesh
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
        self.compute = DTYPES[cfg.precision]
        self.scaler = LossScaler(cfg.loss_scale, growth_interval=cfg.loss_scale_window) if cfg.precision == "fp16" else None
        self.tp = TPContext(mesh.tp, mesh.tp_rank, groups.tp)
        self.dp = DPContext(mesh.dp, mesh.dp_rank, groups.dp)
        self.cp = Axis(mesh.cp, mesh.cp_rank, groups.cp)
        edp = DPContext(mesh.edp, mesh.edp_rank, groups.edp)  # the DP ranks holding this rank's experts
        replicas = DPContext(mesh.cp, mesh.cp_rank, groups.cp)
        self.stage = Stage(model, self.tp, pp_rank=mesh.pp_rank, pp=mesh.pp, seed=cfg.seed, cp=self.cp,
                           ep=Axis(mesh.ep, mesh.ep_rank, groups.ep)).to(self.device)
        expert_units = {id(m) for m in self.stage.experts}
        self.units: dict[int, Unit] = {}
        for module in self.stage.param_units():
            dp = edp if id(module) in expert_units else self.dp
            self.units[id(module)] = Unit(module, module_params(module), dp, cfg.zero, replicas, compute=self.compute,
                                          device=self.device)
        self.moe = self.stage.moe_layers()
        for moe in self.moe:
            moe.aux_weight = model.aux_loss_coef / cfg.global_batch  # the mean over the global batch's samples
            moe.run_experts = functools.partial(self._call, moe.experts)
        self.optimizer = AdamW(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay)
        # --freeze-layers N: the embedding and layers 0..N-1 (and their experts) keep their
        # parameters and optimizer state; their gradients are neither reduced nor counted.
        frozen: list[nn.Module] = [self.stage.embed] if cfg.freeze_layers and self.stage.embed is not None else []
        for n, layer in enumerate(self.stage.layers):
            if self.stage.first_layer + n < cfg.freeze_layers:
                frozen.append(layer)
                if isinstance(layer.mlp, MoE):
                    frozen.append(layer.mlp.experts)
        self.frozen = {id(m) for m in frozen}
        self._norm_masks = {key: self._norm_mask(u) for key, u in self.units.items()}

    def _norm_mask(self, unit: Unit) -> torch.Tensor:
        """1 for elements this rank counts in the gradient norm: TP-replicated ones only on TP rank 0."""
        mask = torch.ones(unit.numel, device=self.device)
        if self.cp.rank != 0:  # context-parallel ranks hold replicas
            mask.zero_()
        elif self.tp.rank != 0:
            for slot in unit.slots:
                if any(p.replicated for p in slot.parts):
                    mask[slot.offset : slot.offset + slot.numel] = 0.0
        return mask[unit.lo : unit.hi]

    def _call(self, module: nn.Module, *args: Any) -> Any:
        return self.units[id(module)].call(*args)

    def train_step(self, micro_batches: list[torch.Tensor], global_tokens: int) -> tuple[float, float, float]:
        """Run forward and backward over this rank's micro-batches, then the optimizer step.

        Returns (loss, lr, grad norm), the same on every rank; under fp16, a step whose
        gradients overflow is skipped (the optimizer step does not advance) and its norm is inf.
        """
        aux: list[torch.Tensor] = []
        scale = self.scaler.scale if self.scaler is not None else 1.0
        losses = self._forward_backward([b.to(self.device) for b in micro_batches], global_tokens, aux, scale)
        loss = self._global_loss(losses, aux)
        trained = {key: u for key, u in self.units.items() if key not in self.frozen}
        grads = {key: u.reduced_grad() for key, u in trained.items()}
        if self.scaler is not None:
            for g in grads.values():
                g.div_(scale)
            overflow = self._overflow(grads)
            self.scaler.update(overflow)
            if overflow:
                for unit in self.units.values():
                    unit.zero_grad()
                return loss, learning_rate(self.cfg, self.optimizer.step + 1), float("inf")
        self.optimizer.step += 1
        lr = learning_rate(self.cfg, self.optimizer.step)
        norm = self._grad_norm(grads)
        clip = min(1.0, self.cfg.grad_clip / (norm + 1e-6)) if self.cfg.grad_clip > 0 else 1.0
        for key, unit in self.units.items():
            if key in trained:
                self.optimizer.update(unit, grads[key], lr, clip)
                unit.publish()
            unit.zero_grad()
        return loss, lr, norm

    def _overflow(self, grads: dict[int, torch.Tensor]) -> bool:
        """Whether any rank's gradients hold an inf or a nan."""
        flag = torch.zeros(1, device=self.device)
        for g in grads.values():
            if not bool(torch.isfinite(g).all()):
                flag.fill_(1.0)
                break
        if self.mesh.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _forward_backward(self, micro_batches: list[torch.Tensor], global_tokens: int,
                          aux: list[torch.Tensor], scale: float = 1.0) -> list[torch.Tensor]:
        """GPipe: every micro-batch forward through the stages, then every one backward, in
        reverse (the loss times `scale`). Returns the last stage's losses; `aux` receives this
        stage's auxiliary losses."""
        mesh = self.mesh
        prev = mesh.rank_of(mesh.tp_rank, mesh.dp_rank, mesh.pp_rank - 1) if not mesh.is_first_stage else None
        nxt = mesh.rank_of(mesh.tp_rank, mesh.dp_rank, mesh.pp_rank + 1) if not mesh.is_last_stage else None
        hidden = self.model_cfg.hidden_size
        inputs, outputs, losses = [], [], []
        for moe in self.moe:
            moe.aux_sink, moe.loss_scale = aux, scale
        for batch in micro_batches:
            ids, targets = batch[:, :-1], batch[:, 1:]
            if self.cp.size > 1:  # this CP rank's slice of every sequence
                n = ids.shape[1] // self.cp.size
                ids, targets = (t[:, self.cp.rank * n : (self.cp.rank + 1) * n] for t in (ids, targets))
            if prev is None:
                x = ids
            else:
                x = torch.empty(ids.shape[0], ids.shape[1], hidden, dtype=self.compute, device=self.device)
                dist.recv(x, src=prev)
                x.requires_grad_()
            y = self.stage(x, self._call)
            if nxt is None:
                head = self.stage.output_head()
                per_token = parallel_cross_entropy(y.reshape(-1, y.shape[-1]), targets.reshape(-1), head)
                y = per_token.sum() / global_tokens
                losses.append(y.detach())
            else:
                dist.send(y.detach().contiguous(), dst=nxt)
            inputs.append(x)
            outputs.append(y)
        for moe in self.moe:  # a backward that recomputes a forward (ZeRO 3) records nothing
            moe.aux_sink = None
        for x, y in zip(reversed(inputs), reversed(outputs)):
            if nxt is None:
                (y * scale if scale != 1.0 else y).backward()
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, src=nxt)
                y.backward(grad)
            if prev is not None:
                assert x.grad is not None
                dist.send(x.grad.contiguous(), dst=prev)
        return losses

    def _global_loss(self, losses: list[torch.Tensor], aux: list[torch.Tensor]) -> float:
        """Sum the micro-batch losses over DP (and CP) on the last stage, and the auxiliary
        losses of every stage; every rank gets that exact value."""
        value = torch.tensor([float("-inf")], device=self.device)
        if losses:
            total = torch.stack(losses).sum().reshape(1)
            if self.dp.size > 1:
                dist.all_reduce(total, group=self.dp.group)
            if self.cp.size > 1:
                dist.all_reduce(total, group=self.cp.group)
            value = total
        if self.mesh.world_size > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        if self.model_cfg.num_experts:  # each stage's layers, each DP rank's samples, each CP rank's share; TP ranks repeat them
            extra = torch.stack(aux).sum().reshape(1) if aux and self.tp.rank == 0 else torch.zeros(1, device=self.device)
            if self.mesh.world_size > 1:
                dist.all_reduce(extra)
            value = value + extra
        return float(value.item())

    def _grad_norm(self, grads: dict[int, torch.Tensor]) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for key, g in grads.items():
            unit = self.units[key]
            own = g[unit.lo - unit.state_lo : unit.hi - unit.state_lo]
            total += (own.double() ** 2 * self._norm_masks[key].double()).sum()
        if self.mesh.world_size > 1:
            dist.all_reduce(total)
        return float(total.sqrt().item())
