"""Model layouts as data: which boxes of which logical tensors every rank of a topology holds.

A layout (``Layout``, a JSON document with a published schema) describes a model once: its
logical tensors, how TP cuts and fuses them, which pipeline stage holds which layer, how
ZeRO / FSDP flattens them, and the mesh's rank order. A checkpoint records the layout it was
saved with; ``reshard`` plans any target topology from it. Pure: no torch, no I/O but
`load_layout`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import LayoutError
from ..manifest import Manifest
from .builtin import builtin, families, reference_llama, reference_llama_moe
from .model import Constraint, Layout, Param, StateGroup, TensorPart, TPCut, Unit, Zero, layout_json_schema, layout_problems, parse_layout
from .parts import ParamSpec, Part, column_parts, norm_parts, part_ranges, partition, replicated_parts, row_parts, unit_offsets, vocab_parts, vocab_rows
from .placement import Holders, fit_problems, holders, placed_tensors, rank_boxes, stage_units, topology_problems
from .saved import RULE, RangesView
from ..manifest.derived import register_rule

register_rule(RULE, RangesView)

__all__ = [
    "Constraint", "Holders", "Layout", "Param", "ParamSpec", "Part", "StateGroup", "TPCut", "TensorPart",
    "Unit", "Zero", "builtin", "column_parts", "families", "holders", "layout_for",
    "fit_problems", "layout_json_schema", "layout_problems", "load_layout", "manifest_config", "named_layout", "norm_parts", "parse_layout", "part_ranges", "partition", "placed_tensors",
    "rank_boxes", "reference_llama", "reference_llama_moe", "replicated_parts", "row_parts", "stage_units", "topology_problems", "unit_offsets", "vocab_parts",
    "vocab_rows",
]


def load_layout(path: str | os.PathLike[str]) -> Layout:
    """Read and check a layout file.

    Raises:
        LayoutError: the file cannot be read, or the layout has mistakes (all listed).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 26)
    except OSError as exc:
        raise LayoutError(f"{path}: cannot read the layout file ({exc.strerror or exc})") from None
    return parse_layout(data, source=os.fspath(path))


def named_layout(value: str, config: Callable[[], Mapping[str, Any]], *, origin: str) -> Layout:
    """The layout a ``--layout`` option names: a layout file, or the name of a built-in layout
    (`families`) built for the model config `config()` gives (`origin` says whose: the
    checkpoint's, or what the user said of it).

    Raises:
        LayoutError: the file cannot be read or has mistakes; the config lacks what the
            built-in layout needs (named).
    """
    if os.path.exists(value):
        return load_layout(value)
    if value not in families():
        raise LayoutError(f"--layout {value}: no such layout file, and not a built-in layout (built in: {', '.join(families())})")
    try:
        return builtin(value, config())
    except LayoutError as exc:
        raise LayoutError(f"--layout {value}: built for {origin}: {exc}") from None


def manifest_config(manifest: Manifest) -> dict[str, Any]:
    """The model config a checkpoint records: its layout's config, with its ``info.model`` config over it."""
    recorded = manifest.layout.get("config") if manifest.layout else None
    model = manifest.info.model
    return {**(recorded if isinstance(recorded, dict) else {}), **(dict(model.config) if model else {})}


def layout_for(manifest: Manifest, *, where: str = "checkpoint") -> Layout:
    """Return the layout of the model a checkpoint holds: the one its manifest records, else
    the built-in layout of the family its ``info.model`` names (checkpoints of schema 1.1 and
    before).

    Raises:
        LayoutError: the checkpoint records no layout and names no known family, or its
            layout has mistakes.
    """
    if manifest.layout is not None:
        return parse_layout(dict(manifest.layout), source=f"{where}: the manifest's layout")
    model = manifest.info.model
    if model is None:
        raise LayoutError(
            f"{where}: the checkpoint records no layout and names no model (info.model), so its tensors cannot be "
            f"placed on a new topology; give one with --layout FILE (built in: {', '.join(families())})"
        )
    try:
        return builtin(model.family, dict(model.config))
    except LayoutError as exc:
        raise LayoutError(f"{where}: info.model names no usable layout: {exc}") from None

