"""The Megatron adapter: Megatron-Core ``torch_dist`` saves and legacy Megatron-LM ones read
(``reader``, ``legacy*``, the distributed optimizer's buckets by ``buckets`` and ``optimizer``),
``torch_dist`` written (``writer``, ``writer_optimizer``), Megatron-Core's ``GPTModel`` as a view of a
canonical model (``view``), its layout (``layout``, the ``megatron-gpt`` family) and its module
names beyond the view (``names``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ckptkit.adapters import Adapter, Family, lazy
from ckptkit.exports.formats import ExportFormat, ExportOptions

if TYPE_CHECKING:
    from ckptkit.exports.source import Source, Writer
    from ckptkit.layouts.model import Layout
    from ckptkit.models.spec import ModelSpec
    from ckptkit.models.view import View


def _writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    from ckptkit.layouts import layout_for
    from ckptkit_adapters.megatron.writer import megatron_writer

    layout = options.layout or layout_for(source.manifest, where=str(source.loc))
    return megatron_writer(source, options.dtype, options.include_optimizer, layout, options.tp, options.pp, options.ep), None


def _layout(config: Mapping[str, Any]) -> Layout:
    from ckptkit_adapters.megatron.layout import megatron_gpt

    return megatron_gpt(config)


def _model(layout: Layout, carried: Mapping[str, Any] | None) -> tuple[ModelSpec, View]:
    from ckptkit_adapters.megatron.view import megatron_model

    return megatron_model(layout.config)


ADAPTER = Adapter(
    name="megatron", description="Megatron-Core dist_checkpointing and Megatron-LM checkpoints", converter=lazy("ckptkit_adapters.megatron.reader:CONVERTER"),
    formats=(ExportFormat("megatron", "a Megatron-Core dist_checkpointing (torch_dist) directory", _writer, layout=True,
                          pieces=True),),
    families=(Family("megatron-gpt", layout=_layout,
                     model=_model),),
)
