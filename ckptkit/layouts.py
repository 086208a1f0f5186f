"""Target layouts (pure): which boxes of which tensors every rank of a topology holds.

A checkpoint's manifest knows only global tensors and the boxes they were saved in; to write
a checkpoint for another topology, ``reshard`` needs the model's layout: which tensors are
split over TP and along which dim, how PP stages group layers, how ZeRO cuts flat buffers.
A layout comes from the checkpoint's ``info.model`` (family and config); ``layout_for``
picks it. Tensors a layout does not place (RNG rows, extra buffers) keep their saved boxes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .boxes import Box
from .errors import LayoutError
from .manifest import Manifest, Topology


class Layout(Protocol):
    """How one model family places its tensors over a topology."""

    def problems(self, topology: Topology) -> list[str]:
        """Every reason the model cannot be laid out over `topology`; empty when it can."""

    def tensor_groups(self) -> dict[str, list[str]]:
        """Every tensor (fqn) the layout places, in groups a checkpoint holds whole or not at all
        (e.g. parameters, and each optimizer moment)."""

    def rank_boxes(self, topology: Topology, rank: int) -> dict[str, list[Box]]:
        """The boxes of every tensor (fqn) that `rank` of `topology` holds."""


def holders(layout: Layout, topology: Topology) -> dict[str, dict[Box, list[int]]]:
    """Return every tensor's distinct non-empty boxes over `topology`, with the ranks holding each.

    Uses the layout's own ``holders(topology)`` when it has one (computing replicas once
    is much faster for thousands of ranks), else asks every rank.
    """
    fast = getattr(layout, "holders", None)
    if fast is not None:
        return fast(topology)  # type: ignore[no-any-return]
    out: dict[str, dict[Box, list[int]]] = {}
    for rank in range(topology.world_size):
        for fqn, boxes in layout.rank_boxes(topology, rank).items():
            by_box = out.setdefault(fqn, {})
            for box in boxes:
                if box.volume or not box.ndim:
                    owners = by_box.setdefault(box, [])
                    if rank not in owners:
                        owners.append(rank)
    return out


@dataclass(frozen=True)
class LlamaLayout:
    """The reference trainer's layout: model/<name> and optimizer/exp_avg[_sq]/<name>."""

    config: Any  # ckptkit.trainer.config.ModelConfig

    def problems(self, topology: Topology) -> list[str]:
        from .trainer.config import model_topology_problems

        problems = model_topology_problems(self.config, topology.tp, topology.pp, topology.dp, topology.zero_stage)
        if topology.cp != 1 or topology.ep != 1:
            problems.append("this layout has no context or expert parallelism (cp and ep must be 1)")
        if topology.world_size != topology.tp * topology.pp * topology.dp * topology.cp:
            problems.append(f"world size {topology.world_size} is not tp x pp x dp")
        return problems

    def tensor_groups(self) -> dict[str, list[str]]:
        from .trainer.layout import logical_param_names

        names = logical_param_names(self.config)
        return {prefix: [f"{prefix}/{n}" for n in names] for prefix in _PREFIXES}

    def holders(self, topology: Topology) -> dict[str, dict[Box, list[int]]]:
        from .trainer.layout import topology_holders

        t = topology
        return topology_holders(self.config, t.tp, t.pp, t.dp, t.zero_stage)

    def rank_boxes(self, topology: Topology, rank: int) -> dict[str, list[Box]]:
        from .trainer.layout import rank_boxes

        boxes = rank_boxes(self.config, topology.tp, topology.pp, topology.dp, topology.zero_stage, rank)
        return {f"{prefix}/{name}": bs for prefix, by_name in boxes.items() for name, bs in by_name.items()}


_PREFIXES = ("model", "optimizer/exp_avg", "optimizer/exp_avg_sq")


def _llama(config: dict[str, Any]) -> Layout:
    from .trainer.config import ModelConfig

    try:
        return LlamaLayout(ModelConfig(**config))
    except TypeError as exc:
        raise LayoutError(f"info.model.config does not describe a llama model: {exc}") from None


LAYOUTS: dict[str, Callable[[dict[str, Any]], Layout]] = {"llama": _llama}


def layout_for(manifest: Manifest, *, where: str = "checkpoint") -> Layout:
    """Return the layout of the model a checkpoint holds, from its ``info.model``.

    Raises:
        LayoutError: the checkpoint names no model, or a family no layout is known for.
    """
    model = manifest.info.model
    if model is None:
        raise LayoutError(
            f"{where}: the manifest names no model (info.model), so the tensors cannot be placed on a new "
            f"topology; reshard knows the families {', '.join(sorted(LAYOUTS))}"
        )
    make = LAYOUTS.get(model.family)
    if make is None:
        raise LayoutError(
            f"{where}: no layout known for model family {model.family!r}; reshard knows {', '.join(sorted(LAYOUTS))}"
        )
    return make(dict(model.config))
