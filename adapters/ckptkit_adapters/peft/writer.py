"""Export to a ``peft`` adapter folder that ``PeftModel.from_pretrained(base, DIR)`` loads: every
``model/`` tensor of a checkpoint converted from one, under its peft key and in its saved dtype, in
``adapter_model.safetensors``; ``adapter_config.json`` as converted; the model card if kept."""

from __future__ import annotations

import json
from collections.abc import Iterator

from ckptkit.errors import LayoutError
from ckptkit.exports.source import ExportedFile, ExportedTensor, Source, Writer, Written, exported
from ckptkit.io.checksum import checksum_of
from ckptkit.io.write import write_safetensors
from ckptkit.state.tree import unescape
from ckptkit.storage import Storage
from ckptkit_adapters.peft.reader import CARD, CONFIG, NAME, WEIGHTS


def peft_writer(source: Source) -> Writer:
    """Plan the adapter folder (failing before any write) and return its writer.

    Raises:
        LayoutError: a checkpoint that was not converted from a peft adapter folder.
    """
    manifest = source.manifest
    config = (manifest.info.config or {}).get(CONFIG)
    if not isinstance(config, dict):
        raise LayoutError(f"{source.loc}: a peft adapter folder is written from a checkpoint converted from one (its "
                          f"{CONFIG} kept in info.config), and this one has none")
    names = sorted(fqn for fqn in manifest.tensors if fqn.startswith("model/"))
    card = manifest.objects.get(f"{NAME}/{CARD}")

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        report: list[ExportedTensor] = []
        source.expect(names)

        def bodies() -> Iterator[memoryview]:
            for fqn, data in source.stream(names, lambda fqn: None):
                view = memoryview(data)  # type: ignore[arg-type]
                report.append(exported(source, unescape(fqn.removeprefix("model/")), fqn, view, manifest.tensors[fqn].dtype, WEIGHTS))
                yield view

        tensors = [(unescape(fqn.removeprefix("model/")), manifest.tensors[fqn].dtype, tuple(manifest.tensors[fqn].shape))
                   for fqn in names]
        written = write_safetensors(dst, f"{tmp}/{WEIGHTS}", WEIGHTS, tensors, bodies(), metadata={"format": "pt"}, blocks=False)
        files = [ExportedFile(path=WEIGHTS, size=written.size, checksum=written.checksum)]
        extra = {CONFIG: (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()}
        if isinstance(card, str):
            extra[CARD] = card.encode()
        for path, data in extra.items():
            dst.write(f"{tmp}/{path}", [data])
            files.append(ExportedFile(path=path, size=len(data), checksum=checksum_of(data)))
        return Written(report, files)

    return Writer(sorted(set(manifest.tensors) - set(names)), write, frozenset({f"{NAME}/{CARD}"} if isinstance(card, str) else ()))
