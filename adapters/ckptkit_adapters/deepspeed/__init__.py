"""The DeepSpeed adapter: ZeRO saves read (``reader``, with ``tp``: model-parallel ranks joined through
a layout) and the universal checkpoint written (``writer``), or ZeRO-3's own per-rank files (``zero3``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptkit.adapters import Adapter, lazy
from ckptkit.exports.formats import ExportFormat, ExportOptions

if TYPE_CHECKING:
    from ckptkit.exports.source import Source, Writer


def _writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    if options.dp is not None:  # ZeRO-3's own per-rank files
        from ckptkit_adapters.deepspeed.zero3 import zero3_writer

        return zero3_writer(source, options.dp), "zero3"
    from ckptkit_adapters.deepspeed.writer import deepspeed_writer

    return deepspeed_writer(source), None


ADAPTER = Adapter(
    name="deepspeed", description="DeepSpeed ZeRO checkpoints (read) and universal checkpoints (written)", converter=lazy("ckptkit_adapters.deepspeed.reader:CONVERTER"),
    formats=(ExportFormat("deepspeed", "a DeepSpeed universal checkpoint (load_universal): a converted DeepSpeed save, or a model whose modules are known, with its AdamW state; "
                          "with --dp N, a ZeRO-3 save's own files for N ranks",
                          _writer, dtypes=(), optimizer="always", dp=True,
                          saved_dtype="the deepspeed format keeps the fp32 masters and moments, and the module in its saved dtype"),),
)
