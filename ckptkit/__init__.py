"""ckptkit: checkpoints for sharded large-model training.

The pure parts (manifest, boxes, planner, verify, inspect) import without torch; ``save``,
``load`` and ``ShardedTensor`` use torch and are imported on first use.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptkitError,
    ForeignCheckpointError,
    IntegrityError,
    LayoutError,
    ManifestError,
    RunError,
    StorageError,
)
from .manifest import (
    CheckpointInfo,
    CodeVersion,
    DataProgress,
    DataVersion,
    Manifest,
    ModelInfo,
    OptimizerInfo,
    ParamGroup,
    Topology,
)
from . import layouts as _layouts  # registers the rules of derived tensors (manifest 1.6)
from .io.run_record import RunRecord, read_run
from .ops.provenance import code_version
from .state.sharded import ShardedTensor

from .storage import Storage, open_storage

if TYPE_CHECKING:
    from .ops.compact import CompactReport, compact
    from .ops.convert import ConvertReport, convert, detect_format, list_converters
    from .ops.diff import DiffReport, diff
    from .ops.failure import ErrorReport
    from .exports.formats import EXPORT_FORMATS
    from .exports.run import ExportReport, export
    from .ops.inspect import InspectReport, human_bytes, inspect
    from .layouts import Layout
    from .ops.load import Checkpoint, load, open
    from .ops.weights import load_weights
    from .writer.manager import CheckpointManager, SaveHandle
    from .writer.tier import FlushReport, MemoryTier, RestoreReport, flush_node
    from .ops.listing import ListingReport
    from .ops.reshard import ReshardReport, reshard
    from .ops.save import save
    from .ops.verify import VerifyReport, verify
    from .writer.clean import CleanReport, clean
    from .writer.prune import PruneReport, prune

__all__ = [
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CkptkitError",
    "CleanReport",
    "CodeVersion",
    "CompactReport",
    "ConvertReport",
    "DataProgress",
    "DataVersion",
    "DiffReport",
    "EXPORT_FORMATS",
    "ErrorReport",
    "ExportReport",
    "FlushReport",
    "ForeignCheckpointError",
    "InspectReport",
    "IntegrityError",
    "Layout",
    "LayoutError",
    "ListingReport",
    "Manifest",
    "ManifestError",
    "MemoryTier",
    "ModelInfo",
    "OptimizerInfo",
    "ParamGroup",
    "PruneReport",
    "ReshardReport",
    "RestoreReport",
    "RunError",
    "RunRecord",
    "SaveHandle",
    "ShardedTensor",
    "Storage",
    "StorageError",
    "Topology",
    "VerifyReport",
    "__version__",
    "clean",
    "code_version",
    "compact",
    "convert",
    "detect_format",
    "diff",
    "export",
    "flush_node",
    "human_bytes",
    "inspect",
    "list_checkpoints",
    "list_converters",
    "load",
    "load_weights",
    "open",
    "open_storage",
    "prune",
    "read_manifest",
    "read_run",
    "reshard",
    "save",
    "verify",
]

# Imported on first use (torch, threads or the report machinery): name -> module. The calls
# that need no torch (verify, inspect, reshard, convert, list_checkpoints) stay importable without it.
_LAZY = {
    "save": "ops.save", "load": "ops.load", "load_weights": "ops.weights", "open": "ops.load", "Checkpoint": "ops.load", "diff": "ops.diff",
    "DiffReport": "ops.diff", "export": "exports.run", "ExportReport": "exports.run", "CheckpointManager": "writer.manager",
    "SaveHandle": "writer.manager", "MemoryTier": "writer.tier", "RestoreReport": "writer.tier", "FlushReport": "writer.tier", "flush_node": "writer.tier",
    "verify": "ops.verify", "VerifyReport": "ops.verify", "inspect": "ops.inspect",
    "InspectReport": "ops.inspect", "reshard": "ops.reshard", "ReshardReport": "ops.reshard", "ListingReport": "ops.listing",
    "Layout": "layouts", "convert": "ops.convert", "ConvertReport": "ops.convert", "detect_format": "ops.convert",
    "list_converters": "ops.convert", "clean": "writer.clean", "CleanReport": "writer.clean", "prune": "writer.prune",
    "PruneReport": "writer.prune", "compact": "ops.compact", "CompactReport": "ops.compact",
    "human_bytes": "ops.inspect", "ErrorReport": "ops.failure", "EXPORT_FORMATS": "exports.formats",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def read_manifest(path: str | os.PathLike[str], *, storage: Storage | None = None) -> Manifest:
    """Return the validated manifest of the committed checkpoint at `path` (or a root's latest).

    Raises:
        CheckpointNotFoundError: nothing committed at `path`.
        ManifestError: the manifest is malformed or of a newer schema.
    """
    from .io.catalog import read_manifest as _read, resolve

    return _read(resolve(path, storage))


def list_checkpoints(root: str | os.PathLike[str]) -> ListingReport:
    """Return what a root holds: its committed checkpoints by step (with topology, size and
    time), its ``latest`` pointer and run record, the other directories named for what they are
    (exports, other tools' checkpoints), the leftovers of interrupted saves, and warnings (such
    as a ``latest`` that names no committed checkpoint).

    Raises:
        CheckpointNotFoundError: the root does not exist.
    """
    from .ops.listing import list_root

    return list_root(root)
