"""The GPU benchmark's state: a Llama-like model's bf16 parameters, fp32 masters and Adam moments.

Every parameter has a bf16 copy (the model) and three fp32 tensors (the optimizer's master
and its two moments): 14 bytes a parameter. The shapes are a Llama's (grouped-query
attention, a gated MLP, RMS norms, untied embedding and head); the number of layers is chosen
to come nearest the requested size. The default, ~7.5 GB, is a 0.54B-parameter model of
hidden size 2048; ``small`` is a 36M-parameter one of hidden size 512 (about 0.5 GB).
Sizing imports no torch, so it is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BYTES_PER_PARAM = 2 + 3 * 4  # bf16 parameter; fp32 master, exp_avg, exp_avg_sq
DEFAULT_BYTES = 7_500_000_000
SMALL_BYTES = 500_000_000


@dataclass(frozen=True)
class Llama:
    """A Llama-like model's shape: hidden size, MLP width, key/value width, vocabulary, layers."""

    hidden: int
    ffn: int
    kv: int
    vocab: int
    layers: int

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """The parameters' names and shapes, in a fixed order."""
        h = self.hidden
        out: list[tuple[str, tuple[int, ...]]] = [("embed.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "attn.q.weight", (h, h)), (p + "attn.k.weight", (self.kv, h)), (p + "attn.v.weight", (self.kv, h)),
                (p + "attn.o.weight", (h, h)), (p + "mlp.gate.weight", (self.ffn, h)), (p + "mlp.up.weight", (self.ffn, h)),
                (p + "mlp.down.weight", (h, self.ffn)), (p + "attn_norm.weight", (h,)), (p + "mlp_norm.weight", (h,)),
            ]
        return out + [("norm.weight", (h,)), ("head.weight", (self.vocab, h))]

    def parameter_count(self) -> int:
        total = 0
        for _, shape in self.parameters():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def state_bytes(self) -> int:
        return self.parameter_count() * BYTES_PER_PARAM


_BASE = Llama(hidden=2048, ffn=5632, kv=512, vocab=32000, layers=0)
_SMALL = Llama(hidden=512, ffn=1408, kv=128, vocab=8000, layers=0)


def llama_for(target_bytes: int, *, small: bool = False) -> Llama:
    """The model of the base shape (or the small one) whose state comes nearest `target_bytes`
    (at least one layer)."""
    base = _SMALL if small else _BASE
    fixed = base.state_bytes()
    per_layer = Llama(base.hidden, base.ffn, base.kv, base.vocab, 1).state_bytes() - fixed
    layers = max(1, round((target_bytes - fixed) / per_layer))
    return Llama(base.hidden, base.ffn, base.kv, base.vocab, layers)


def build_state(model: Llama, device: Any) -> dict[str, dict[str, Any]]:
    """The state on `device`: ``model`` (bf16) and ``optimizer`` ``master``/``exp_avg``/``exp_avg_sq`` (fp32)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    params = {name: torch.randn(shape, generator=gen, device=device, dtype=torch.float32) for name, shape in model.parameters()}
    state: dict[str, dict[str, Any]] = {"model": {n: p.to(torch.bfloat16) for n, p in params.items()}}
    state["optimizer"] = {
        "master": params,
        "exp_avg": {n: torch.randn(p.shape, generator=gen, device=device) * 1e-3 for n, p in params.items()},
        "exp_avg_sq": {n: torch.rand(p.shape, generator=gen, device=device) * 1e-6 for n, p in params.items()},
    }
    return state


def tensors_of(state: dict[str, Any]) -> list[torch.Tensor]:
    """Every tensor of a nested state, in order."""
    out = []
    for value in state.values():
        out += tensors_of(value) if isinstance(value, dict) else [value]
    return out


def empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state of uninitialized tensors of the same names, shapes, dtypes and devices (a load target)."""
    import torch

    return {k: empty_like_state(v) if isinstance(v, dict) else torch.empty_like(v) for k, v in state.items()}
