"""A synthetic source manifest for the planning benchmark: what every rank of a topology would
have saved of a model, with file entries but no bytes (built untimed, from the layout)."""

from __future__ import annotations

from typing import Any

from ckptkit.layouts import holders
from ckptkit.manifest import FileEntry, Manifest, Producer, Topology
from ckptkit.plan.save import ItemDesc, plan_files, tensor_entries
from ckptkit.boxes import Box


def source_manifest(layout: Any, topology: Topology) -> Manifest:
    """Return the manifest `topology`'s ranks would commit for `layout`'s model (fp32, no optimizer step)."""
    by_tensor = holders(layout, topology)
    meta = {}
    for fqn, boxes in by_tensor.items():
        shape = tuple(max(b.offsets[d] + b.lengths[d] for b in boxes) for d in range(len(next(iter(boxes)).offsets)))
        meta[fqn] = ItemDesc(fqn, "float32", shape, Box((0,) * len(shape), shape))
    plan = plan_files(by_tensor, meta, topology.world_size)
    files = [FileEntry(path=f.path, size=sum(i.nbytes for i, _ in f.items), checksum=f"xxh3-128:{n:032x}")
             for n, f in enumerate(plan.all_files())]
    index = {f.path: i for i, f in enumerate(files)}
    kind = {"model": "param"}
    return Manifest(
        checkpoint_id="0" * 32, step=1000, created_at="2026-11-30T00:00:00+00:00", producer=Producer(ckptkit="bench"),
        topology=topology, files=tuple(files),
        tensors=tensor_entries(plan, index, lambda fqn: kind.get(fqn.split("/", 1)[0], "optimizer")),
    )
