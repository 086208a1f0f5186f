"""The PEFT adapter: a ``peft`` adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``: LoRA and the other methods peft saves) read (``reader``) and written
back (``writer``), tensor for tensor under peft's own names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptkit.adapters import Adapter, lazy
from ckptkit.exports.formats import ExportFormat, ExportOptions

if TYPE_CHECKING:
    from ckptkit.exports.source import Source, Writer


def _writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    from ckptkit_adapters.peft.writer import peft_writer

    return peft_writer(source), None


ADAPTER = Adapter(
    name="peft", description="peft adapter folders (adapter_config.json, adapter_model.safetensors)", converter=lazy("ckptkit_adapters.peft.reader:CONVERTER"),
    formats=(ExportFormat("peft", "a peft adapter folder (PeftModel.from_pretrained), from a checkpoint converted from one",
                          _writer, dtypes=(), optimizer="never",
                          saved_dtype="a peft adapter folder keeps the adapter's weights in their saved dtype"),),
)
