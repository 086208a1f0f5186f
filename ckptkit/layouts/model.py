"""The layout document: how a model's logical tensors are cut over TP, PP, DP/ZeRO and placed
on a mesh, as plain JSON (schema ``ckptkit-layout`` 1.x), with its checks (pure).

A layout lists the model's units (the modules whose parameters ZeRO flattens together) in
pipeline order. A unit is placed on the first stage, the last stage, or repeated once per
layer (``{layer}`` in its names becomes the layer index; stages hold equal runs of layers), or
on the layers it lists (``layers``: a model whose first layers are dense and the others a
mixture of experts has a unit of each kind; units of one name on disjoint layers are one
module's two forms).
A unit's parameters are what one TP rank holds locally: each is made of parts, each part a
logical tensor or a partition of one along the TP dim, fused along that dim in order; TP
cuts every part evenly (or, with ``groups``, in groups interleaved part by part, as Megatron
stores fused QKV per query group; or, with ``pad_multiple``, padded as vocabularies are).
A parameter without ``tp`` is replicated over TP. An expert unit (``experts: E``, per layer)
repeats its parameters once per expert (``{expert}`` in its names becomes the expert index):
EP cuts the E experts into ``ep`` equal runs, carved out of the data-parallel ranks (DP rank d
holds run ``d % ep``; the ``dp / ep`` ranks holding one run are its expert-data-parallel
group, over which ZeRO shards the unit's buffer). Every state group (``model``, each
optimizer moment) holds every tensor under its prefix (and before its suffix, if it has one); ZeRO shards the optimizer groups from
stage 1 and the parameters at stage 3; context-parallel ranks hold replicas.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError

from ..errors import LayoutError

FORMAT = "ckptkit-layout"
SCHEMA_MAJOR = 1
SCHEMA_VERSION = "1.3"  # 1.1: expert units (experts, {expert}); 1.2: per-layer units on some layers (layers);
# 1.3: state groups named with a suffix (torch's optimizer state dict: <prefix>/<tensor>/<suffix>)
LAYER = "{layer}"
EXPERT = "{expert}"
Axis = Literal["tp", "cp", "dp", "pp"]
AXES: tuple[Axis, ...] = ("tp", "cp", "dp", "pp")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class TensorPart(_Model):
    """A logical tensor, or the partition [start, start + length) of it along the TP dim."""

    tensor: str = Field(min_length=1)
    shape: tuple[int, ...]
    start: int = Field(default=0, ge=0)
    length: int | None = Field(default=None, ge=0)  # None: to the end of the dim


class TPCut(_Model):
    """How TP cuts a parameter: along `dim` (the dim its parts are fused along)."""

    dim: int = Field(default=0, ge=0)
    groups: int | None = Field(default=None, ge=1)  # interleave the parts per group (fused QKV by query group)
    pad_multiple: int | None = Field(default=None, ge=1)  # pad the dim to a multiple of tp x this (vocabularies)


class Param(_Model):
    """One parameter as a TP rank holds it: its parts in fused order, and its TP cut (None: replicated)."""

    name: str = Field(min_length=1)
    parts: tuple[TensorPart, ...] = Field(min_length=1)
    tp: TPCut | None = None


class Unit(_Model):
    """A module whose parameters ZeRO flattens together, and where the pipeline places it."""

    name: str = Field(min_length=1)
    place: Literal["first", "layers", "last"]
    params: tuple[Param, ...] = Field(min_length=1)
    experts: int | None = Field(default=None, ge=1)  # an expert unit: its params once per expert, cut over EP
    layers: tuple[int, ...] | None = None  # a per-layer unit on these layers only (None: every layer)


class StateGroup(_Model):
    """Tensors saved once per logical tensor under `prefix` (``<prefix>/<tensor>``), or with a
    `suffix` as torch's optimizer state dict names them (``<prefix>/<tensor>/<suffix>``:
    ``optim/state/layers/0/weight/exp_avg``): parameters or optimizer state."""

    prefix: str = Field(min_length=1)
    role: Literal["param", "optimizer"]
    suffix: str | None = Field(default=None, min_length=1)  # new in layout schema 1.3

    @property
    def label(self) -> str:
        """The group's name in messages and tables: its prefix, ``<prefix>/*/<suffix>`` with a suffix."""
        return self.prefix if self.suffix is None else f"{self.prefix}/*/{self.suffix}"

    def fqn(self, tensor: str) -> str:
        """The checkpoint name of this group's `tensor`."""
        return f"{self.prefix}/{tensor}" if self.suffix is None else f"{self.prefix}/{tensor}/{self.suffix}"

    def tensor_of(self, fqn: str) -> str | None:
        """The logical tensor `fqn` is this group's of, or None when it is not of this group."""
        head, tail = f"{self.prefix}/", "" if self.suffix is None else f"/{self.suffix}"
        if not fqn.startswith(head) or not fqn.endswith(tail) or len(fqn) <= len(head) + len(tail):
            return None
        return fqn[len(head): len(fqn) - len(tail)]


class Zero(_Model):
    """How ZeRO / FSDP flattens and cuts: one buffer per ``unit`` (FSDP1, the reference
    trainer), per ``stage`` (DeepSpeed), or every ``param`` cut on dim 0 (FSDP2); each DP
    range a multiple of `align` elements."""

    flatten: Literal["unit", "stage", "param"] = "unit"
    align: int = Field(default=1, ge=1)


class Constraint(_Model):
    """A rule on a mesh axis: its size divides `divides`, or is at most `at_most`; `what` says why."""

    axis: Literal["tp", "cp", "dp", "pp", "ep"]
    divides: int | None = Field(default=None, ge=1)
    at_most: int | None = Field(default=None, ge=1)
    what: str


DEFAULT_STATES = (
    StateGroup(prefix="model", role="param"),
    StateGroup(prefix="optimizer/exp_avg", role="optimizer"),
    StateGroup(prefix="optimizer/exp_avg_sq", role="optimizer"),
)


class Layout(_Model):
    """A model's layout: its tensors, how each parallel dimension cuts them, the mesh order."""

    format: Literal["ckptkit-layout"] = "ckptkit-layout"
    schema_version: str = SCHEMA_VERSION
    name: str = Field(min_length=1)
    config: dict[str, JsonValue] = Field(default_factory=dict)  # the model config it describes (for export)
    mesh: tuple[Axis, ...] = AXES  # rank order, fastest first
    num_layers: int = Field(default=0, ge=0)
    virtual_stages: int = Field(default=1, ge=1)
    zero: Zero = Field(default_factory=Zero)
    states: tuple[StateGroup, ...] = DEFAULT_STATES
    units: tuple[Unit, ...] = Field(min_length=1)
    constraints: tuple[Constraint, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The layout as a JSON object (what a manifest records and a layout file holds)."""
        return self.model_dump(mode="json")

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every logical tensor (without a state prefix) with its global shape, layers expanded."""
        out: dict[str, tuple[int, ...]] = {}
        for unit in self.units:
            for layer in self.unit_layers(unit):
                for expert in range(unit.experts) if unit.experts else (None,):
                    for param in unit.params:
                        for part in param.parts:
                            out[expand(part.tensor, layer, expert)] = part.shape
        return out

    def unit_layers(self, unit: Unit) -> tuple[int | None, ...]:
        """The layers `unit` repeats on, in order; ``(None,)`` for a first or last unit."""
        if unit.place != "layers":
            return (None,)
        return unit.layers if unit.layers is not None else tuple(range(self.num_layers))

    @property
    def experts(self) -> int:
        """The number of experts of the model's expert units (0: no expert unit)."""
        return max((u.experts or 0 for u in self.units), default=0)

    def tensor_groups(self) -> dict[str, list[str]]:
        """Every tensor (fqn) the layout places, in groups a checkpoint holds whole or not at all."""
        names = list(self.tensors())
        return {g.label: [g.fqn(n) for n in names] for g in self.states}


def expand(name: str, layer: int | None, expert: int | None = None) -> str:
    """`name` with ``{layer}`` (and ``{expert}``) replaced by the indices given."""
    name = name if layer is None else name.replace(LAYER, str(layer))
    return name if expert is None else name.replace(EXPERT, str(expert))


def parse_layout(data: bytes | str | dict[str, Any], *, source: str = "layout") -> Layout:
    """Parse and check a layout document.

    Raises:
        LayoutError: not JSON, another format or a newer major version, or a document with
            mistakes; the message lists every problem, one per line.
    """
    problems = layout_problems(data)
    if problems:
        raise LayoutError(f"{source}: {len(problems)} problem(s) in the layout:\n" + "\n".join(f"  {p}" for p in problems))
    text = json.dumps(data) if isinstance(data, dict) else data
    return Layout.model_validate_json(text)


def layout_problems(data: bytes | str | dict[str, Any]) -> list[str]:
    """Return every mistake in a layout document (empty when it is sound)."""
    try:
        raw = json.loads(data) if not isinstance(data, dict) else data
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return [f"not valid JSON ({exc})"]
    if not isinstance(raw, dict):
        return [f"expected a JSON object, got {type(raw).__name__}"]
    if raw.get("format") != FORMAT:
        return [f"format is {raw.get('format')!r}, expected {FORMAT!r}"]
    version = str(raw.get("schema_version", ""))
    if not re.fullmatch(r"\d+\.\d+", version):
        return [f"schema_version {version!r} is not MAJOR.MINOR"]
    if int(version.split(".")[0]) != SCHEMA_MAJOR:
        return [f"schema version {version} is not read by this ckptkit (it reads {SCHEMA_MAJOR}.x)"]
    try:
        layout = Layout.model_validate_json(json.dumps(raw))
    except ValidationError as exc:
        return [f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()]
    return _semantic_problems(layout)


def _semantic_problems(layout: Layout) -> list[str]:
    problems = []
    if sorted(layout.mesh) != sorted(AXES):
        problems.append(f"mesh {list(layout.mesh)} must order each of {', '.join(AXES)} once")
    if layout.num_layers % layout.virtual_stages:
        problems.append(f"{layout.num_layers} layers are not divisible by {layout.virtual_stages} virtual stages")
    labels = [g.label for g in layout.states]
    if len(set(labels)) != len(labels):
        problems.append(f"states: a group is listed twice: {labels}")
    for c in layout.constraints:
        if (c.divides is None) == (c.at_most is None):
            problems.append(f"constraint on {c.axis} ({c.what}): give exactly one of divides, at_most")
    counts = sorted({u.experts for u in layout.units if u.experts is not None})
    if len(counts) > 1:
        problems.append(f"expert units hold different numbers of experts ({', '.join(map(str, counts))}); they must hold the same")
    cover: dict[tuple[str, int | None], list[tuple[int, int, int, tuple[int, ...]]]] = defaultdict(list)
    seen_params: set[tuple[str, str, int | None]] = set()
    for unit in layout.units:
        in_layers = unit.place == "layers"
        problems += _layers_problems(unit, layout.num_layers)
        if in_layers != (LAYER in unit.name):
            problems.append(f"unit {unit.name!r}: " + ("a per-layer unit's name must contain {layer}" if in_layers
                                                       else "only per-layer units (place 'layers') may use {layer}"))
        if unit.experts is not None and not in_layers:
            problems.append(f"unit {unit.name!r}: only per-layer units (place 'layers') may hold experts")
        for param in unit.params:
            where = f"unit {unit.name!r} param {param.name!r}"
            keys = {(unit.name, param.name, layer) for layer in layout.unit_layers(unit)}
            if keys & seen_params:
                problems.append(f"{where}: listed twice")
            seen_params |= keys
            for part in param.parts:
                if (EXPERT in part.tensor) != (unit.experts is not None):
                    problems.append(f"{where}: tensor {part.tensor!r} " + (
                        "must contain {expert} (its unit holds experts)" if unit.experts is not None
                        else "may not use {expert} (only expert units hold experts)"))
            problems += _param_problems(where, param, in_layers, cover, layout.unit_layers(unit) or (None,))
    for (tensor, _), spans in cover.items():
        problems += _cover_problems(tensor, spans)
    return list(dict.fromkeys(problems))  # a template's problem once, not once per layer
    return problems


def _layers_problems(unit: Unit, num_layers: int) -> list[str]:
    """A unit's ``layers``: only on a per-layer unit, in order, each once, each a layer of the model."""
    if unit.layers is None:
        return []
    if unit.place != "layers":
        return [f"unit {unit.name!r}: only per-layer units (place 'layers') may list layers"]
    if list(unit.layers) != sorted(set(unit.layers)):
        return [f"unit {unit.name!r}: its layers {list(unit.layers)} must be in increasing order, each once"]
    outside = [i for i in unit.layers if not 0 <= i < num_layers]
    if outside:
        return [f"unit {unit.name!r}: layers {outside} are not layers of the model's {num_layers}"]
    return []


def _param_problems(
    where: str, param: Param, in_layers: bool, cover: dict[tuple[str, int | None], list[Any]], layers: tuple[int | None, ...]
) -> list[str]:
    problems = []
    dim = param.tp.dim if param.tp is not None else 0
    if param.tp is not None and param.tp.groups is not None and param.tp.pad_multiple is not None:
        problems.append(f"{where}: tp groups and pad_multiple cannot be combined")
    if param.tp is not None and param.tp.pad_multiple is not None and len(param.parts) > 1:
        problems.append(f"{where}: a padded parameter holds one part")
    groups = param.tp.groups if param.tp is not None else None
    others: set[tuple[int, ...]] = set()
    for part in param.parts:
        if in_layers != (LAYER in part.tensor):
            problems.append(f"{where}: tensor {part.tensor!r} " + ("must contain {layer}" if in_layers else "may not use {layer}"))
        if any(n < 0 for n in part.shape):
            problems.append(f"{where}: tensor {part.tensor!r} has a negative size in {list(part.shape)}")
            continue
        if dim >= max(len(part.shape), 1) or (not part.shape and param.tp is not None):
            problems.append(f"{where}: dim {dim} is out of range for {part.tensor!r} of shape {list(part.shape)}")
            continue
        size = part.shape[dim] if part.shape else 1
        length = size - part.start if part.length is None else part.length
        if part.start + length > size or length < 0:
            problems.append(f"{where}: partition [{part.start}, {part.start + length}) of {part.tensor!r} is outside "
                            f"its dim {dim} of size {size}")
            continue
        if groups is not None and length % groups:
            problems.append(f"{where}: {length} along dim {dim} of {part.tensor!r} is not divisible by its {groups} groups")
        others.add(tuple(n for d, n in enumerate(part.shape) if d != dim))
        for layer in layers:  # per layer: units of one name on disjoint layers describe a tensor each
            cover[(part.tensor, layer)].append((part.start, length, dim, part.shape))
    if len(others) > 1:
        problems.append(f"{where}: fused parts differ outside dim {dim}: {sorted(list(o) for o in others)}")
    return problems


def _cover_problems(tensor: str, spans: list[tuple[int, int, int, tuple[int, ...]]]) -> list[str]:
    """The partitions of one tensor must tile its dim exactly, all with the same shape and dim."""
    shapes = {s[3] for s in spans}
    dims = {s[2] for s in spans}
    if len(shapes) > 1 or len(dims) > 1:
        return [f"tensor {tensor!r} is described with different shapes or dims: "
                + ", ".join(f"{list(sh)} dim {d}" for _, _, d, sh in spans)]
    shape, dim = spans[0][3], spans[0][2]
    size = shape[dim] if shape else 1
    position = 0
    for start, length, _, _ in sorted(spans):
        if start != position:
            what = "overlap" if start < position else "leave a gap"
            return [f"tensor {tensor!r}: its partitions along dim {dim} {what} at {min(start, position)} "
                    f"(they must add up to its size {size})"]
        position = start + length
    if position != size:
        return [f"tensor {tensor!r}: its partitions along dim {dim} add up to {position}, not its size {size}"]
    return []


def layout_json_schema() -> dict[str, Any]:
    """Return the JSON Schema of layout documents v1, as published under ``schemas/layout/``."""
    schema = Layout.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://ckptkit.dev/schemas/layout/v{SCHEMA_MAJOR}.schema.json"
    return schema
