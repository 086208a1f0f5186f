"""Checks of a manifest against itself: safe paths, valid shard specs, exact tiling (pure).

Every finding is collected; callers raise once or report them all.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..boxes import tiling_problems
from .dtypes import DTYPES
from ..errors import StorageError
from .model import GridShards, Manifest, TensorEntry
from .shards import grid_cell_count, grid_file, iter_shards
from ..storage import check_key


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
    findings: list[Finding] = []
    seen: set[str] = set()
    for entry in manifest.files:
        try:
            check_key(entry.path)
        except StorageError:
            findings.append(Finding("path", entry.path, "path escapes the checkpoint (absolute, '..' or empty segment)"))
        if entry.path in seen:
            findings.append(Finding("path", entry.path, "listed twice in files"))
        seen.add(entry.path)
        blocks = entry.blocks
        if blocks is not None and len(blocks.raw()) != 8 * -(-entry.size // blocks.size):
            findings.append(Finding("schema", entry.path, f"block checksums do not describe {-(-entry.size // blocks.size)} "
                                                          f"blocks of {blocks.size} bytes (base64 of 8 bytes each)"))
        elif entry.checksum.startswith("xxh3-128-blocks:") and (blocks is None or entry.checksum != blocks.file_checksum()):
            findings.append(Finding("checksum", entry.path, "file checksum does not match its block checksums"))
    for fqn, tensor in manifest.tensors.items():
        findings += _tensor_findings(fqn, tensor, len(manifest.files))
    if not findings:  # every spec is sound, so expanding the shards is bounded by the files
        findings += _mapping_findings(manifest)
    return findings


def _mapping_findings(manifest: Manifest) -> list[Finding]:
    """Each shard's bytes are its own: no two shards name the same key of the same file, and a
    raw file holds exactly one shard, of the file's size (or, for a zarr chunk at the edge of
    its array, of the size of the array's largest chunk: the padding the zarr form writes)."""
    findings = []
    owner: dict[tuple[int, str], str] = {}
    raw: dict[int, list[tuple[str, int, int]]] = {}
    for fqn, tensor in manifest.tensors.items():
        shards = list(iter_shards(tensor))
        largest = max((s.box.volume for s in shards), default=0) * DTYPES[tensor.dtype][0]
        for s in shards:
            if (s.file, s.key) in owner:
                findings.append(Finding("mapping", fqn, f"two shards read key {s.key!r} of {manifest.files[s.file].path} "
                                                        f"(the other of {owner[s.file, s.key]})"))
            owner[s.file, s.key] = fqn
            nbytes = s.box.volume * DTYPES[tensor.dtype][0]
            if nbytes > manifest.files[s.file].size:  # a shape no file can hold (a load would allocate it first)
                findings.append(Finding("mapping", fqn, f"a shard of {nbytes} bytes cannot be in "
                                                        f"{manifest.files[s.file].path} ({manifest.files[s.file].size} bytes)"))
            if manifest.files[s.file].encoding == "raw":
                raw.setdefault(s.file, []).append((fqn, s.box.volume * DTYPES[tensor.dtype][0], largest))
    for index, entry in enumerate(manifest.files):
        if entry.encoding != "raw" or entry.role != "tensors":
            continue
        held = raw.get(index, [])
        if len(held) != 1:
            findings.append(Finding("mapping", entry.path, f"a raw file holds exactly one shard, this one is named by {len(held)}"))
        elif entry.size not in held[0][1:]:
            findings.append(Finding("mapping", entry.path, f"raw file of {entry.size} bytes holds a shard of {held[0][1]} bytes"))
    return findings


def _tensor_findings(fqn: str, tensor: TensorEntry, n_files: int) -> list[Finding]:
    if tensor.dtype not in DTYPES:
        return [Finding("schema", fqn, f"unknown dtype {tensor.dtype!r}")]
    if any(d < 0 for d in tensor.shape):
        return [Finding("schema", fqn, f"negative size in shape {list(tensor.shape)}")]
    spec = tensor.shards
    if isinstance(spec, GridShards):
        # Rising cuts from 0 to the size tile the tensor by construction: no need to expand cells.
        problem = _grid_problem(tensor, spec, n_files)
        return [Finding("tiling", fqn, problem)] if problem else []
    shards = list(iter_shards(tensor))
    findings = []
    for s in shards:
        if not 0 <= s.file < n_files:
            findings.append(Finding("schema", fqn, f"shard at {list(s.box.offsets)} names file #{s.file}, but there are {n_files}"))
    if findings:
        return findings
    for problem in tiling_problems(tensor.shape, [s.box for s in shards]):
        findings.append(Finding("tiling", fqn, problem))
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
