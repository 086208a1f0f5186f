"""ckptkit: checkpoints for sharded large-model training.

The pure parts (manifest, boxes, planner, verify, inspect) import without torch; ``save``,
``load`` and ``ShardedTensor`` use torch and are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptkitError,
    IntegrityError,
    LayoutError,
    ManifestError,
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
from .provenance import code_version
from .sharded import ShardedTensor

if TYPE_CHECKING:
    from .loader import Checkpoint, load, open
    from .saver import save

__all__ = [
    "Checkpoint",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CkptkitError",
    "CodeVersion",
    "DataProgress",
    "DataVersion",
    "IntegrityError",
    "LayoutError",
    "Manifest",
    "ManifestError",
    "ModelInfo",
    "OptimizerInfo",
    "ParamGroup",
    "SaveHandle",
    "ShardedTensor",
    "StorageError",
    "Topology",
    "__version__",
    "code_version",
    "diff",
    "export",
    "inspect",
    "list_checkpoints",
    "load",
    "open",
    "read_manifest",
    "reshard",
    "save",
    "verify",
]


# Calls that need torch, imported on first use: name -> module.
_LAZY = {"save": "saver", "load": "loader", "open": "loader", "Checkpoint": "loader", "diff": "differ", "export": "exporter",
         "CheckpointManager": "manager", "SaveHandle": "manager"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ckptkit' has no attribute {name!r}")


def read_manifest(path: str, *, storage: Any = None) -> Manifest:
    """Return the validated manifest of the committed checkpoint at `path` (or a root's latest)."""
    from .catalog import read_manifest as _read, resolve

    return _read(resolve(path, storage))


def verify(path: str, **options: Any) -> Any:
    """Check a checkpoint against its manifest; return a ``VerifyReport`` listing every finding.

    Options are those of :func:`ckptkit.verifier.verify` (quick, workers, progress, storage).
    """
    from .verifier import verify as _verify

    return _verify(path, **options)


def reshard(src: str, dst: str, topology: Topology, **options: Any) -> Any:
    """Write the checkpoint at `src` as the one `topology`'s ranks would have saved, at `dst`;
    return a ``ReshardReport``. Options are those of :func:`ckptkit.resharder.reshard`."""
    from .resharder import reshard as _reshard

    return _reshard(src, dst, topology, **options)


def inspect(path: str) -> Any:
    """Return a summary (``InspectReport``) of the committed checkpoint at `path`."""
    from .inspector import inspect as _inspect

    return _inspect(path)


def list_checkpoints(root: str) -> Any:
    """Return the committed checkpoints and leftovers under a root (a ``Listing``)."""
    from .catalog import list_root

    return list_root(root)
