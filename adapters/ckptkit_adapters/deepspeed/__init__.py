"""The DeepSpeed adapter: ZeRO saves read (``reader``, with ``tp``: model-parallel ranks joined through
a layout) and the universal checkpoint written (``writer``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptkit.adapters import Adapter, lazy
from ckptkit.exports.formats import ExportFormat, ExportOptions

if TYPE_CHECKING:
    from ckptkit.exports.source import Source, Writer


def _writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    from ckptkit_adapters.deepspeed.writer import deepspeed_writer

    return deepspeed_writer(source), None


ADAPTER = Adapter(
    name="deepspeed", description="DeepSpeed ZeRO checkpoints (read) and universal checkpoints (written)", converter=lazy("ckptkit_adapters.deepspeed.reader:CONVERTER"),
    formats=(ExportFormat("deepspeed", "a DeepSpeed universal checkpoint (load_universal): a converted DeepSpeed save, or a model whose modules are known, with its AdamW state",
                          _writer, dtypes=(), optimizer="always",
                          saved_dtype="the deepspeed format keeps the fp32 masters and moments, and the module in its saved dtype"),),
)
