"""The Llama-architecture model, cut into pipeline stages, tensor-parallel shards and
context-parallel slices of the sequence.

RMSNorm, rotary position embeddings, grouped-query attention with a fused QKV projection,
SwiGLU MLP with a fused gate/up projection (or a mixture of experts, ``moe``), optional tied
embeddings. Logical names follow the global layer index (``layers.{i}.attn.q.weight``) so that
a stage maps its layers to global names.

Context parallelism: CP rank c holds positions [c * s, (c + 1) * s) of every sequence; each
layer's attention gathers the keys and values of the whole sequence from the CP group (an
all-gather, whose backward sums the gradients back), and its queries attend causally by
global position. Everything else is per token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from ..layouts import norm_parts
from .moe import MoE, Axis, LocalExperts
from .tp import ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallel, init_global

STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, name: str, eps: float, seed: int):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(init_global(name, (hidden,), 0.0, seed))
        self.parts = norm_parts(name, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # normalised in fp32 whatever the compute dtype
        scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * scale).to(x.dtype) * self.weight


def rotary(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return cos and sin tables [seq_len, head_dim] for rotary embeddings (half-split layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class _GatherSequence(torch.autograd.Function):
    """All-gather [b, heads, s, d] slices along the sequence over the CP group; backward sums
    the gradients of the whole sequence over the group and keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: Axis) -> torch.Tensor:  # type: ignore[override]
        ctx.cp = cp
        pieces = [torch.empty_like(x) for _ in range(cp.size)]
        dist.all_gather(pieces, x.contiguous(), group=cp.group)
        return torch.cat(pieces, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        cp: Axis = ctx.cp
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=cp.group)
        n = total.shape[2] // cp.size
        return total[:, :, cp.rank * n : (cp.rank + 1) * n].contiguous(), None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, seed: int, cp: Axis = Axis()):
        super().__init__()
        self.cp = cp
        p = f"layers.{layer}.attn."
        hd = cfg.head_dim
        self.heads = cfg.num_heads // tp.size
        self.kv_heads = cfg.num_kv_heads // tp.size
        self.head_dim = hd
        self.qkv = ColumnParallelLinear(
            cfg.hidden_size,
            [p + "q.weight", p + "k.weight", p + "v.weight"],
            [cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.num_kv_heads * hd],
            tp,
            std=STD,
            seed=seed,
        )
        out_std = STD / math.sqrt(2 * cfg.num_layers)
        self.o = RowParallelLinear(cfg.num_heads * hd, cfg.hidden_size, p + "o.weight", tp, std=out_std, seed=seed)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = None
        if self.cp.size > 1:
            k, v = _GatherSequence.apply(k, self.cp), _GatherSequence.apply(v, self.cp)
            mine = torch.arange(s, device=q.device) + self.cp.rank * s
            mask = mine.unsqueeze(1) >= torch.arange(k.shape[2], device=q.device).unsqueeze(0)  # causal by global position
        repeat = self.heads // self.kv_heads
        k = k.repeat_interleave(repeat, dim=1)
        v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.o(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, seed: int):
        super().__init__()
        p = f"layers.{layer}.mlp."
        f = cfg.intermediate_size
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size, [p + "gate.weight", p + "up.weight"], [f, f], tp, std=STD, seed=seed
        )
        self.down = RowParallelLinear(f, cfg.hidden_size, p + "down.weight", tp, std=STD / math.sqrt(2 * cfg.num_layers), seed=seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TPContext, seed: int, cp: Axis = Axis(), ep: Axis = Axis()):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, f"layers.{layer}.attn_norm.weight", cfg.norm_eps, seed)
        self.attn = Attention(cfg, layer, tp, seed, cp)
        self.mlp_norm = RMSNorm(cfg.hidden_size, f"layers.{layer}.mlp_norm.weight", cfg.norm_eps, seed)
        self.mlp: nn.Module = MoE(cfg, layer, tp, ep, cp, seed) if cfg.num_experts else MLP(cfg, layer, tp, seed)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Stage(nn.Module):
    """The layers [first, last) of one pipeline stage, with the embedding on the first stage and
    the final norm and head on the last; of a mixture of experts, the experts of this rank's EP
    run (`experts`, one module per layer)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, tp: TPContext, *, pp_rank: int, pp: int, seed: int, cp: Axis = Axis(),
                 ep: Axis = Axis()):
        super().__init__()
        per = cfg.num_layers // pp
        self.cfg = cfg
        self.cp = cp
        self.first_layer = pp_rank * per
        self.is_first = pp_rank == 0
        self.is_last = pp_rank == pp - 1
        self.embed = VocabParallel(cfg.vocab_size, cfg.hidden_size, "embed.weight", tp, std=STD, seed=seed) if self.is_first else None
        self.layers = nn.ModuleList(Layer(cfg, i, tp, seed, cp, ep) for i in range(self.first_layer, self.first_layer + per))
        self.experts = nn.ModuleList(layer.mlp.experts for layer in self.layers if isinstance(layer.mlp, MoE))
        self.norm = RMSNorm(cfg.hidden_size, "norm.weight", cfg.norm_eps, seed) if self.is_last else None
        self.head: VocabParallel | None = None
        if self.is_last and not cfg.tie_embeddings:
            self.head = VocabParallel(cfg.vocab_size, cfg.hidden_size, "lm_head.weight", tp, std=STD, seed=seed)
        cos, sin = rotary(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def output_head(self) -> VocabParallel:
        head = self.head if self.head is not None else self.embed
        assert head is not None, "only the last stage has an output head"
        return head

    def units(self) -> list[nn.Module]:
        """Return the modules that run in sequence: embedding, layers, final norm, head."""
        mods: list[nn.Module] = [self.embed] if self.embed is not None else []
        mods += list(self.layers)
        if self.norm is not None:
            mods += [self.norm, self.output_head()]
        return mods

    def param_units(self) -> list[nn.Module]:
        """The modules whose parameters are ZeRO units, in the layout's order: the units, with
        each layer's experts after the layer."""
        experts: dict[int, LocalExperts] = {id(layer): layer.mlp.experts for layer in self.layers if isinstance(layer.mlp, MoE)}
        out: list[nn.Module] = []
        for module in self.units():
            if module not in out:
                out.append(module)
                if id(module) in experts:
                    out.append(experts[id(module)])
        return out

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    def forward(self, x: torch.Tensor, call: Any = None) -> torch.Tensor:
        """Token ids [b, s] on the first stage, hidden states [b, s, h] elsewhere; returns hidden
        states, or vocab-split logits [b, s, v_local] on the last stage. `call(module, *args)`
        runs each unit (default: the module itself)."""
        run = call or (lambda m, *a: m(*a))
        s = x.shape[1]
        first = self.cp.rank * s  # this CP rank's slice of the positions
        cos, sin = self.cos[first : first + s], self.sin[first : first + s]
        for module in self.units():
            x = run(module, x, cos, sin) if isinstance(module, Layer) else run(module, x)
        return x
