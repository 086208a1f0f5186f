"""The torch DCP container written: a state of meta tensors saved by torch's own DCP writer, each tensor's
bytes read from the checkpoint only when the writer asks for it (`StreamingPlanner`; `StackingPlanner` for a
tensor made of pieces of several), the files committed as an export's. The dcp adapter's plain and fsdp2 forms and the megatron adapter's torch_dist write through it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckptkit.boxes import Box
from ckptkit.errors import CkptkitError, StorageError
from ckptkit.exports.convert import output_dtype
from ckptkit.exports.source import (
    ExportedFile,
    ExportedTensor,
    Source,
    Written,
    exported,
)
from ckptkit.io.checksum import Hasher, checksum_of
from ckptkit.state.torch_io import byte_view, torch_dtype
from ckptkit.storage import Storage, local_path

READ_PIECE = 8 << 20


def write_dcp(state: dict[str, Any], planner: DefaultSavePlanner, dst: Storage, tmp: str) -> dict[tuple[str, tuple[int, ...]], str]:
    """Save `state` with torch's DCP writer in this process through `planner` under `tmp`;
    return the file each stored item went to, by (key, chunk offsets)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    class Writer(FileSystemWriter):
        def storage_meta(self) -> None:
            return None  # not the temporary path and a random save id: the same export gives the same bytes

    writer = Writer(local_path(dst, tmp, "a DCP export"), thread_count=1, sync_files=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            metadata = save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as exc:  # DCP wraps what its writer or our planner raised
            raise unwrapped(exc) from exc
    return {(index.fqn, tuple(index.offset or ())): info.relative_path for index, info in metadata.storage_data.items()}


def save_dcp(state: dict[str, Any], planner: DefaultSavePlanner, report: list[ExportedTensor], dst: Storage, tmp: str) -> Written:
    """Save `state` (whole tensors, one item each) with `write_dcp` through `planner` (which
    fills `report` as it resolves tensors); return what was written."""
    where = {key: path for (key, _), path in write_dcp(state, planner, dst, tmp).items()}
    tensors = sorted((t.model_copy(update={"file": where[t.name]}) for t in report), key=lambda t: t.name)
    files = [file_entry(dst, tmp, key) for key in sorted(dst.list(tmp))]
    return Written(tensors, files)


class StreamingPlanner(DefaultSavePlanner):
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


@dataclass(frozen=True, slots=True)
class Stacked:
    """A DCP tensor made of boxes of source tensors stacked along `dim`, in order."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    dim: int
    pieces: tuple[tuple[str, Box], ...]


class StackingPlanner(DefaultSavePlanner):
    """DCP's default save planner, except that each stacked tensor is read from the checkpoint
    (its pieces, by `Source.read_pieces`, converted) only when the writer resolves it."""

    def __init__(self, source: Source, tensors: tuple[Stacked, ...], report: list[ExportedTensor]) -> None:
        super().__init__()
        self.source = source
        self.tensors = {t.key: t for t in tensors}
        self.report = report

    def resolve_data(self, write_item: Any) -> Any:
        stacked = self.tensors.get(write_item.index.fqn)
        if stacked is None:  # a step or a parameter group's value
            return super().resolve_data(write_item)
        saved = self.source.manifest.tensors[stacked.pieces[0][0]].dtype
        parts = [as_tensor(p, saved) for p in self.source.read_pieces(stacked.pieces)]
        joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=stacked.dim)
        out = joined.reshape(stacked.shape).to(torch_dtype(stacked.dtype)).contiguous()  # torch's own rounding, any float dtype
        self.report.append(ExportedTensor(
            name=stacked.key, source=" + ".join(dict.fromkeys(name for name, _ in stacked.pieces)), shape=list(stacked.shape),
            source_dtype=saved, dtype=stacked.dtype, file="", checksum=checksum_of(byte_view(out))))
        return out



def as_tensor(piece: Any, dtype: str) -> torch.Tensor:
    """A piece `Source.read_pieces` gives (its box's shape, the element's bytes last) as a tensor of `dtype`."""
    return torch.from_numpy(np.ascontiguousarray(piece)).view(torch_dtype(dtype)).squeeze(-1)


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
