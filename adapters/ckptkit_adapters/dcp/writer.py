"""Export to a torch.distributed.checkpoint (DCP) directory: the plain form, which ``dcp.load`` reads into a plain state dict.

The FSDP2 form (what ``get_state_dict`` of an FSDP2 model gives) is ``fsdp2``; both save through
`save_dcp`. Keys of the plain form are the checkpoint's names with ``/`` read as DCP's ``.`` (``model.layers.0.attn.q.weight``,
``optimizer.exp_avg.layers.0.attn.q.weight``, ``optim.param_groups.0.lr``), as DCP names a nested state dict: a
checkpoint converted from DCP goes back under the keys it came from, its values too, so that the job that saved it
loads it again. torch's own
FileSystemWriter writes the files; the state dict handed to it holds meta tensors only, and
the planner reads each tensor from the checkpoint when the writer asks for it, so tensors
stream one at a time.
"""

from __future__ import annotations

from typing import Any

import torch

from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.convert import output_dtype
from ckptkit.exports.source import (
    OPTIMIZER_PARTS,
    ExportedTensor,
    Source,
    Writer,
    Written,
)
from ckptkit.state.torch_io import torch_dtype
from ckptkit.state.tree import from_json
from ckptkit.storage import Storage
from ckptkit_adapters.common.dcp_read import dcp_key
from ckptkit_adapters.common.dcp_write import StreamingPlanner, save_dcp




def dcp_writer(source: Source, out_dtype: str | None, include_optimizer: bool) -> Writer:
    """Plan the DCP export (failing before any write) and return its writer: every tensor and
    every value of the checkpoint under its DCP key (`dcp_key`, the inverse of the names the dcp
    converter gives), but the optimizer's (tensors of kind ``optimizer``, values under ``optim``
    or ``optimizer``) unless `include_optimizer`; values as DCP keeps them (pickled bytes).

    Raises:
        LayoutError: no parameters to export, or two names that DCP would name alike.
    """
    manifest = source.manifest
    chosen = sorted(fqn for fqn, t in manifest.tensors.items() if include_optimizer or t.kind != "optimizer")
    values = sorted(name for name in manifest.objects if include_optimizer or name.split("/")[0] not in OPTIMIZER_PARTS)
    if not any(manifest.tensors[fqn].kind == "param" for fqn in chosen):
        raise LayoutError(f"{source.loc}: the checkpoint holds no tensors of kind param")
    keys: dict[str, str] = {}
    clashes = []
    for fqn in [*chosen, *values]:
        key = dcp_key(fqn)
        if key in keys:
            clashes.append(f"{keys[key]!r} and {fqn!r} are both {key!r}")
        keys[key] = fqn
    if clashes:
        raise LayoutError("names collide as DCP keys: " + summarize(clashes))
    tensor_keys = {key: fqn for key, fqn in keys.items() if fqn in manifest.tensors}
    skipped = sorted(set(manifest.tensors) - set(chosen))

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        report: list[ExportedTensor] = []
        state: dict[str, Any] = {}
        for key, fqn in tensor_keys.items():
            entry = manifest.tensors[fqn]
            state[key] = torch.empty(entry.shape, dtype=torch_dtype(output_dtype(entry.dtype, out_dtype)), device="meta")
        state.update({dcp_key(name): from_json(manifest.objects[name]) for name in values})  # bytes as bytes again
        source.expect(tensor_keys.values())
        return save_dcp(state, StreamingPlanner(source, tensor_keys, out_dtype, report), report, dst, tmp)

    return Writer(skipped, write, frozenset(values))
