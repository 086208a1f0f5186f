"""Convert a ``peft`` adapter folder into a ckptkit checkpoint.

Recognised by ``adapter_config.json`` beside ``adapter_model.safetensors``. Each tensor of the
weights file becomes ``model/<peft key>`` (kind ``param``, its saved dtype, bit for bit; the key one
escaped name part, as the ``hf`` converter names keys); ``adapter_config.json`` is kept in
``info.config`` (as the ``hf`` converter keeps ``config.json``) and the folder's model card
(``README.md``) as the value ``peft/README.md``. Anything else in the folder is listed as skipped,
which fails the conversion unless ``allow_skip``. The adapter has no canonical model (its
tensors are low-rank factors of the base model's), so no layout is recorded.
"""

from __future__ import annotations

import json
import os
import time

from pydantic import JsonValue

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout
from ckptkit.manifest import CheckpointInfo
from ckptkit.ops.convert import ConvertReport, Progress, SkippedEntry, TensorSpec, refuse_skips, report_of, source_info, write_converted
from ckptkit.state.tree import escape
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.files import read_small, safetensors_header
from ckptkit_adapters.common.torchsave import pread_into

NAME = "peft"
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
CARD = "README.md"
LIMIT = 16 << 20  # no config or model card is read past this size


class PeftConverter:
    """The ``peft`` converter."""

    name = NAME
    description = "peft adapter folder (adapter_config.json and adapter_model.safetensors)"

    def detect(self, path: str) -> bool:
        """Whether `path` holds an adapter config and its weights."""
        try:
            names = set(os.listdir(path))
        except OSError:
            return False
        return CONFIG in names and WEIGHTS in names

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None) -> ConvertReport:
        """Convert the adapter folder `src` into the committed checkpoint `dst` (recording `layout` if given).

        Raises:
            ManifestError: a malformed adapter_config.json; other files, without `allow_skip`.
            IntegrityError: the weights file missing, truncated or malformed.
            CheckpointExistsError, StorageError: as `ckptkit.ops.convert.write_converted`.
        """
        started = time.perf_counter()
        if not os.path.isdir(src):
            raise IntegrityError(f"{src}: no such directory")
        try:
            config = json.loads(read_small(os.path.join(src, CONFIG), LIMIT, "the adapter's config"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{os.path.join(src, CONFIG)}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ManifestError(f"{os.path.join(src, CONFIG)}: not a JSON object")
        path = os.path.join(src, WEIGHTS)
        header = safetensors_header(path)
        entries = sorted(header.entries.items(), key=lambda kv: kv[1].begin)
        specs = [TensorSpec(name=f"model/{escape(key)}", source=key, dtype=e.dtype, shape=e.shape, kind="param")
                 for key, e in entries]
        where = {f"model/{escape(key)}": e for key, e in entries}
        names = set(os.listdir(src))
        objects: dict[str, JsonValue] = {}
        if CARD in names:
            objects[f"{NAME}/{CARD}"] = read_small(os.path.join(src, CARD), LIMIT, "the model card").decode("utf-8", "replace")
        skipped = [SkippedEntry(name=n, reason="not part of a peft adapter folder") for n in sorted(names - {CONFIG, WEIGHTS, CARD})]
        refuse_skips(skipped, allow_skip=allow_skip, where=src)
        fd, _ = open_regular(path)

        def read(spec: TensorSpec) -> memoryview:
            entry = where[spec.name]
            view = memoryview(bytearray(entry.end - entry.begin))
            pread_into(fd, view, entry.begin, path)
            return view

        try:
            committed = write_converted(dst, specs, read, objects=objects, step=lambda: 0,
                                        info=CheckpointInfo(config={CONFIG: config}), layout=layout, progress=progress,
                                        source=source_info(NAME, src, version=config.get("peft_version")))
        finally:
            os.close(fd)
        return report_of(NAME, src, committed, [(s, 1) for s in specs], {f"{NAME}/{CARD}": CARD} if objects else {},
                         skipped, started)


CONVERTER = PeftConverter()
