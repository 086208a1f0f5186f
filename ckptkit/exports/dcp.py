"""Export to a torch.distributed.checkpoint (DCP) directory: the plain form, which ``dcp.load`` reads into a plain state dict.

The FSDP2 form (what ``get_state_dict`` of an FSDP2 model gives) is ``fsdp2``; both save through
`save_dcp`. Keys of the plain form are the checkpoint's tensor names with ``/`` read as DCP's ``.`` (``model.layers.0.attn.q.weight``,
``optimizer.exp_avg.layers.0.attn.q.weight``), as DCP names a nested state dict. torch's own
FileSystemWriter writes the files; the state dict handed to it holds meta tensors only, and
the planner reads each tensor from the checkpoint when the writer asks for it, so tensors
stream one at a time.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .convert import output_dtype
from ..io.checksum import Hasher
from ..errors import CkptkitError, LayoutError, StorageError, summarize
from .source import (
    ExportedFile,
    ExportedTensor,
    Source,
    Writer,
    Written,
    exported,
)
from ..storage import Storage, local_path
from ..state.torch_io import byte_view, torch_dtype

READ_PIECE = 8 << 20


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
        return save_dcp(state, _StreamingPlanner(source, keys, out_dtype, report), report, dst, tmp, skipped)

    return write


def write_dcp(state: dict[str, Any], planner: DefaultSavePlanner, dst: Storage, tmp: str) -> dict[tuple[str, tuple[int, ...]], str]:
    """Save `state` with torch's DCP writer in this process through `planner` under `tmp`;
    return the file each stored item went to, by (key, chunk offsets)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    writer = FileSystemWriter(local_path(dst, tmp, "a DCP export"), thread_count=1, sync_files=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            metadata = save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as exc:  # DCP wraps what its writer or our planner raised
            raise unwrapped(exc) from exc
    return {(index.fqn, tuple(index.offset or ())): info.relative_path for index, info in metadata.storage_data.items()}


def save_dcp(state: dict[str, Any], planner: DefaultSavePlanner, report: list[ExportedTensor], dst: Storage, tmp: str,
             skipped: list[str]) -> Written:
    """Save `state` (whole tensors, one item each) with `write_dcp` through `planner` (which
    fills `report` as it resolves tensors); return what was written."""
    where = {key: path for (key, _), path in write_dcp(state, planner, dst, tmp).items()}
    tensors = sorted((t.model_copy(update={"file": where[t.name]}) for t in report), key=lambda t: t.name)
    files = [file_entry(dst, tmp, key) for key in sorted(dst.list(tmp))]
    return Written(tensors, files, skipped)


class _StreamingPlanner(DefaultSavePlanner):
    """DCP's default save planner, except that each tensor is read from the checkpoint (and
    converted) only when the writer resolves it."""

    def __init__(self, source: Source, keys: dict[str, str], out_dtype: str | None, report: list[ExportedTensor]) -> None:
        super().__init__()
        self.source = source
        self.keys = keys
        self.out_dtype = out_dtype
        self.report = report

    def resolve_data(self, write_item: Any) -> Any:
        key = write_item.index.fqn
        fqn = self.keys.get(key)
        if fqn is None:
            return super().resolve_data(write_item)
        entry = self.source.manifest.tensors[fqn]
        out_dtype = output_dtype(entry.dtype, self.out_dtype)
        saved = self.source.read(fqn)
        tensor = torch.from_numpy(saved).view(torch_dtype(entry.dtype)).reshape(entry.shape)
        out = tensor.to(torch_dtype(out_dtype)).contiguous()  # torch's own rounding, any float dtype
        self.report.append(exported(self.source, key, fqn, byte_view(out), out_dtype, ""))
        return out


def unwrapped(exc: Any) -> Exception:
    """The ckptkit error a DCP ``CheckpointException`` carries, or a StorageError that names it."""
    failures = list(getattr(exc, "failures", {}).values())
    inner = failures[0] if failures else None
    while inner is not None and not isinstance(inner, BaseException):  # DCP keeps (exception, traceback) pairs
        inner = inner[0] if isinstance(inner, tuple) and inner else None
    if isinstance(inner, CkptkitError):
        return inner
    return StorageError(f"torch.distributed.checkpoint could not write the export: {inner or exc}")


def file_entry(dst: Storage, tmp: str, key: str) -> ExportedFile:
    """Hash a file the DCP writer wrote, reading it back in pieces."""
    size = dst.size(key)
    hasher = Hasher()
    for offset in range(0, size, READ_PIECE):
        hasher.update(dst.read(key, offset, min(READ_PIECE, size - offset)))
    return ExportedFile(path=key[len(tmp) + 1 :], size=size, checksum=hasher.digest())
