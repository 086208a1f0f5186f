"""The rank files of a legacy Megatron-LM checkpoint: which there are, their pickles through an
allowlist, and a local tensor's bytes read in place (no torch).

A legacy save (``--ckpt-format torch``) holds one directory per model-parallel rank,
``mp_rank_{tp:02d}`` or, with pipeline parallelism, ``mp_rank_{tp:02d}_{pp:03d}`` (a third
``_{ep:03d}`` with expert parallelism, refused), each with the ``torch.save`` archive
``model_optim_rng.pt`` and, with the distributed optimizer, ``distrib_optim.pt``. A file is
parsed once (`RankFile`) and closed; its tensors stay descriptions (`StoredTensor`) until they
are read, each file reopened then (`open_file`), so at most the files one tensor needs are
open at a time.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.manifest.dtypes import itemsize
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.numpy_pickle import NUMPY_ALLOWED, NumpyArray
from ckptkit_adapters.common.safepickle import Record
from ckptkit_adapters.common.torchsave import (
    STATE_DICT_ALLOWED,
    Archive,
    StoredTensor,
    copy_flat,
    copy_tensor,
    open_archive,
    stored_object,
)
from ckptkit_adapters.megatron.reader import _Namespace

MODEL_FILE = "model_optim_rng.pt"
OPTIM_FILE = "distrib_optim.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")


class EnumValue(Record):
    """An enum member a pickle rebuilds by value (``AttnBackend(5)``); read as ``Class.value``."""


def _enum(qualname: str) -> type[EnumValue]:
    return type(qualname.rsplit(".", 1)[-1], (EnumValue,), {"qualname": qualname})


class _TensorType:
    """``torch.Tensor`` as ``_rebuild_from_type_v2`` names the type to rebuild."""


_TENSOR = _TensorType()


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> StoredTensor:
    """``torch._tensor._rebuild_from_type_v2``: a plain tensor with Python attributes (Megatron's
    ``tensor_model_parallel``, ``partition_dim``... on the fp32 copies), the attributes dropped."""
    if new_type is not _TENSOR or not callable(func) or not isinstance(args, tuple):
        raise ValueError("_rebuild_from_type_v2 of something other than a torch.Tensor")
    tensor = func(*args)
    if not isinstance(tensor, StoredTensor):
        raise ValueError("_rebuild_from_type_v2 that rebuilds no tensor")
    return tensor


_ENUMS = ("megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
          "megatron.core.transformer.enums.InferenceCudaGraphScope", "megatron.core.enums.Fp8Recipe", "signal.Signals")
# What model_optim_rng.pt and distrib_optim.pt need: tensors (some with Python attributes),
# state dicts, Megatron-LM's arguments (an argparse.Namespace whose values include a few enums),
# the NumPy generator state.
LEGACY_ALLOWED: dict[tuple[str, str], Any] = {
    **STATE_DICT_ALLOWED,
    ("argparse", "Namespace"): _Namespace,
    ("torch", "Tensor"): _TENSOR,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    **NUMPY_ALLOWED,
    **{tuple(q.rsplit(".", 1)): _enum(q) for q in _ENUMS},  # type: ignore[misc]
}


@dataclass(frozen=True)
class RankFile:
    """A parsed rank file: where it is, its archive (the descriptor closed), its object."""

    path: str
    size: int
    archive: Archive
    tree: Any


@dataclass(frozen=True)
class RankDir:
    """One model-parallel rank's directory: its TP and PP coordinates."""

    path: str
    name: str
    tp: int
    pp: int


def rank_dirs(path: str) -> list[RankDir]:
    """The ``mp_rank_*`` directories of iteration directory `path`, checked to form a whole TP x PP grid.

    Raises:
        ManifestError: expert-parallel directories (``mp_rank_XX_YYY_ZZZ``), or mixed forms.
        IntegrityError: a rank's directory or its ``model_optim_rng.pt`` is missing.
    """
    found: dict[tuple[int, int], RankDir] = {}
    forms = set()
    for name in sorted(os.listdir(path)):
        m = RANK_DIR.match(name)
        if m is None:
            continue
        if m.group(3):
            raise ManifestError(f"{path}/{name}: an expert-parallel rank (mp_rank_TP_PP_EP), which this converter does not read")
        forms.add(m.group(2) is None)
        found[(int(m.group(1)), int(m.group(2) or 0))] = RankDir(os.path.join(path, name), name, int(m.group(1)), int(m.group(2) or 0))
    if len(forms) != 1:
        raise ManifestError(f"{path}: rank directories of both forms (mp_rank_XX and mp_rank_XX_YYY)")
    tp, pp = 1 + max(t for t, _ in found), 1 + max(p for _, p in found)
    missing = [f"mp_rank_{t:02d}" + ("" if forms == {True} else f"_{p:03d}") for p in range(pp) for t in range(tp) if (t, p) not in found]
    if missing:
        raise IntegrityError(f"{path}: rank directories missing: {', '.join(missing)}")
    for d in found.values():
        if not os.path.isfile(os.path.join(d.path, MODEL_FILE)):
            raise IntegrityError(f"{d.path}/{MODEL_FILE}: missing")
    return [found[(t, p)] for p in range(pp) for t in range(tp)]


def parse(path: str) -> RankFile:
    """Parse the archive at `path` through `LEGACY_ALLOWED` (its tensors as descriptions) and close it.

    Raises:
        ManifestError: the pickle needs a class outside the allowlist (named).
        IntegrityError: not a torch.save archive, truncated, tensors outside their records.
        StorageError: the file is missing or not a regular file.
    """
    fd, size = open_regular(path)
    try:
        archive = open_archive(fd, 0, size, path)
        tree = stored_object(archive, LEGACY_ALLOWED)
    finally:
        os.close(fd)
    return RankFile(path, size, archive, tree)


@contextmanager
def open_file(rank_file: RankFile) -> Iterator[Archive]:
    """Reopen a parsed rank file for reading its tensors (refused if its size changed)."""
    fd, size = open_regular(rank_file.path)
    try:
        if size != rank_file.size:
            raise IntegrityError(f"{rank_file.path}: {size} bytes now, {rank_file.size} when it was read (changed underneath)")
        yield dataclasses.replace(rank_file.archive, fd=fd)
    finally:
        os.close(fd)


def read_local(archive: Archive, stored: StoredTensor, flat: tuple[int, tuple[int, ...]] | None = None) -> np.ndarray[Any, Any]:
    """A local tensor's bytes as a uint8 array of its shape plus the element size: the stored
    tensor, or (`flat` = (start, shape)) a range of a 1-D stored tensor in that shape."""
    width = itemsize(stored.dtype)
    if flat is None:
        out = np.empty((*stored.shape, width), dtype=np.uint8)
        copy_tensor(archive, stored, out)
        return out
    start, shape = flat
    out = np.empty((*shape, width), dtype=np.uint8)
    copy_flat(archive, stored, start, out.reshape(-1).data)
    return out


__all__ = ["LEGACY_ALLOWED", "MODEL_FILE", "OPTIM_FILE", "EnumValue", "NumpyArray", "RankDir", "RankFile", "open_file",
           "parse", "rank_dirs", "read_local"]
