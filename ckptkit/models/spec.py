"""The canonical model of an architecture (pure data, no torch): its logical tensors, unfused
and named once, with their shapes, which layers are dense and which a mixture of experts,
which tensors are tied, and the rules that hold for them.

Names are those of the reference trainer's Llama, grown to cover what other architectures
have: ``embed.weight``, ``pos_embed.weight`` (learned positions), ``norm.weight`` /
``norm.bias`` and ``lm_head.weight`` at the top; per layer ``attn_norm`` (before attention),
``attn_out_norm`` (on its output), ``mlp_norm`` (before the MLP), ``mlp_out_norm`` (on its
output); ``attn.{q,k,v,o}`` with optional biases and per-head ``attn.{q,k}_norm``, or
multi-head latent attention's ``attn.{q_a,q_a_norm,q_b,kv_a,kv_a_norm,kv_b}``; a gated MLP's
``mlp.{gate,up,down}`` (an ungated one's ``mlp.{up,down}``, with biases where it has them); a
mixture of experts' ``mlp.router.weight`` (and ``mlp.router.score_bias``, DeepSeek's selection
bias), each expert's ``gate``, ``up``, ``down`` and the shared expert's ``mlp.shared.*`` with
its gate ``mlp.shared_gate.weight``. Each tensor says how tensor parallelism cuts it:
``column`` (output rows, dim 0), ``row`` (input columns, dim 1), ``vocab`` (rows, padded), or
not at all (replicated).

A tool's format is a view of this model (``models.view``): its names, how it fuses these
tensors, and so the layout its checkpoints are cut by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Cut = Literal["column", "row", "vocab"]


@dataclass(frozen=True, slots=True)
class Tensor:
    """A logical tensor: its canonical name (relative to its scope), its shape and its TP cut."""

    name: str
    shape: tuple[int, ...]
    cut: Cut | None = None  # None: replicated over TP


@dataclass(frozen=True, slots=True)
class Block:
    """One kind of layer: its tensors (names relative to ``layers.<i>.``) and, in a mixture of
    experts, the number of experts and one expert's tensors (relative to ``mlp.experts.<e>.``)."""

    tensors: tuple[Tensor, ...]
    experts: int = 0
    expert_tensors: tuple[Tensor, ...] = ()


@dataclass(frozen=True, slots=True)
class Rule:
    """A rule on a mesh axis: its size divides `divides` or is at most `at_most`; `what` says why."""

    axis: Literal["tp", "pp", "ep"]
    what: str
    divides: int | None = None
    at_most: int | None = None


@dataclass(frozen=True)
class ModelSpec:
    """An architecture's canonical model, as its config makes it."""

    architecture: str  # the config's model type ("qwen2_moe")
    family: str  # the look-alikes it belongs to ("llama", "gpt-neox", "gpt2")
    first: tuple[Tensor, ...]  # on the first pipeline stage (embeddings)
    layers: tuple[Block, ...]  # layer i's block
    last: tuple[Tensor, ...]  # on the last stage (final norm, head)
    tied: bool  # the head is the input embedding
    rules: tuple[Rule, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)  # the config it was made from

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every canonical tensor (layers and experts expanded) with its shape."""
        out = {t.name: t.shape for t in self.first}
        for i, block in enumerate(self.layers):
            out.update({f"layers.{i}.{t.name}": t.shape for t in block.tensors})
            for e in range(block.experts):
                out.update({f"layers.{i}.mlp.experts.{e}.{t.name}": t.shape for t in block.expert_tensors})
        out.update({t.name: t.shape for t in self.last})
        return out

    def kinds(self) -> list[tuple[Block, tuple[int, ...]]]:
        """The distinct blocks and the layers of each, in order of first use."""
        out: dict[Block, list[int]] = {}
        for i, block in enumerate(self.layers):
            out.setdefault(block, []).append(i)
        return [(block, tuple(layers)) for block, layers in out.items()]
