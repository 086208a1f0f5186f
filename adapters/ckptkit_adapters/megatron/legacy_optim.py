"""Which optimizer state of a legacy Megatron-LM rank file belongs to which parameter, by
Megatron's own rules (pure: names, shapes and numbers in, a mapping out).

The plain optimizer (``FP32Optimizer``; ``model_optim_rng.pt``'s ``optimizer``) is a torch
optimizer's state dict: its state is keyed by integer ids, numbered over the parameter groups
in order and within a group in the group's order. Megatron-Core's ``_get_param_groups`` puts a
stage's parameters (``named_parameters`` order) in groups by their overrides; by default the
only one is ``wd_mult=0`` for 1-D parameters and ``*.bias`` (the q/k layernorms excepted with
``--apply-wd-to-qk-layernorm``). `plain_ids` rebuilds the id -> parameter map from each group's
``wd_mult`` and checks it against the group sizes.

The distributed optimizer's ``distrib_optim.pt`` holds, per grad buffer, the flat fp32 master
and moments of the buffer gathered over DP with the padding after each bucket stripped.
`buffer_ranges` lays the parameters out as ``DistributedOptimizer._compute_per_buffer_param_layout``
does (buffers by dtype, parameters in reverse order, each start aligned to 64 elements, a
bucket closed once it reaches the bucket size: `buckets.fill_buckets`, shared with the
torch_dist ``dp_reshardable`` form).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit_adapters.megatron.buckets import fill_buckets

DEFAULT_BUCKET = 40_000_000  # resolve_ddp_bucket_size without --ddp-bucket-size: max(40M, 1M x DP)


@dataclass(frozen=True)
class Local:
    """A parameter as a stage holds it: its key in the stage's state dict, shape and dtype."""

    key: str
    shape: tuple[int, ...]
    dtype: str


def _no_weight_decay(key: str, shape: tuple[int, ...], qk_decay: bool) -> bool:
    skip = len(shape) == 1 or key.endswith(".bias")
    return skip and not (qk_decay and ("q_layernorm." in key or "k_layernorm." in key))


def plain_ids(params: Sequence[Local], groups: Any, args: Mapping[str, Any], where: str) -> dict[int, Local]:
    """The parameter each optimizer state id of a stage stands for.

    Raises:
        ManifestError: groups formed by overrides other than the default weight-decay skip
            (decoupled learning rates, per-layer overrides: named), or groups that do not
            match the stage's parameters.
    """
    if args.get("decoupled_lr") is not None:
        raise ManifestError(f"{where}: parameter groups with a decoupled learning rate (--decoupled-lr), whose optimizer "
                            f"ids this converter cannot assign to parameters")
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise IntegrityError(f"{where}: the optimizer's param_groups are not a list of groups with params")
    qk_decay = bool(args.get("apply_wd_to_qk_layernorm"))
    classes = []
    for i, g in enumerate(groups):
        if g.get("wd_mult") not in (0.0, 1.0) or g.get("lr_mult", 1.0) != 1.0 or g.get("is_decoupled_lr") or g.get("is_expert_parallel"):
            raise ManifestError(f"{where}: parameter group {i} has overrides (wd_mult {g.get('wd_mult')}, lr_mult "
                                f"{g.get('lr_mult')}) other than Megatron's default weight-decay skip; its ids cannot be "
                                f"assigned to parameters")
        classes.append(g["wd_mult"] == 0.0)
    if len(set(classes)) != len(classes):
        raise ManifestError(f"{where}: two parameter groups of the same kind; their ids cannot be assigned to parameters")
    out: dict[int, Local] = {}
    for g, no_wd in zip(groups, classes):
        members = [p for p in params if _no_weight_decay(p.key, p.shape, qk_decay) == no_wd]
        if len(members) != len(g["params"]):
            raise IntegrityError(f"{where}: a parameter group of {len(g['params'])} ids, but the stage has {len(members)} "
                                 f"parameters {'without' if no_wd else 'with'} weight decay")
        for pid, p in zip(g["params"], members):
            if not isinstance(pid, int) or pid in out:
                raise IntegrityError(f"{where}: parameter id {pid!r} is not a fresh integer")
            out[pid] = p
    if len(out) != len(params):
        raise IntegrityError(f"{where}: the parameter groups hold {len(out)} parameters, the stage {len(params)}")
    return out


@dataclass(frozen=True)
class Buffer:
    """One grad buffer of a stage: its dtypes, the flat range of each parameter in its
    gathered (bucket-padding stripped) tensors, and their length."""

    param_dtype: str
    grad_dtype: str
    ranges: dict[str, tuple[int, int]]  # key -> (start, numel)
    numel_unpadded: int


def bucket_size(args: Mapping[str, Any], pp_rank: int, where: str) -> int | None:
    """The bucket size a stage's grad buffers were cut with (None: one bucket), as Megatron-LM's
    ``get_model`` resolves it.

    Raises:
        ManifestError: ``--ddp-num-buckets`` (the size comes from a parameter count this file
            does not record).
    """
    if args.get("ddp_num_buckets") is not None:
        raise ManifestError(f"{where}: buckets by count (--ddp-num-buckets), which this converter does not lay out")
    if not args.get("overlap_grad_reduce") or pp_rank > 0:
        return None
    size = args.get("ddp_bucket_size")
    if size is None:
        dp = int(args.get("data_parallel_size") or 1) * int(args.get("context_parallel_size") or 1)
        return max(DEFAULT_BUCKET, 1_000_000 * dp)
    return int(size)


def buffer_ranges(params: Sequence[Local], *, grad_fp32: bool, size: int | None) -> list[Buffer]:
    """Lay a stage's parameters out in its grad buffers (by parameter dtype, in order of first
    use), each bucket closed once it reaches `size` (`buckets.fill_buckets`); a
    parameter's range is in the buckets' unpadded parts put one after another (the padding of
    bucket ends, to lcm(DP, 128) in the buffer itself, is stripped from this form)."""
    by_dtype: dict[str, list[Local]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    out = []
    for dtype, members in by_dtype.items():
        order = list(reversed(members))
        placed = fill_buckets([math.prod(p.shape) for p in order], lambda _, end: size is not None and end >= size)
        ends: dict[int, int] = {}
        for p, (bucket, start) in zip(order, placed):
            ends[bucket] = start + math.prod(p.shape)
        offsets = [sum(ends[b] for b in range(bucket)) for bucket in range(len(ends) + 1)]
        ranges = {p.key: (offsets[bucket] + start, math.prod(p.shape)) for p, (bucket, start) in zip(order, placed)}
        out.append(Buffer(dtype, "float32" if grad_fp32 else dtype, ranges, offsets[-1]))
    return out


__all__ = ["Buffer", "Local", "bucket_size", "buffer_ranges", "plain_ids"]
