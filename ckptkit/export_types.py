"""What every export format shares: the source being read, the export report, dtype conversion."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict

from .catalog import Location
from .checksum import checksum_of
from .loader import Headers, read_tensor
from .manifest import Manifest, Topology
from .storage import Storage
from .torch_io import byte_view, torch_dtype

REPORT_NAME = "export_report.json"


@dataclass
class Source:
    """The checkpoint being exported: its location, checked manifest and a cache of its headers."""

    loc: Location
    manifest: Manifest
    headers: Headers = field(default_factory=dict)

    def read(self, fqn: str) -> torch.Tensor:
        """Return tensor `fqn` whole, read from whatever shards hold it."""
        return read_tensor(self.loc, self.manifest, fqn, self.headers)


class ExportedTensor(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    source: str
    shape: list[int]
    source_dtype: str
    dtype: str
    file: str
    checksum: str


class ExportedFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    size: int
    checksum: str


class ExportReport(BaseModel):
    """What ``ckptkit export --json`` prints, also written as ``export_report.json`` in DST."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: str
    dtype: str
    source: str
    source_checkpoint_id: str
    step: int
    source_topology: Topology
    destination: str
    tensors: list[ExportedTensor]
    files: list[ExportedFile]
    skipped: list[str]


@dataclass
class Written:
    """What a format's writer wrote: the report's tensors and files, the tensors left out, and
    what to do once the report is written (the zarr form writes its manifest last)."""

    tensors: list[ExportedTensor]
    files: list[ExportedFile]
    skipped: list[str]
    finish: Callable[[ExportedFile], None] | None = None


# A format's writer: (source, destination storage, temporary name) -> what it wrote.
Writer = Callable[[Source, Storage, str], Written]


def report_bytes(report: ExportReport) -> bytes:
    return report.model_dump_json(indent=2).encode()


def convert(tensor: torch.Tensor, dtype: str | None) -> torch.Tensor:
    """Return `tensor` contiguous in manifest dtype `dtype` (round to nearest even; None keeps it)."""
    if dtype is not None and tensor.dtype != torch_dtype(dtype):
        tensor = tensor.to(torch_dtype(dtype))
    return tensor.contiguous()


def exported(name: str, fqn: str, source_dtype: str, out: torch.Tensor, dtype: str, file: str) -> ExportedTensor:
    """The report line of tensor `fqn` exported as `name` (contiguous `out`, manifest dtype `dtype`) in `file`."""
    return ExportedTensor(name=name, source=fqn, shape=list(out.shape), source_dtype=source_dtype, dtype=dtype,
                          file=file, checksum=checksum_of(byte_view(out)))
