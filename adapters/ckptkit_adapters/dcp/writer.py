"""Export to a torch.distributed.checkpoint (DCP) directory: the plain form, which ``dcp.load`` reads into a plain state dict.

The FSDP2 form (what ``get_state_dict`` of an FSDP2 model gives) is ``fsdp2``; both save through
`save_dcp`. Keys of the plain form are the checkpoint's tensor names with ``/`` read as DCP's ``.`` (``model.layers.0.attn.q.weight``,
``optimizer.exp_avg.layers.0.attn.q.weight``), as DCP names a nested state dict. torch's own
FileSystemWriter writes the files; the state dict handed to it holds meta tensors only, and
the planner reads each tensor from the checkpoint when the writer asks for it, so tensors
stream one at a time.
"""

from __future__ import annotations

import torch

from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.convert import output_dtype
from ckptkit.exports.source import (
    ExportedTensor,
    Source,
    Writer,
    Written,
)
from ckptkit.state.torch_io import torch_dtype
from ckptkit.storage import Storage
from ckptkit_adapters.common.dcp_write import StreamingPlanner, save_dcp


def dcp_writer(source: Source, out_dtype: str | None, include_optimizer: bool) -> Writer:
    """Plan the DCP export (failing before any write) and return its writer.

    Raises:
        LayoutError: no parameters to export, or two tensor names that DCP would name alike.
    """
    manifest = source.manifest
    kinds = ("param", "optimizer") if include_optimizer else ("param",)
    chosen = sorted(fqn for fqn, t in manifest.tensors.items() if t.kind in kinds)
    if not chosen:
        raise LayoutError(f"{source.loc}: the checkpoint holds no tensors of kind {' or '.join(kinds)}")
    keys: dict[str, str] = {}
    clashes = []
    for fqn in chosen:
        key = fqn.replace("/", ".")
        if key in keys:
            clashes.append(f"{keys[key]!r} and {fqn!r} are both {key!r}")
        keys[key] = fqn
    if clashes:
        raise LayoutError("tensor names collide as DCP keys: " + summarize(clashes))
    skipped = sorted(set(manifest.tensors) - set(chosen))

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        report: list[ExportedTensor] = []
        state = {}
        for key, fqn in keys.items():
            entry = manifest.tensors[fqn]
            state[key] = torch.empty(entry.shape, dtype=torch_dtype(output_dtype(entry.dtype, out_dtype)), device="meta")
        source.expect(keys.values())
        return save_dcp(state, StreamingPlanner(source, keys, out_dtype, report), report, dst, tmp, skipped)

    return write


