"""The zarr adapter: the topology-free form written (``writer``: every tensor a zarr v3 array, by tensorstore)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptkit.adapters import Adapter
from ckptkit.exports.formats import ExportFormat, ExportOptions

if TYPE_CHECKING:
    from ckptkit.exports.source import Source, Writer


def _writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    from ckptkit_adapters.zarr.writer import zarr_writer

    return zarr_writer(source, options.chunk_bytes), None


ADAPTER = Adapter(
    name="zarr", description="zarr v3 arrays (the topology-free form)",
    formats=(ExportFormat("zarr", "the topology-free form", _writer, dtypes=(), optimizer="always", holds=("*",),
                          saved_dtype="the zarr form keeps every tensor in its saved dtype"),),
)
