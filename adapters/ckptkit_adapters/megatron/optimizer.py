"""Read the distributed optimizer's ``dp_reshardable`` state of a Megatron-Core checkpoint into per-parameter tensors.

`bucket_values` reads the buckets' saved sizes (values that need torch dtypes to unpickle);
`plan_buckets` derives where each parameter lies (`buckets.bucket_places`) and adds
one tensor per parameter and state to the plan, named as the ``fully_reshardable`` form is:
``optimizer/{fp32,exp_avg,exp_avg_sq}/<Megatron key per layer>``. Each is put together from the
flat ranges of its TP-local pieces (one per TP rank; a replicated tensor from TP rank 0),
padding never read. Every fp32 master is checked against the model's own tensor (rounded to
the model's dtype, as megatron-core copies it): a layout derived wrong is refused, never written.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import numpy as np
from pydantic import JsonValue

from ckptkit.boxes import Box, tiling_problems
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout
from ckptkit.layouts.parts import Part
from ckptkit.manifest.dtypes import itemsize
from ckptkit.ops.convert import TensorSpec
from ckptkit.state.tree import escape
from ckptkit_adapters.common.dcp_metadata import DcpMetadata
from ckptkit_adapters.common.dcp_read import Assembled, Plan, Planned, assemble, entry_archive
from ckptkit_adapters.common.floats import cast_float32
from ckptkit_adapters.common.torchsave import TORCH_DTYPES, TorchDtype, stored_object
from ckptkit_adapters.megatron.buckets import GROUP_VALUE, STATES, Place, bucket_places, buckets_of

SIZES = ("per_bucket_numel", "per_bucket_numel_unpadded")
_SIZES_ALLOWED: dict[tuple[str, str], Any] = {("torch", name): TorchDtype(name) for name in TORCH_DTYPES}
VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight")  # cut over TP on dim 0, one piece a rank


def bucket_values(path: str, md: DcpMetadata, plan: Plan) -> Any:
    """Read the buckets' sizes (``dp_group_idx_<g>.per_bucket_numel[_unpadded]``, whose keys are
    torch dtypes) into objects, check them against the saved buckets, and return the
    optimizer's parameter groups (``dp_group_idx_0.optimizer``; None when absent).

    Raises:
        IntegrityError: a saved size unlike its bucket's tensor.
    """
    sizes: dict[str, Any] = {}
    for key in md.entries:
        found = GROUP_VALUE.match(key)
        if md.entries[key] is not None or found is None or found.group(2) not in SIZES:
            continue
        ref = md.storage.get((key, None))
        if ref is None:
            continue  # a problem plan_conversion has listed
        with entry_archive(path, ref, key) as archive:
            value = stored_object(archive, _SIZES_ALLOWED)
        sizes[key] = value
        name = f"megatron/{escape(key)}"
        plan.objects[name], plan.object_sources[name] = _sizes_json(value, key), key
        plan.skipped[:] = [s for s in plan.skipped if s.name != key]
    buckets, _ = buckets_of(md.entries)
    for (g, k, b), bucket in sorted(buckets.items()):
        saved = _saved_size(sizes.get(f"optimizer.distributed.dp_group_idx_{g}.per_bucket_numel_unpadded/shard_0_1"), k, b)
        if saved != bucket.numel:
            raise IntegrityError(f"{path}: bucket {bucket.prefix} holds {bucket.numel} elements, its group's "
                                 f"per_bucket_numel_unpadded says {saved}")
    groups = plan.objects.get(f"megatron/{escape('optimizer.distributed.dp_group_idx_0.optimizer/shard_0_1')}")
    if isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], dict):
        return groups[0].get("param_groups")
    return None


def _sizes_json(value: Any, key: str) -> JsonValue:
    """Saved bucket sizes ``[[{(param dtype, grad dtype): [n, ...]}, ...]]`` as JSON: per grad
    buffer, its dtypes and sizes."""
    try:
        (per_buffer,) = value
        return [[{"param_dtype": f"torch.{p.name}", "grad_dtype": f"torch.{g.name}", "numel": [int(n) for n in sizes]}
                 for (p, g), sizes in buffer.items()] for buffer in per_buffer]
    except (TypeError, ValueError, AttributeError) as exc:
        raise IntegrityError(f"{key}: not bucket sizes per grad buffer and dtype ({exc})") from None


def _saved_size(value: Any, gbuf: int, index: int) -> int | None:
    try:
        (sizes,) = value[0][gbuf].values()  # one (param dtype, grad dtype) per grad buffer
        return int(sizes[index])
    except (TypeError, ValueError, IndexError, KeyError, AttributeError):
        return None


def plan_buckets(path: str, md: DcpMetadata, plan: Plan, layout: Layout) -> None:
    """Add the per-parameter optimizer tensors of a ``dp_reshardable`` save to `plan`.

    Raises:
        ManifestError: the buckets fit no layer order of the layout (the problems named).
        IntegrityError: the pieces of a parameter do not tile it.
    """
    buckets, states = buckets_of(md.entries)
    if not buckets:
        raise ManifestError(f"{path}: the optimizer is dp_reshardable, but no bucket tensor is saved")
    groups = len({g for g, _, _ in buckets})
    tp = tensor_parallel_size(md)
    if tp is None or groups % tp:
        raise IntegrityError(f"{path}: {groups} data-parallel groups, and the vocabulary cut into {tp} TP piece(s)")
    pp = groups // tp
    model = {t.spec.name[len("model/"):]: t for t in plan.tensors if t.spec.kind == "param"}
    places, _, problems = bucket_places(layout, tp, pp, buckets, {n: t.spec.dtype for n, t in model.items()})
    if problems:
        raise ManifestError(f"{path}: the dp_reshardable buckets fit no parameter order of the {layout.name} layout at "
                            f"tp {tp} x pp {pp}: " + "; ".join(problems))
    pieces: dict[str, list[tuple[Place, Part]]] = {}
    for place in places:
        for part in place.spec.parts:
            if not (part.replicated and place.group % tp):
                pieces.setdefault(part.name, []).append((place, part))
    for name, got in pieces.items():
        if name not in model:
            raise IntegrityError(f"{path}: the optimizer holds state for {name}, which the model state lacks")
        tiling = tiling_problems(model[name].spec.shape, [Box(part.offsets, part.lengths) for _, part in got])
        if tiling:
            raise IntegrityError(f"{path}: the optimizer's pieces of {name}: {tiling[0]}")
    for state in sorted(states):
        for name, got in sorted(pieces.items()):
            first = got[0][0]
            key = f"{first.bucket.prefix}.{state}"
            entry = md.entries[key]
            assert entry is not None and entry.dtype.dtype is not None
            source = f"{key}[{first.start}:{first.start + math.prod(first.spec.shape)}]" + (
                f" and {len(got) - 1} more" if len(got) > 1 else "")
            spec = TensorSpec(name=f"optimizer/{escape(STATES.get(state, state))}/{escape(name)}", source=source,
                              dtype=entry.dtype.dtype, shape=model[name].spec.shape, kind="optimizer")
            if state == "param" and entry.dtype.dtype != "float32":
                raise IntegrityError(f"{path}: {key} holds {entry.dtype.dtype} masters; the distributed optimizer's are float32")
            check = model[name] if state == "param" else None
            chunks = sum(_chunks_met(md, f"{place.bucket.prefix}.{state}", place)
                         for place in {(p.group, p.bucket.prefix, p.start): p for p, _ in got}.values())
            plan.assembled.append(Assembled(spec, partial(_from_buckets, path, md, got, state, spec, check), chunks))


def _chunks_met(md: DcpMetadata, key: str, place: Place) -> int:
    """How many saved chunks of bucket entry `key` the parameter at `place` is read from."""
    entry = md.entries[key]
    assert entry is not None
    end = place.start + math.prod(place.spec.shape)
    return sum(1 for c in entry.chunks if c.sizes[0] and c.offsets[0] < end and c.offsets[0] + c.sizes[0] > place.start)


def tensor_parallel_size(md: DcpMetadata) -> int | None:
    """The tensor-parallel size of the save: the pieces its vocabulary-parallel embedding (or
    output layer) is cut into along the vocabulary; None without either."""
    for key in VOCAB_PARALLEL:
        meta = md.entries.get(key)
        if meta is not None and meta.shape:
            return len({c.offsets[0] for c in meta.chunks if math.prod(c.sizes)}) or None
    return None


def _from_buckets(path: str, md: DcpMetadata, got: list[tuple[Place, Part]], state: str, spec: TensorSpec,
                  model: Planned | None) -> np.ndarray[Any, Any]:
    """One parameter's `state`, from the flat bucket ranges of its TP-local pieces (each read
    once); a master is checked against the `model` tensor.

    Raises:
        IntegrityError: a chunk unreadable, or a master that does not round to the model's tensor.
    """
    width = itemsize(spec.dtype)
    buf = np.empty(math.prod(spec.shape) * width, dtype=np.uint8)
    view = buf.reshape(*spec.shape, width)
    read: dict[tuple[str, int], np.ndarray[Any, Any]] = {}
    for place, part in got:
        key = f"{place.bucket.prefix}.{state}"
        if (key, place.start) not in read:
            n = math.prod(place.spec.shape)
            entry = md.entries[key]
            assert entry is not None
            flat = TensorSpec(name=key, source=key, dtype=spec.dtype, shape=(n,), kind=spec.kind)
            read[(key, place.start)] = assemble(path, md, Planned(flat, key, entry, Box((place.start,), (n,)))).reshape(
                *place.spec.shape, width)
        view[Box(part.offsets, part.lengths).slices()] = read[(key, place.start)][part.local_box().slices()]
    if model is not None:
        want = assemble(path, md, model)
        derived = cast_float32(buf.view(np.float32), model.spec.dtype).view(np.uint8)
        if not np.array_equal(derived, want):
            raise IntegrityError(f"{path}: the fp32 master of {model.spec.name[len('model/'):]} in the dp_reshardable "
                                 f"buckets does not round to the model's tensor: the derived bucket layout does not fit "
                                 f"this save (refused rather than guessed)")
    return buf


__all__ = ["bucket_values", "plan_buckets", "tensor_parallel_size"]
