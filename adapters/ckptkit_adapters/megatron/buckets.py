"""Megatron-Core's distributed optimizer state in its ``dp_reshardable`` form: where each parameter lies in the bucket buffers (pure).

Megatron-LM's default. The state is saved as the optimizer holds it: per data-parallel group
(one per TP x PP rank, ``dp_group_idx_<g>``), per grad buffer (``gbuf_idx_<k>``, one per
(parameter dtype, grad dtype)) and per bucket, one flat 1-D tensor per state (``param``, the fp32
master; ``exp_avg``; ``exp_avg_sq``) of the bucket's unpadded size, plus the buckets' sizes
(``per_bucket_numel_unpadded``). Which parameter lies where is not saved. It is what
megatron-core's ``_ParamAndGradBuffer`` computes, and `bucket_places` computes it again:

- the parameters of a model-parallel rank (its TP-local parameters of its pipeline stage, as
  the ``megatron-gpt`` layout places them) in the order the module registers them
  (`LAYER_ORDERS`: the local and the TransformerEngine layer specs differ), grouped into
  buffers by dtype;
- each buffer filled from its last parameter backwards, each start padded to a multiple of 64
  elements; a bucket ends after the parameter where its saved unpadded size is reached
  (`fill_buckets`, which the legacy converter's layout of ``distrib_optim.pt`` shares).

Every derived place is checked against the checkpoint: the buckets' sizes, each bucket's saved
tensor of exactly that size, every parameter boundary at a chunk boundary (each rank saved each
parameter piece and each padding run as its own chunk). A layer order that fails is not used;
when none fits, the conversion is refused naming the problems. (The converter also checks each
fp32 master against the model's own tensor: see ``reader``.)

Model-parallel rank ``g`` is TP rank ``g % tp`` of stage ``g // tp`` (megatron-core's model
parallel group, TP fastest).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ckptkit.layouts import Layout
from ckptkit.layouts.parts import ParamSpec
from ckptkit.layouts.placement import stage_units

BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\(torch\.(\w+), torch\.(\w+)\)"
                    r"\.bucket_idx_(\d+)\.(\w+)$")
GROUP_VALUE = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.(\w+)/shard_0_1$")
PARAM_ALIGN = 64  # megatron-core pads each parameter's start in a bucket to 64 elements
STATES = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # saved state -> ckptkit state name
_ATTENTION = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight")
_MLP = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
# The order a transformer layer registers its parameters in (names as the layout gives them).
LAYER_ORDERS: dict[str, tuple[str, ...]] = {
    "local": _ATTENTION + _MLP,  # input_layernorm, linear_proj, linear_qkv; pre_mlp_layernorm, linear_fc1, linear_fc2
    "transformer-engine": (_ATTENTION[1], _ATTENTION[0], _ATTENTION[2]) + _MLP,  # linear_proj; linear_qkv (its norm first); ...
}


@dataclass(frozen=True, slots=True)
class Bucket:
    """One saved bucket: its entry key without the state suffix and its unpadded size."""

    group: int
    gbuf: int
    index: int
    param_dtype: str
    prefix: str
    numel: int
    cuts: frozenset[int]  # the offsets where the saved tensor's chunks start


@dataclass(frozen=True, slots=True)
class Place:
    """A TP-local parameter of model-parallel rank `group`: elements [start, start + numel) of `bucket`."""

    group: int
    bucket: Bucket
    start: int
    spec: ParamSpec


def buckets_of(entries: dict[str, Any]) -> tuple[dict[tuple[int, int, int], Bucket], set[str]]:
    """The saved buckets (by group, buffer, index) and the states saved for them, from the DCP
    entries (key -> tensor metadata with ``shape`` and ``chunks``, or None for a value)."""
    out: dict[tuple[int, int, int], Bucket] = {}
    states: set[str] = set()
    for key, meta in entries.items():
        found = BUCKET.match(key) if meta is not None else None
        if found is None:
            continue
        g, k, b = int(found.group(1)), int(found.group(2)), int(found.group(5))
        states.add(found.group(6))
        if (g, k, b) not in out:
            prefix = key[: -len(found.group(6)) - 1]
            out[(g, k, b)] = Bucket(g, k, b, found.group(3), prefix, meta.shape[0] if len(meta.shape) == 1 else -1,
                                    frozenset(c.offsets[0] for c in meta.chunks if len(c.offsets) == 1))
    return out, states


def bucket_places(layout: Layout, tp: int, pp: int, buckets: dict[tuple[int, int, int], Bucket],
                  dtypes: dict[str, str]) -> tuple[list[Place], str, list[str]]:
    """Where every TP-local parameter of every model-parallel rank lies in the saved buckets.

    Args:
        layout: the model's layout (``megatron-gpt``), for the TP-local parameters of each rank.
        tp, pp: the source's tensor- and pipeline-parallel sizes.
        buckets: the saved buckets (`buckets_of`).
        dtypes: each logical tensor's dtype in the model state (which buffer it is in).

    Returns:
        The places, the layer order that fits (a key of `LAYER_ORDERS`) and, when none fits,
        no places and the problems of each order tried.
    """
    tried: list[str] = []
    for order, names in LAYER_ORDERS.items():
        places: list[Place] = []
        problems: list[str] = []
        for g in range(tp * pp):
            specs = [s for unit in stage_units(layout, tp, g % tp, pp, g // tp) for s in _ordered(unit, names)]
            places += _group_places(g, specs, buckets, dtypes, problems)
        if not problems:
            return places, order, []
        tried += [f"{order} layer order: {p}" for p in problems[:3]]
    return [], "", tried


def _ordered(unit: list[ParamSpec], names: tuple[str, ...]) -> list[ParamSpec]:
    """A unit's parameters in registration order (a transformer layer's by `names`; others as placed)."""
    rank = {n: i for i, n in enumerate(names)}
    if not all(s.name in rank for s in unit):
        return unit
    return sorted(unit, key=lambda s: rank[s.name])


def _group_places(g: int, specs: list[ParamSpec], buckets: dict[tuple[int, int, int], Bucket], dtypes: dict[str, str],
                  problems: list[str]) -> list[Place]:
    """Lay out model-parallel rank `g`'s parameters in its buffers; append what does not fit the save."""
    mine = {key: b for key, b in buckets.items() if key[0] == g}
    gbufs = sorted({(b.gbuf, b.param_dtype) for b in mine.values()})
    by_dtype = {dtype: k for k, dtype in gbufs}
    if len(by_dtype) != len(gbufs):
        problems.append(f"dp_group_idx_{g}: two grad buffers of one parameter dtype")
        return []
    members: dict[int, list[ParamSpec]] = {k: [] for k, _ in gbufs}
    for spec in specs:
        dtype = dtypes.get(spec.parts[0].name)
        if dtype not in by_dtype:
            problems.append(f"dp_group_idx_{g}: {spec.parts[0].name} ({dtype}) is in no saved grad buffer")
            return []
        members[by_dtype[dtype]].append(spec)
    places: list[Place] = []
    for k, params in members.items():
        sizes = [mine[key] for key in sorted(key for key in mine if key[1] == k)]
        places += _fill(g, k, params, sizes, problems)
    return places


def fill_buckets(numels: Sequence[int], closes: Callable[[int, int], bool]) -> list[tuple[int, int]]:
    """Lay parameters into a grad buffer's buckets as megatron-core's ``_ParamAndGradBuffer``
    does, given in the order it fills them (the buffer's last parameter first): each start
    padded to `PARAM_ALIGN` elements within its bucket (buckets start on multiples of 128), the
    bucket closed after the parameter for which ``closes(bucket, its end in the bucket)`` holds.

    Returns:
        (bucket, start in the bucket) of each parameter, in the order given.
    """
    out = []
    bucket = pos = 0
    for numel in numels:
        start = math.ceil(pos / PARAM_ALIGN) * PARAM_ALIGN
        out.append((bucket, start))
        end = start + numel
        bucket, pos = (bucket + 1, 0) if closes(bucket, end) else (bucket, end)
    return out


def _fill(g: int, k: int, params: list[ParamSpec], saved: list[Bucket], problems: list[str]) -> list[Place]:
    """Fill grad buffer `k` as megatron-core does, each bucket closed at its saved size; append
    what does not fit the save."""
    where = f"dp_group_idx_{g}.gbuf_idx_{k}"
    order = list(reversed(params))
    placed = fill_buckets([math.prod(s.shape) for s in order], lambda b, end: b < len(saved) and end >= saved[b].numel)
    places: list[Place] = []
    for spec, (index, start) in zip(order, placed):
        end = start + math.prod(spec.shape)
        if index >= len(saved) or end > saved[index].numel:
            problems.append(f"{where}: {spec.parts[0].name} would end at {end} in bucket {index}, past the "
                            + (f"bucket's {saved[index].numel} elements" if index < len(saved) else f"{len(saved)} saved bucket(s)"))
            return places
        bucket = saved[index]
        missing = sorted(c for c in (start, end) if c < bucket.numel and c not in bucket.cuts)
        if missing:
            problems.append(f"{where}.bucket_idx_{index}: {spec.parts[0].name} would lie at [{start}, {end}), but no "
                            f"saved chunk starts at {missing[0]}")
        places.append(Place(g, bucket, start, spec))
    filled = placed[-1][0] + 1 if placed else 0
    if filled != len(saved):
        problems.append(f"{where}: its parameters fill {filled} of its {len(saved)} saved bucket(s)")
    return places


__all__ = ["BUCKET", "GROUP_VALUE", "LAYER_ORDERS", "PARAM_ALIGN", "STATES", "Bucket", "Place", "bucket_places", "buckets_of",
           "fill_buckets"]
