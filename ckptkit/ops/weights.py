"""Load a model's parameters alone (a weights-only start), under the target model's names.

A checkpoint's parameters may be named by another layout than the model loading them: a
Hugging Face Llama converted by ``ckptkit convert`` (layout ``hf-llama``) holds
``model/model.layers.0.self_attn.q_proj.weight`` where the reference trainer (layout ``llama``)
has ``model/layers.0.attn.q.weight``. The names are mapped through the canonical model both
layouts are views of (``models.compose``), where each of the loading model's tensors is one of
the checkpoint's, renamed; the bytes are then read by the ordinary load, each rank reading only
its own boxes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import LayoutError, summarize
from ..layouts import Layout, layout_for
from ..models.compose import compose, placed
from ..models.reference import model_of
from ..manifest import Manifest
from ..state.sharded import ShardedTensor
from ..state.torch_io import leaf_shards, torch_dtype
from ..state.tree import escape
from ..storage import Storage
from .load import Checkpoint, open

# The most bytes held in buffers of the saved dtype before they are cast into the parameters
# (once a tensor takes it past, the ones gathered so far are loaded and cast).
STAGED_BYTES = 1 << 30

def weight_names(source: Layout, target: Layout) -> dict[str, str]:
    """Map every tensor of the `target` layout to its name in the `source` layout (pure): the
    same name in the same layout; else, both being views of the target's canonical model, the
    source tensor each target tensor is, renamed.

    Raises:
        LayoutError: a layout that is no tool's view of a canonical model, or a target tensor
            that is not one whole source tensor (the views fuse it otherwise).
    """
    if source.name == target.name:
        return {name: name for name in target.tensors()}
    try:
        spec, mine = model_of(target)
        _, theirs = model_of(source)
        runs = compose(spec, theirs, mine)
        rows = placed(spec, theirs).shapes
    except LayoutError as e:
        raise LayoutError(f"no name map from the layout {source.name!r} to {target.name!r}: {e}") from None
    fused = sorted(name for name, rs in runs.items()
                   if len(rs) != 1 or rs[0].src_row or rs[0].count != (rows[rs[0].fqn] or (1,))[0])
    if fused:
        raise LayoutError(f"no name map from the layout {source.name!r} to {target.name!r}: {len(fused)} tensor(s) are fused or "
                          "cut otherwise there, which a weights-only start does not do: " + summarize(fused))
    return {name: rs[0].fqn for name, rs in runs.items()}


def load_weights(
    path: str | os.PathLike[str], params: Mapping[str, Any], *, layout: Layout | None = None, storage: Storage | None = None
) -> Checkpoint:
    """Fill the model parameters `params` in place from the checkpoint at `path`, reading nothing else.

    `params` maps parameter names (as saved under ``model/``) to tensors, ``ShardedTensor``\\ s or
    lists of them, as in ``ckptkit.load``'s target: each receives its box, whatever topology
    wrote the checkpoint (load-time resharding). With `layout` (the loading model's), the
    names are that layout's: the checkpoint's model (its recorded layout, or its
    ``info.model``) must be the same model, every tensor of the same shape, none left over,
    its names mapped when its layout is another (``hf-llama`` into ``llama``). A float
    tensor saved in another float dtype (bf16 weights into fp32 buffers) is read into a buffer
    of its saved dtype on the parameter's device, then cast; such buffers hold at most about
    STAGED_BYTES (1 GiB) at a time.
    Collective use: every rank calls it with its own boxes.

    Returns:
        The opened checkpoint (its manifest says what was loaded: ``checkpoint_id``, ``step``).

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        LayoutError: the checkpoint's model is not `layout`'s (all differences listed), or a
            parameter is not in the checkpoint.
        IntegrityError: payload files disagree with the manifest.
    """
    checkpoint = open(path, storage=storage)
    manifest = checkpoint.manifest
    names = {name: name for name in params}
    if layout is not None:
        where = str(checkpoint.location)
        names = weight_names(layout_for(manifest, where=where), layout)
        _check_model(manifest, layout, names, where)
        stray = sorted(name for name in params if name not in names)
        if stray:
            raise LayoutError(f"{len(stray)} parameter(s) are not tensors of the layout {layout.name!r}: " + summarize(stray))
    target: dict[str, list[ShardedTensor]] = {}
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged = 0  # bytes of the buffers in `casts`
    for name, leaf in params.items():
        entry = manifest.tensors.get(f"model/{escape(names[name])}")
        saved = torch_dtype(entry.dtype) if entry is not None else None
        held = len(casts)
        target[names[name]] = [_staged(box, saved, casts) for box in leaf_shards(leaf)]
        staged += sum(buf.numel() * buf.element_size() for buf, _ in casts[held:])
        if staged >= STAGED_BYTES:
            _load_cast(checkpoint, target, casts)
            target, casts, staged = {}, [], 0
    _load_cast(checkpoint, target, casts)
    return checkpoint


def _staged(box: ShardedTensor, saved: torch.dtype | None, casts: list[tuple[torch.Tensor, torch.Tensor]]) -> ShardedTensor:
    """The box itself, or a buffer in the saved float dtype, on the box's device, to cast from
    after the load."""
    if saved is None or saved == box.local.dtype or not (saved.is_floating_point and box.local.dtype.is_floating_point):
        return box
    staged = torch.empty(tuple(box.local.shape), dtype=saved, device=box.local.device)
    casts.append((staged, box.local))
    return ShardedTensor(staged, box.global_shape, box.global_offsets)


def _load_cast(checkpoint: Checkpoint, target: dict[str, list[ShardedTensor]], casts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Load `target`'s boxes, then cast the staged ones into their parameters."""
    if not target:
        return
    checkpoint.load({"model": target})
    with torch.no_grad():  # a parameter is a leaf that requires grad
        for staged, dest in casts:
            dest.copy_(staged)


def _check_model(manifest: Manifest, layout: Layout, names: Mapping[str, str], where: str) -> None:
    """Refuse, listing every difference, a checkpoint whose model is not `layout`'s."""
    problems = []
    shapes = layout.tensors()
    for name, src in names.items():
        entry = manifest.tensors.get(f"model/{escape(src)}")
        if entry is None:
            problems.append(f"model/{src}: not in the checkpoint")
        elif entry.shape != shapes[name]:
            problems.append(f"model/{src}: shape {list(entry.shape)}, the model's {name} is {list(shapes[name])}")
    used = {f"model/{escape(src)}" for src in names.values()}
    extra = sorted(fqn for fqn, t in manifest.tensors.items() if t.kind == "param" and fqn.startswith("model/") and fqn not in used)
    problems += [f"{fqn}: the model has no such parameter" for fqn in extra]
    if problems:
        raise LayoutError(f"{where}: its model is not the one loading it ({layout.name}): {len(problems)} difference(s): "
                          + summarize(problems))
