"""Plan a legacy Megatron-LM conversion: which boxes of which global tensors each rank file's
local tensors hold (pure over parsed rank files: no tensor bytes are read).

A stage's state dict names its layers locally (``decoder.layers.0.`` on every stage); a stage's
layers follow those of the stages before it (with ``--decoder-first/last-pipeline-num-layers``
too), so a stage's offset is the number of layers the earlier stages hold. The local layer
spec's norms (``input_layernorm``, ``pre_mlp_layernorm``) take the names Megatron-Core's
sharded state dict gives them (``self_attention.linear_qkv.layer_norm_weight``,
``mlp.linear_fc1.layer_norm_weight``), as the ``torch_dist`` converter writes them. Which rows
of a local tensor hold which box of its global tensor is the layout's (`local_param`): TP cuts,
QKV groups, gate and up rows of ``linear_fc1``; a TP-replicated tensor is taken from TP rank 0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptkit.boxes import Box
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout, Param
from ckptkit.layouts.model import expand
from ckptkit.layouts.parts import Part
from ckptkit.layouts.placement import local_param
from ckptkit.state.tree import escape
from ckptkit_adapters.common.torchsave import StoredTensor, TorchDtype
from ckptkit_adapters.megatron.legacy_files import MODEL_FILE, RankDir, RankFile
from ckptkit_adapters.megatron.legacy_optim import Buffer, Local

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# The local layer spec's sharded_state_dict_keys_map (megatron/core/models/gpt/gpt_layer_specs.py).
KEYS_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
STATE_NAMES = {"param": "fp32"}  # the distributed optimizer's fp32 master


@dataclass(frozen=True)
class Piece:
    """Rows of one local tensor (a stored tensor, or a range `flat` = (start, shape) of a flat
    one) that hold `part`'s box; `check`: the model tensor (file, stored) a master must round to."""

    file: int
    stored: StoredTensor
    part: Part
    flat: tuple[int, tuple[int, ...]] | None = None
    check: tuple[int, StoredTensor] | None = None


@dataclass
class Planned:
    """Every global tensor's pieces, kinds and sources, in the order they were found."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def add(self, fqn: str, kind: str, source: str, piece: Piece) -> None:
        self.pieces.setdefault(fqn, []).append(piece)
        self.kinds.setdefault(fqn, kind)
        self.sources.setdefault(fqn, source)


def layout_index(layout: Layout) -> dict[str, tuple[Param, int | None]]:
    """The layout's parameters by their module name (``decoder.layers.1.mlp.linear_fc1.weight``)."""
    out: dict[str, tuple[Param, int | None]] = {}
    for unit in layout.units:
        for layer in layout.unit_layers(unit):
            for param in unit.params:
                out[f"{expand(unit.name, layer)}.{param.name}"] = (param, layer)
    return out


def stage_offsets(files: list[RankFile], dirs: list[RankDir], num_layers: int) -> dict[int, int]:
    """Each stage's first global layer: the layers the stages before it hold.

    Raises:
        IntegrityError: the stages hold another number of layers than the arguments say.
    """
    counts: dict[int, int] = {}
    for d, f in zip(dirs, files):
        if d.tp == 0:
            keys = f.tree.get("model", {}) if isinstance(f.tree, dict) else {}
            counts[d.pp] = len({m.group(1) for k in keys if (m := LAYER.match(str(k)))})
    offsets, total = {}, 0
    for pp in sorted(counts):
        offsets[pp], total = total, total + counts[pp]
    if total != num_layers:
        raise IntegrityError(f"the stages hold {total} transformer layers, the arguments say {num_layers}")
    return offsets


def global_key(key: str, offset: int, index: Mapping[str, Any]) -> str:
    """A stage's key under its global layer number (and Megatron-Core's sharded name for the local spec's norms)."""
    m = LAYER.match(key)
    if m is None:
        return key
    found = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
    if found not in index:
        for old, new in KEYS_MAP.items():
            if m.group(2).startswith(old) and (renamed := found.replace(f".{old}", f".{new}", 1)) in index:
                return renamed
    return found


def parts_of(key: str, shape: tuple[int, ...], d: RankDir, tp: int, index: Mapping[str, tuple[Param, int | None]]) -> list[Part] | None:
    """The boxes of global tensors `key`'s local tensor on TP rank `d.tp` holds (None: not in the layout).

    Raises:
        IntegrityError: its shape is not the one the layout gives that rank.
    """
    found = index.get(key)
    if found is None:
        return None
    spec = local_param(found[0], found[1], tp, d.tp)
    if tuple(spec.shape) != tuple(shape):
        raise IntegrityError(f"{d.name}/{MODEL_FILE}: {key} has shape {list(shape)}, the layout gives TP rank {d.tp} "
                             f"{list(spec.shape)}")
    return [p for p in spec.parts if not (p.replicated and d.tp != 0)]


def whole(name: str, shape: tuple[int, ...]) -> Part:
    """A part that is the whole of a tensor (a replicated or per-rank tensor)."""
    return Part(name, shape, (0,) * len(shape), shape, 0, shape[0] if shape else 1)


def coverage_problems(planned: Planned) -> list[str]:
    """Global tensors whose pieces do not add up to the whole (a rank's piece missing)."""
    out = []
    for fqn, pieces in planned.pieces.items():
        shape = pieces[0].part.global_shape
        if sum(math.prod(p.part.lengths) for p in pieces) != math.prod(shape) or len({p.stored.dtype for p in pieces}) != 1:
            out.append(fqn)
    return out


def local_params(model: Mapping[str, Any]) -> list[Local]:
    """A stage's parameters in its state dict's order (Megatron's ``named_parameters`` order)."""
    return [Local(str(k), v.shape, v.dtype) for k, v in model.items() if isinstance(v, StoredTensor)]


def place_model(planned: Planned, model: Mapping[str, Any], file: int, d: RankDir, tp: int, offset: int,
                index: Mapping[str, tuple[Param, int | None]], skipped: list[tuple[str, str]]) -> dict[str, str]:
    """Plan a stage's model tensors; return its global key per local key."""
    keys = {}
    for key, value in model.items():
        if not isinstance(value, StoredTensor):
            continue
        gkey = keys[str(key)] = global_key(str(key), offset, index)
        parts = parts_of(gkey, value.shape, d, tp, index)
        if parts is None:
            skipped.append((f"{d.name}/{MODEL_FILE}:model/{key}", "a tensor the layout does not describe"))
            continue
        for part in parts:
            planned.add(f"model/{escape(part.name)}", "param", f"{d.name}/{MODEL_FILE}:model/{key}", Piece(file, value, part))
    return keys


def place_state(planned: Planned, state: str, local: Local, stored: StoredTensor, file: int, d: RankDir, tp: int,
                gkey: str, index: Mapping[str, tuple[Param, int | None]], source: str,
                flat: tuple[int, tuple[int, ...]] | None = None, check: tuple[int, StoredTensor] | None = None) -> None:
    """Plan one optimizer state tensor of a parameter, cut as the parameter is."""
    parts = parts_of(gkey, local.shape, d, tp, index) or []
    for part in parts:
        planned.add(f"optimizer/{escape(STATE_NAMES.get(state, state))}/{escape(part.name)}", "optimizer", source,
                    Piece(file, stored, part, flat, check))


def distributed_state(tree: Any, buffers: list[Buffer], where: str) -> list[dict[str, StoredTensor]]:
    """The gathered flat tensors of each buffer in ``distrib_optim.pt``, checked against the
    buffers Megatron's bucketing gives the stage.

    Raises:
        ManifestError: an older per-bucket form (``buckets_coalesced`` absent).
        IntegrityError: buffers, dtypes or lengths that do not fit the derived layout.
    """
    if not isinstance(tree, dict) or tree.get("buckets_coalesced") is not True:
        raise ManifestError(f"{where}: a distrib_optim.pt without coalesced buckets (an older Megatron-LM form), which "
                            f"this converter does not read")
    found = sorted(k for k in tree if isinstance(k, int))
    if found != list(range(len(buffers))):
        raise IntegrityError(f"{where}: {len(found)} grad buffers, Megatron's bucketing gives the stage {len(buffers)}")
    out = []
    for i, buf in enumerate(buffers):
        entry = tree[i]
        keys = list(entry) if isinstance(entry, dict) else []
        want = (buf.param_dtype, buf.grad_dtype)
        if len(keys) != 1 or not isinstance(keys[0], tuple) or tuple(t.dtype if isinstance(t, TorchDtype) else None for t in keys[0]) != want:
            raise IntegrityError(f"{where}: buffer {i} is not one of (params {want[0]}, grads {want[1]})")
        states = entry[keys[0]]
        if states.get("numel_unpadded") != buf.numel_unpadded:
            raise IntegrityError(f"{where}: buffer {i} holds {states.get('numel_unpadded')} elements, Megatron's bucketing "
                                 f"of the stage's parameters gives {buf.numel_unpadded}")
        tensors = {k: v for k, v in states.items() if isinstance(v, StoredTensor)}
        if not tensors or any(t.shape != (buf.numel_unpadded,) or t.dtype != "float32" for t in tensors.values()):
            raise IntegrityError(f"{where}: buffer {i}'s state is not flat float32 tensors of {buf.numel_unpadded} elements")
        out.append(tensors)
    return out


def box_of(part: Part) -> Box:
    """The part's box in its global tensor."""
    return Box(part.offsets, part.lengths)


__all__ = ["KEYS_MAP", "Piece", "Planned", "box_of", "coverage_problems", "distributed_state", "global_key", "layout_index",
           "local_params", "parts_of", "place_model", "place_state", "stage_offsets", "whole"]
