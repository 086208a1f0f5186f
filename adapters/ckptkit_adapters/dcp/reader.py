"""Convert a torch.distributed.checkpoint (DCP) directory into a ckptkit checkpoint.

Reads ``.metadata`` (safely: see `common.dcp_metadata`) and the ``.distcp`` byte ranges it points to
directly, one tensor at a time: each chunk (a box one rank saved) is a ``torch.save`` archive
in a ``.distcp`` file, whose storage bytes are copied straight into the tensor being
assembled; the whole tensor is then written and dropped. Neither torch nor its consolidation
(``dcp_to_torch_save``) is used, so memory stays about one tensor (plus one chunk when a
chunk is not a run of whole rows).

Names: DCP flattens the saved state dict into keys joined by ``.`` (``model.layers.0.weight``,
``optim.state.layers.0.weight.exp_avg``, ``optim.param_groups.0.lr``). A key's ckptkit name
(`fqn_of`) is the key split at every ``.``, each part escaped as ckptkit escapes a name part
(``~`` -> ``~0``, ``/`` -> ``~1``), joined by ``/``: ``model/layers/0/weight``. `dcp_key` is the
exact inverse. Kinds: keys under a torch optimizer state dict (``<prefix>.state.…`` where
``<prefix>.param_groups.<i>.…`` exists) and under ``optim``/``optimizer`` are ``optimizer``,
under ``model`` ``param``, under ``rng`` ``rng``, under ``buffers`` ``buffer``, anything else
``other``. Non-tensor values (DCP's BytesIO entries, each a ``torch.save`` of the value) are
unpickled with builtins only and kept as JSON (tuples become lists). The manifest's step is
the optimizer's ``step`` when every parameter's agrees, else 0.

Everything else is skipped with a reason, and fails the conversion unless ``allow_skip``: a
dtype ckptkit has no name for, a chunk stored with stream transforms (compression), a value
that needs a class to unpickle or is not JSON, stored bytes the metadata lists under no entry.
"""

from __future__ import annotations

import os
import time

from ckptkit.errors import IntegrityError
from ckptkit.layouts import Layout
from ckptkit.ops.convert import (
    ConvertReport,
    Progress,
)
from ckptkit_adapters.common.dcp_metadata import (
    METADATA_NAME,
    RANK_METADATA,
    DcpMetadata,
    rank_metadata_files,
    read_metadata,
    read_rank_metadata,
)
from ckptkit_adapters.common.dcp_read import LayoutNaming, plan_conversion, write_plan
from ckptkit_adapters.dcp.hf_storage import is_safetensors_save, read_safetensors_save
from ckptkit_adapters.dcp.layout import fsdp2_layout

NAME = "dcp"
# The file Megatron-Core's torch_dist format adds to a DCP directory (with common.pt before
# megatron-core 0.17): that is another converter's.
MEGATRON_FILES = frozenset({"metadata.json", "common.pt"})
MEGATRON_METADATA = "metadata.json"


class DcpConverter:
    """The ``dcp`` converter (registered in the ``ckptkit.converters`` entry-point group)."""

    name = NAME
    description = ("torch.distributed.checkpoint directory (.metadata or per-rank metadata and .distcp files: FSDP2, DTensor, "
                   "no_dist saves; or HuggingFaceStorageWriter safetensors)")

    def detect(self, path: str) -> bool:
        """Whether `path` is a DCP directory: ``.distcp`` files with a ``.metadata`` or the ranks'
        ``__<rank>.metadata`` (and not Megatron's torch_dist format, which adds ``metadata.json``),
        or a ``HuggingFaceStorageWriter`` save."""
        names: set[str] = set()
        distcp = False
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    distcp = distcp or entry.name.endswith(".distcp")
                    if entry.name == METADATA_NAME or entry.name in MEGATRON_FILES or RANK_METADATA.match(entry.name):
                        names.add(entry.name)
        except OSError:
            return False
        per_rank = any(RANK_METADATA.match(n) for n in names)
        return (distcp and (METADATA_NAME in names or per_rank) and MEGATRON_METADATA not in names) or is_safetensors_save(path)

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None) -> ConvertReport:
        """Convert the DCP directory `src` into the committed ckptkit checkpoint `dst`, recording
        `layout` if given (DCP records none; the DCP keys of its tensors, whose names hold ``.``,
        become those names), else the FSDP2 view of a save in ``get_state_dict``'s form
        (``dcp.layout``: every parameter and its optimizer state cut on dim 0 over DP).

        Raises:
            ManifestError: ``.metadata`` refused (a class outside the allowlist, named) or
                malformed; entries that cannot be converted, without `allow_skip`.
            IntegrityError: a ``.distcp`` file missing or truncated, chunks that do not tile
                their tensor, a chunk unlike its metadata.
            CheckpointExistsError, StorageError: as `ckptkit.ops.convert.write_converted`.
        """
        started = time.perf_counter()
        if not os.path.isdir(src):
            raise IntegrityError(f"{src}: no such directory")
        md = _metadata_of(src)
        naming = LayoutNaming(layout) if layout is not None else None
        plan = plan_conversion(src, md, naming)
        if layout is None:  # the FSDP2 view, when the save is in get_state_dict's form
            layout = fsdp2_layout([t.spec for t in plan.tensors] + [t.spec for t in plan.assembled])
        return write_plan(NAME, src, dst, md, plan, allow_skip=allow_skip, progress=progress, started=started, layout=layout)


def _metadata_of(src: str) -> DcpMetadata:
    """The save's metadata: ``.metadata``; else the ranks' ``__<rank>.metadata`` (a save without
    collectives); else a ``HuggingFaceStorageWriter`` save's safetensors headers."""
    if os.path.exists(os.path.join(src, METADATA_NAME)):
        return read_metadata(src)
    if rank_metadata_files(src):
        return read_rank_metadata(src)
    if is_safetensors_save(src):
        return read_safetensors_save(src)
    return read_metadata(src)  # fails, naming the missing .metadata


CONVERTER = DcpConverter()

__all__ = ["CONVERTER", "NAME", "Assembled", "DcpConverter", "Named", "Naming", "Planned", "assemble", "chunk_count", "dcp_key", "fqn_of", "kind_of",
           "entry_archive", "optimizer_prefixes", "Plan", "plan_conversion", "write_plan"]
