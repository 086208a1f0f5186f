"""Checks of a manifest against itself: safe paths, valid shard specs, exact tiling (pure).

Every finding is collected; callers raise once or report them all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..boxes import tiling_problems
from .dtypes import DTYPES
from ..errors import StorageError
from .derived import FileList, derivation_of, listed_tensors, table_path
from .model import TABLE_SINCE, BoxShards, FileEntry, GridShards, Manifest, TensorEntry, _version, file_checksum_of_blocks
from .shards import grid_cell_count, grid_cells, grid_file, iter_shards, spec_keys
from ..storage import check_key, plain_name


# No file or tensor is this large (4 EiB): a manifest saying otherwise is damaged, and every size
# below it fits the 64-bit arithmetic of the checks.
SIZE_LIMIT = 1 << 62


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem: a short code, where it is (tensor or file), and what is wrong."""

    code: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.where}: {self.message}"


def manifest_findings(manifest: Manifest) -> list[Finding]:
    """Return every inconsistency of a manifest with itself."""
    findings: list[Finding] = _table_findings(manifest.files)
    seen: set[str] = set()
    for _, entry in _listed_files(manifest.files):
        where = entry.where()
        try:
            check_key(entry.path)
        except StorageError:
            findings.append(Finding("path", where, "path escapes the checkpoint (absolute, '..' or empty segment)"))
        if entry.base is not None and not plain_name(entry.base):
            findings.append(Finding("path", where, "base is not the name of a checkpoint of the same root (a path, or hidden)"))
        if where in seen:
            findings.append(Finding("path", where, "listed twice in files"))
        seen.add(where)
        if entry.size >= SIZE_LIMIT:
            findings.append(Finding("schema", where, f"size {entry.size} is beyond any file (limit 2^62 bytes)"))
            continue
        blocks = entry.blocks
        inline = blocks.inline() if blocks is not None else None
        if blocks is not None and inline is not None and len(inline) != 8 * blocks.count(entry.size):
            findings.append(Finding("schema", where, f"block checksums do not describe {blocks.count(entry.size)} "
                                                          f"blocks of {blocks.size} bytes (base64 of 8 bytes each)"))
        elif blocks is not None and inline is None and not entry.checksum.startswith("xxh3-128-blocks:"):
            findings.append(Finding("checksum", where, "block checksums in a sidecar need a file checksum derived from them "
                                                       "(xxh3-128-blocks:)"))
        elif entry.checksum.startswith("xxh3-128-blocks:") and (blocks is None or inline is not None
                                                                and entry.checksum != file_checksum_of_blocks(inline)):
            findings.append(Finding("checksum", where, "file checksum does not match its block checksums"))
    for fqn, tensor in listed_tensors(manifest.tensors).items():
        findings += _tensor_findings(fqn, tensor, len(manifest.files))
    findings += _derived_findings(manifest)
    if not findings:  # every spec is sound, so expanding the shards is bounded by the files
        findings += _mapping_findings(manifest)
    return findings


def _listed_files(files: Sequence[FileEntry]) -> list[tuple[int, FileEntry]]:
    """(index, entry) of the files a manifest lists (after its table's)."""
    start = files.table.count if isinstance(files, FileList) else 0
    return list(enumerate(files[start:], start))


def _file_sizes(files: Sequence[FileEntry]) -> np.ndarray:
    """Every file's size, as an array (a table's without making its entries)."""
    listed = np.fromiter((f.size for _, f in _listed_files(files)), dtype=np.int64)
    return np.concatenate((files.sizes, listed)) if isinstance(files, FileList) else listed


def _table_findings(files: Sequence[FileEntry]) -> list[Finding]:
    """A file table's sizes and block sizes, checked as arrays; no listed file under one of its paths."""
    if not isinstance(files, FileList):
        return []
    findings = []
    big = np.flatnonzero(files.sizes >= SIZE_LIMIT)
    if len(big):
        findings.append(Finding("schema", table_path(int(big[0])), f"size {int(files.sizes[big[0]])} is beyond any file (limit 2^62 bytes)"))
    empty = np.flatnonzero(files.block_sizes <= 0)
    if len(empty):
        findings.append(Finding("schema", table_path(int(empty[0])), "block size 0"))
    tabled = {table_path(i) for i in range(files.table.count)} if files.listed else set()
    findings += [Finding("path", f.where(), "listed twice in files (also in the file table)") for f in files.listed if f.path in tabled]
    return findings


def _derived_findings(manifest: Manifest) -> list[Finding]:
    """A manifest deriving tensors: of schema 1.6 or later, known dtypes, a rule that applies to the
    layout and topology (checked as the manifest is read), a tensors file for each of the topology's ranks, and no listed tensor or
    key in the rule's names (the rule's boxes tile their tensors and hold distinct keys by
    construction: nothing is expanded here)."""
    source = derivation_of(manifest.tensors)
    if source is None or manifest.derived is None:
        return []
    where = "derived"
    findings = []
    if _version(manifest.schema_version) < TABLE_SINCE:
        findings.append(Finding("schema", where, f"derived tensors need schema 1.6, the manifest says {manifest.schema_version}"))
    for label, group in manifest.derived.groups.items():
        if group.dtype not in DTYPES:
            findings.append(Finding("schema", where, f"group {label!r}: unknown dtype {group.dtype!r}"))
    files = manifest.files
    count = source.files()
    if len(files) < count:
        findings.append(Finding("mapping", where, f"the rule writes {count} files, the manifest has {len(files)}"))
    else:
        odd = next((i for i, f in _listed_files(files) if i < count and (f.role != "tensors" or f.encoding != "safetensors"
                                                                         or f.base is not None)), None)
        if odd is not None:
            findings.append(Finding("mapping", where, f"file #{odd} ({files[odd].where()}) is not a rank's own safetensors file"))
    for fqn, tensor in listed_tensors(manifest.tensors).items():
        named = [k for k in spec_keys(tensor) if source.find(k.split("#", 1)[0]) is not None]
        if source.find(fqn) is not None or named:
            findings.append(Finding("mapping", fqn, "listed, but its name or key is one the rule derives"))
    return findings


def _mapping_findings(manifest: Manifest) -> list[Finding]:
    """Each shard's bytes are its own: no two shards name the same key of the same file, no shard
    is larger than its file, and a raw file holds exactly one shard, of the file's size (or, for a
    zarr chunk at the edge of its array, of the size of the array's largest chunk: the padding the
    zarr form writes). Grids are checked cell by cell as arrays, never expanded into objects."""
    findings: list[Finding] = []
    sizes = _file_sizes(manifest.files)
    raw_files = {i for i, f in _listed_files(manifest.files) if f.encoding == "raw"}
    tensors = listed_tensors(manifest.tensors)
    spec_count: dict[str, int] = {}
    for tensor in tensors.values():
        for key in spec_keys(tensor):
            spec_count[key] = spec_count.get(key, 0) + 1
    owner: dict[tuple[int, str], str] = {}
    raw: dict[int, list[tuple[str, int, int]]] = {}
    for fqn, tensor in tensors.items():
        item = DTYPES[tensor.dtype][0]
        spec = tensor.shards
        if isinstance(spec, GridShards):
            files, volumes = grid_cells(tensor.shape, spec)
            held = volumes > 0 if tensor.shape else np.ones(len(volumes), dtype=bool)
            files, nbytes = files[held], volumes[held] * item
            large = np.flatnonzero(nbytes > sizes[files])
            if len(large):
                f = int(files[large[0]])
                findings.append(Finding("mapping", fqn, f"a shard of {int(nbytes[large[0]])} bytes cannot be in "
                                                        f"{manifest.files[f].where()} ({manifest.files[f].size} bytes)"))
            unique, counts = np.unique(files, return_counts=True)
            if len(unique) != len(files):
                twice = manifest.files[int(unique[np.argmax(counts > 1)])].where()
                findings.append(Finding("mapping", fqn, f"two shards read key {spec.key!r} of {twice} (both of {fqn})"))
            if spec_count[spec.key] > 1 or raw_files:  # rare: list the cells that can meet another spec
                cells = list(zip(files.tolist(), nbytes.tolist()))
            else:
                continue
            largest = int(nbytes.max(initial=0))
            keyed = [(f, spec.key, n) for f, n in cells]
        else:
            keyed = [(s.file, s.key, s.box.volume * item) for s in iter_shards(tensor)]
            largest = max((n for _, _, n in keyed), default=0)
            for f, _, n in keyed:
                if n > manifest.files[f].size:  # a shape no file can hold (a load would allocate it first)
                    findings.append(Finding("mapping", fqn, f"a shard of {n} bytes cannot be in "
                                                            f"{manifest.files[f].where()} ({manifest.files[f].size} bytes)"))
        for f, key, n in keyed:
            if spec_count[key] > 1 or isinstance(spec, BoxShards):
                if (f, key) in owner:
                    findings.append(Finding("mapping", fqn, f"two shards read key {key!r} of {manifest.files[f].where()} "
                                                            f"(the other of {owner[f, key]})"))
                owner[f, key] = fqn
            if f in raw_files:
                raw.setdefault(f, []).append((fqn, n, largest))
        for patch in tensor.patches:
            for key, n in ((patch.indices, patch.count * 8), (patch.values, patch.count * item)):
                if (patch.file, key) in owner:
                    findings.append(Finding("mapping", fqn, f"a patch reads key {key!r} of {manifest.files[patch.file].where()}, "
                                                            f"which {owner[patch.file, key]} reads too"))
                owner[patch.file, key] = fqn
            if patch.file in raw_files:
                findings.append(Finding("mapping", fqn, f"a patch names the raw file {manifest.files[patch.file].where()}"))
    for index in sorted(raw_files):
        entry = manifest.files[index]
        if entry.role != "tensors":
            continue
        named = raw.get(index, [])
        if len(named) != 1:
            findings.append(Finding("mapping", entry.where(), f"a raw file holds exactly one shard, this one is named by {len(named)}"))
        elif entry.size not in named[0][1:]:
            findings.append(Finding("mapping", entry.where(), f"raw file of {entry.size} bytes holds a shard of {named[0][1]} bytes"))
    return findings


def _tensor_findings(fqn: str, tensor: TensorEntry, n_files: int) -> list[Finding]:
    if tensor.dtype not in DTYPES:
        return [Finding("schema", fqn, f"unknown dtype {tensor.dtype!r}")]
    if any(d < 0 for d in tensor.shape):
        return [Finding("schema", fqn, f"negative size in shape {list(tensor.shape)}")]
    if math.prod(tensor.shape) * DTYPES[tensor.dtype][0] >= SIZE_LIMIT:
        return [Finding("schema", fqn, f"shape {list(tensor.shape)} is beyond any tensor (limit 2^62 bytes)")]
    spec = tensor.shards
    if isinstance(spec, GridShards):
        # Rising cuts from 0 to the size tile the tensor by construction: no need to expand cells.
        problem = _grid_problem(tensor, spec, n_files)
        return [Finding("tiling", fqn, problem)] if problem else _patch_findings(fqn, tensor, n_files)
    shards = list(iter_shards(tensor))
    findings = []
    for s in shards:
        if not 0 <= s.file < n_files:
            findings.append(Finding("schema", fqn, f"shard at {list(s.box.offsets)} names file #{s.file}, but there are {n_files}"))
    if findings:
        return findings
    for problem in tiling_problems(tensor.shape, [s.box for s in shards]):
        findings.append(Finding("tiling", fqn, problem))
    return findings + _patch_findings(fqn, tensor, n_files)


def _patch_findings(fqn: str, tensor: TensorEntry, n_files: int) -> list[Finding]:
    """A patch names a listed file, a box inside the tensor, two keys, and no more elements than the box holds."""
    findings = []
    for n, p in enumerate(tensor.patches):
        where = f"patch {n} (at {list(p.offsets)})"
        if not 0 <= p.file < n_files:
            findings.append(Finding("schema", fqn, f"{where} names file #{p.file}, but there are {n_files}"))
        if len(p.offsets) != len(tensor.shape) or len(p.lengths) != len(tensor.shape) or any(
                o < 0 or n_ < 0 or o + n_ > size for o, n_, size in zip(p.offsets, p.lengths, tensor.shape)):
            findings.append(Finding("schema", fqn, f"{where}: box {list(p.offsets)}+{list(p.lengths)} is not inside {list(tensor.shape)}"))
        elif p.count > math.prod(p.lengths):
            findings.append(Finding("schema", fqn, f"{where}: {p.count} elements, its box holds {math.prod(p.lengths)}"))
        if p.indices == p.values:
            findings.append(Finding("schema", fqn, f"{where}: indices and values under one key {p.indices!r}"))
    return findings


def _grid_problem(tensor: TensorEntry, spec: GridShards, n_files: int) -> str:
    if len(spec.cuts) != len(tensor.shape):
        return f"grid has {len(spec.cuts)} dims, tensor has {len(tensor.shape)}"
    for size, c in zip(tensor.shape, spec.cuts):
        if isinstance(c, int):
            if not 1 <= c <= max(size, 1):
                return f"grid chunk count {c} must be from 1 to the size {size}"
        elif len(c) < 2 or c[0] != 0 or c[-1] != size or any(b < a for a, b in zip(c, c[1:])):
            return f"grid cuts {list(c)} must rise from 0 to {size}"
    cells = grid_cell_count(tensor.shape, spec)
    if isinstance(spec.files, tuple):
        if len(spec.files) != cells:
            return f"grid has {cells} cells but {len(spec.files)} file entries"
        if spec.files and not 0 <= min(spec.files) <= max(spec.files) < n_files:
            return f"grid cells name files outside the {n_files} listed"
    elif cells and not grid_file(spec, cells - 1) < n_files:
        return f"grid cells name files beyond the {n_files} listed"
    elif cells > 1 and spec.files.step == 0:
        return f"grid puts its {cells} cells in one file under one key"
    return ""
