"""The torch DCP adapter: DCP saves read (``reader``; ``HuggingFaceStorageWriter`` saves by
``hf_storage``) and written (``writer``: the plain form under the checkpoint's names; ``fsdp2``: the
state dict an FSDP2 job of the model resumes from, under its modules' names). The DCP container
itself is read and written by ``ckptkit_adapters.common.dcp_read`` and ``dcp_write``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptkit.adapters import Adapter, lazy
from ckptkit.errors import LayoutError
from ckptkit.exports.formats import ExportFormat, ExportOptions

if TYPE_CHECKING:
    from ckptkit.exports.source import Source, Writer
    from ckptkit.manifest import Manifest


def _writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    from ckptkit.layouts import layout_for

    where = str(source.loc)
    form = options.form or _default_form(source.manifest, where)
    if form == "plain":
        from ckptkit_adapters.dcp.writer import dcp_writer

        return dcp_writer(source, options.dtype, options.include_optimizer), form
    from ckptkit_adapters.dcp.fsdp2 import fsdp2_writer

    try:
        model = layout_for(source.manifest, where=where)
    except LayoutError:
        raise LayoutError(f"{where}: the fsdp2 form names the parameters as the reference trainer's model (layout llama) "
                          "or a Hugging Face model does, and the checkpoint names no model; export with --dcp-form plain "
                          "(the checkpoint's own names)") from None
    return fsdp2_writer(source, model, options.dtype, options.include_optimizer), form


def _default_form(manifest: Manifest, where: str) -> str:
    """The dcp form a checkpoint exports to by default: ``fsdp2`` for the reference trainer's
    model (the module names that form knows), ``plain`` for any other."""
    from ckptkit.layouts import layout_for

    try:
        return "fsdp2" if layout_for(manifest, where=where).name == "llama" else "plain"
    except LayoutError:
        return "plain"


ADAPTER = Adapter(
    name="dcp", description="torch.distributed.checkpoint (FSDP2, DTensor, no_dist saves)", converter=lazy("ckptkit_adapters.dcp.reader:CONVERTER"),
    formats=(ExportFormat("dcp", "torch.distributed.checkpoint", _writer, forms=("fsdp2", "plain"),
                          form_holds=(("plain", ("*",)),)),),
)
