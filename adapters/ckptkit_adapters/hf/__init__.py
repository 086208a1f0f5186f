"""The Hugging Face adapter: ``save_pretrained`` folders read (``reader``), written (``writer``, with
``mapping``: each file tensor runs of rows of the checkpoint's, the ``config.json``), and the
Hugging Face view of each canonical model (``view``), in the files and in transformers' modules."""

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
    from ckptkit_adapters.hf.writer import hf_writer

    return hf_writer(source, options.dtype, options.max_shard_bytes, options.layout), None


def _trainer_writer(source: Source, options: ExportOptions) -> tuple[Writer, str | None]:
    from ckptkit_adapters.hf.trainer_writer import trainer_folder_writer

    return trainer_folder_writer(source, options.max_shard_bytes), None


def _hf(config: Mapping[str, Any]) -> Layout:
    from ckptkit_adapters.hf.view import hf_layout

    return hf_layout(config)


def _hf_llama(config: Mapping[str, Any]) -> Layout:
    from ckptkit_adapters.hf.view import hf_llama

    return hf_llama(config)


def _gpt2(config: Mapping[str, Any]) -> Layout:
    from ckptkit_adapters.hf.view import gpt2

    return gpt2(config)


def _model(layout: Layout, carried: Mapping[str, Any] | None) -> tuple[ModelSpec, View]:
    from ckptkit_adapters.hf.view import hf_model

    return hf_model(layout, carried)


def _modules(spec: ModelSpec) -> View:
    from ckptkit_adapters.hf.view import module_view

    return module_view(spec)


ADAPTER = Adapter(
    name="hf", description="Hugging Face transformers (save_pretrained folders)", converter=lazy("ckptkit_adapters.hf.reader:CONVERTER"),
    formats=(ExportFormat("hf", "Hugging Face model directory", _writer, optimizer="never", layout=True),
             ExportFormat("hf-trainer", "a Hugging Face Trainer checkpoint folder (resume_from_checkpoint), from a checkpoint "
                          "converted from one", _trainer_writer, dtypes=(), optimizer="always", holds=("param", "buffer", "rng"),
                          saved_dtype="a Trainer folder keeps the weights and the optimizer in their saved dtypes")),
    families=(
        Family("hf", layout=_hf),
        Family("hf-llama", layout=_hf_llama),
        Family("gpt2", layout=_gpt2, model=_model, modules=_modules),
        Family("hf-", model=_model, modules=_modules),
    ),
)
