"""The ``torchtitan`` converter: a torchtitan checkpoint (``checkpoint/step-N``, a DCP save) read
as a ckptkit checkpoint of its Llama, laid out by torchtitan's view of the canonical model.

The save is read as any DCP save is (``common.dcp_read``); what this adds is the model: its
config read from the tensors' shapes and what the user says (``--model-config
num_attention_heads=N``; torchtitan records no config), recorded with the ``torchtitan-llama``
layout so that the checkpoint reshards and exports (to Hugging Face, Megatron-Core, ...) with no
layout named; its parameters (at the top of a model-only save, as torchtitan writes its last
step) kind ``param``; its step the directory's (``step-3``).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from typing import Any

from ckptkit.errors import IntegrityError
from ckptkit.layouts import Layout
from ckptkit.manifest import CheckpointInfo, ModelInfo
from ckptkit.ops.convert import ConvertReport, Progress
from ckptkit_adapters.common.dcp_metadata import METADATA_NAME, DcpMetadata, read_metadata
from ckptkit_adapters.common.dcp_read import LayoutNaming, plan_conversion, write_plan
from ckptkit_adapters.torchtitan.view import NAME as LAYOUT
from ckptkit_adapters.torchtitan.view import config_of, torchtitan_layout

NAME = "torchtitan"
MARK = "tok_embeddings.weight"  # the key of torchtitan's Llama's embedding, at the top of its saves
_STEP = re.compile(r"step-(\d+)")


def _shapes(md: DcpMetadata) -> dict[str, tuple[int, ...]]:
    return {key: tuple(meta.shape) for key, meta in md.entries.items() if meta is not None}


class TorchtitanConverter:
    """The ``torchtitan`` converter (the torchtitan adapter's reader)."""

    name = NAME
    description = "torchtitan checkpoint (a checkpoint/step-N DCP save of its Llama 3)"
    refines = "dcp"  # a DCP save: where both detect it, this reader is chosen

    def detect(self, path: str) -> bool:
        """Whether `path` is a DCP save (``.metadata``) holding torchtitan's Llama embedding at its top."""
        if not os.path.isfile(os.path.join(path, METADATA_NAME)):
            return False
        try:
            return MARK in read_metadata(path).entries
        except Exception:  # noqa: BLE001 - detection never raises: the DCP reader says what is wrong with it
            return False

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None, config: Mapping[str, Any] | None = None) -> ConvertReport:
        """Convert the torchtitan save `src` into the committed ckptkit checkpoint `dst`, laid out
        by `layout` if given, else by the ``torchtitan-llama`` layout of the model read from its
        shapes and `config` (at least ``num_attention_heads``; with `layout`, the config it was built for).

        Raises:
            LayoutError: a model that is not torchtitan's Llama, no heads given, or a layout that
                does not fit the tensors (nothing written).
            ManifestError, IntegrityError, CheckpointExistsError, StorageError: as the ``dcp`` converter's.
        """
        started = time.perf_counter()
        if not os.path.isdir(src):
            raise IntegrityError(f"{src}: no such directory")
        md = read_metadata(src)
        assumed: list[str] = []
        if layout is None:
            model, assumed = config_of(_shapes(md), config or {})
            layout = torchtitan_layout(model)
        plan = plan_conversion(src, md, LayoutNaming(layout))
        step = _STEP.fullmatch(os.path.basename(os.path.normpath(src)))
        info = CheckpointInfo(model=ModelInfo(family=layout.name, config=dict(layout.config))) if layout.name == LAYOUT else None
        report = write_plan(NAME, src, dst, md, plan, allow_skip=allow_skip, progress=progress, started=started,
                            step=int(step.group(1)) if step else None, info=info, layout=layout)
        if assumed:
            warning = (f"the model's {', '.join(assumed)} assumed, torchtitan Llama 3's defaults (a torchtitan checkpoint records no "
                       "config): give --model-config KEY=VALUE where the job's differ")
            report = report.model_copy(update={"warnings": [*report.warnings, warning]})
        return report


CONVERTER = TorchtitanConverter()

__all__ = ["CONVERTER", "NAME", "TorchtitanConverter"]
