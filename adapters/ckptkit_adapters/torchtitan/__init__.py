"""The torchtitan adapter: torchtitan's checkpoints (DCP saves of its Llama 3 and Qwen3) read
(``reader``) and written (``writer``: the ``torchtitan`` export), and its models' names as views of
the canonical model (``view``: the ``torchtitan-llama`` and ``torchtitan-qwen3`` layouts), so that a
converted one reshards and exports to every target without a layout named."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ckptkit.adapters import Adapter, Family, lazy
from ckptkit.exports.formats import ExportFormat, ExportOptions

if TYPE_CHECKING:
    from ckptkit.exports.source import Source, Writer
    from ckptkit.layouts.model import Layout
    from ckptkit.models.spec import ModelSpec
    from ckptkit.models.view import View


def _layout(model_type: str) -> Callable[[Mapping[str, Any]], Layout]:
    def build(config: Mapping[str, Any]) -> Layout:
        from ckptkit_adapters.torchtitan.view import torchtitan_layout

        return torchtitan_layout({**config, "model_type": model_type})

    return build


def _writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    from ckptkit_adapters.torchtitan.writer import torchtitan_writer

    return torchtitan_writer(source, options.dtype, options.include_optimizer), None


def _model(layout: Layout, carried: Mapping[str, Any] | None) -> tuple[ModelSpec, View]:
    from ckptkit_adapters.torchtitan.view import torchtitan_model

    return torchtitan_model(layout)


ADAPTER = Adapter(name="torchtitan", description="torchtitan checkpoints (DCP saves of its Llama 3 and Qwen3)",
                  converter=lazy("ckptkit_adapters.torchtitan.reader:CONVERTER"),
                  formats=(ExportFormat("torchtitan", "a torchtitan checkpoint (checkpoint/step-N, DCP) its Llama 3 job loads",
                                        _writer),),
                  families=(Family("torchtitan-", model=_model), Family("torchtitan-llama", layout=_layout("llama")),
                            Family("torchtitan-qwen3", layout=_layout("qwen3"))))
