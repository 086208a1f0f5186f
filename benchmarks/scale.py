"""Manifest handling at scale: a synthetic manifest of many tensors written by many ranks.

Most tensors are FSDP-style: dim 0 chunked (as torch.chunk cuts) across every rank, rank r
writing file r, which compacts to a grid with a file range. The tensors of every tenth layer are
instead ZeRO-style: all those tensors are flattened into one buffer, cut into equal flat ranges over
the data-parallel ranks, and each range becomes the irregular boxes of
``flat_range_to_boxes`` in that DP rank's file. No tensor bytes exist; only the manifest. Every payload file has block checksums as a save
writes them (schema 1.5: the digests in the file's sidecar, the manifest holding the block size
and the file checksum that covers them); ``inline_digest_bytes`` is what the digests would add
to the manifest in base64, as schema 1.4 kept them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ckptkit.boxes import Box, chunk_cuts, flat_range_to_boxes
from ckptkit.manifest.consistency import manifest_findings
from ckptkit.io.checksum import block_size_for
from ckptkit.manifest import BlockChecksums, FileEntry, Manifest, Producer, TensorEntry, Topology, manifest_to_json, parse_manifest
from ckptkit.manifest.model import Shard
from ckptkit.manifest.shards import compact_shards

# Shapes of an 8B-class transformer layer: q/o, k/v, gate/up, down, norm.
SHAPES: tuple[tuple[int, ...], ...] = ((4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (4096,))
ZERO_EVERY = 10  # the tensors of every tenth layer are ZeRO-partitioned
# Megatron's distributed optimizer packs parameters into buckets of about 40M elements.
BUCKET_ELEMENTS = 40_000_000
ELEMENT_BYTES = 4


@dataclass(frozen=True, slots=True)
class ScaleResult:
    """Seconds per stage, the manifest's JSON size, and what it holds."""

    inputs_s: float
    build_s: float
    validate_s: float
    serialize_s: float
    parse_s: float
    json_bytes: int
    inline_digest_bytes: int
    tensors: int
    ranks: int
    grid_tensors: int
    box_tensors: int
    boxes: int


def fsdp_boxes(shape: tuple[int, ...], ranks: int) -> list[tuple[int, Box]]:
    """Return (rank, box) of every non-empty chunk of `shape` cut on dim 0 over `ranks`."""
    cuts = chunk_cuts(shape[0], ranks)
    rest = shape[1:]
    zeros = (0,) * len(rest)
    return [(r, Box((cuts[r], *zeros), (cuts[r + 1] - cuts[r], *rest))) for r in range(ranks) if cuts[r + 1] > cuts[r]]


def zero_shards(tensors: dict[str, tuple[int, ...]], dp: int, ranks: int) -> dict[str, list[Shard]]:
    """Return the boxes of ZeRO-partitioned tensors: bucket them, cut each bucket across DP ranks.

    Tensors are packed in order into buckets of about `BUCKET_ELEMENTS`; each bucket's flat
    concatenation is cut into `dp` equal ranges, DP rank d writing file d * ranks // dp.
    """
    shards: dict[str, list[Shard]] = {}
    bucket: dict[str, tuple[int, ...]] = {}
    for fqn, shape in tensors.items():
        bucket[fqn] = shape
        if sum(math.prod(s) for s in bucket.values()) >= BUCKET_ELEMENTS:
            shards.update(bucket_shards(bucket, dp, ranks))
            bucket = {}
    shards.update(bucket_shards(bucket, dp, ranks))
    return shards


def bucket_shards(tensors: dict[str, tuple[int, ...]], dp: int, ranks: int) -> dict[str, list[Shard]]:
    """Cut the flat concatenation of `tensors` into `dp` equal ranges, DP rank d in file d * ranks // dp."""
    if not tensors:
        return {}
    total = sum(math.prod(s) for s in tensors.values())
    part = -(-total // dp)
    shards: dict[str, list[Shard]] = {fqn: [] for fqn in tensors}
    start = 0
    for fqn, shape in tensors.items():
        numel = math.prod(shape)
        for d in range(start // part, min(dp, -(-(start + numel) // part))):
            lo, hi = max(start, d * part) - start, min(start + numel, (d + 1) * part) - start
            for k, box in enumerate(flat_range_to_boxes(shape, lo, hi)):
                shards[fqn].append(Shard(box, d * ranks // dp, f"{fqn}#{d}.{k}"))
        start += numel
    return shards


def tensor_shapes(n_tensors: int) -> dict[str, tuple[int, ...]]:
    """Return the names and shapes of the synthetic model's tensors."""
    return {f"model/layers.{i // len(SHAPES)}/w{i % len(SHAPES)}": SHAPES[i % len(SHAPES)] for i in range(n_tensors)}


def file_entries(ranks: int, shapes: dict[str, tuple[int, ...]]) -> tuple[FileEntry, ...]:
    """Return one payload file per rank, each holding an equal share of the bytes, with block
    checksums whose digests are in the file's sidecar."""
    size = sum(math.prod(s) for s in shapes.values()) * ELEMENT_BYTES // ranks
    blocks = BlockChecksums(size=block_size_for(size))
    return tuple(
        FileEntry(path=f"rank{r:05d}.safetensors", size=size, checksum=f"xxh3-128-blocks:{r:032x}", blocks=blocks)
        for r in range(ranks)
    )


def inline_digest_bytes(files: tuple[FileEntry, ...]) -> int:
    """The bytes the files' block digests would take in the manifest in base64 (``"digests":"..."``, schema 1.4)."""
    return sum(len(',"digests":""') + 4 * -(-8 * f.blocks.count(f.size) // 3) for f in files if f.blocks is not None)


def build_entries(
    shapes: dict[str, tuple[int, ...]], ranks: int, dp: int
) -> tuple[dict[str, TensorEntry], float, float]:
    """Make every tensor's shards and compact them into manifest entries.

    Returns:
        The entries, the seconds spent making Shard lists (the input a save gathers) and the
        seconds spent in ``compact_shards`` and the entry models (the build).
    """
    zero = {fqn: s for i, (fqn, s) in enumerate(shapes.items()) if i // len(SHAPES) % ZERO_EVERY == ZERO_EVERY - 1}
    start = time.perf_counter()
    zero_by_fqn = zero_shards(zero, dp, ranks)
    # Boxes depend only on the shape; sharing them keeps the inputs from dominating the run.
    boxes_by_shape = {shape: fsdp_boxes(shape, ranks) for shape in set(shapes.values())}
    inputs_s = time.perf_counter() - start
    build_s = 0.0
    entries: dict[str, TensorEntry] = {}
    for fqn, shape in shapes.items():
        start = time.perf_counter()
        if fqn in zero:
            shards = zero_by_fqn[fqn]
        else:
            shards = [Shard(box, r, fqn) for r, box in boxes_by_shape[shape]]
        made = time.perf_counter()
        spec = compact_shards(shape, shards)
        entries[fqn] = TensorEntry(shape=shape, dtype="float32", kind="param", shards=spec)
        build_s += time.perf_counter() - made
        inputs_s += made - start
    return entries, inputs_s, build_s


def build_manifest(n_tensors: int, ranks: int, dp: int) -> tuple[Manifest, float, float]:
    """Return the synthetic manifest, the seconds spent on its inputs, and on building it."""
    shapes = tensor_shapes(n_tensors)
    entries, inputs_s, build_s = build_entries(shapes, ranks, dp)
    start = time.perf_counter()
    manifest = Manifest(
        checkpoint_id="0" * 32,
        step=1000,
        created_at="2024-06-11T00:00:00+00:00",
        producer=Producer(ckptkit="bench"),
        topology=Topology(world_size=ranks, dp=ranks, zero_stage=3),
        files=file_entries(ranks, shapes),
        tensors=entries,
    )
    return manifest, inputs_s, build_s + time.perf_counter() - start


def validate_and_serialize(manifest: Manifest) -> tuple[float, float, bytes]:
    """Check `manifest` against itself, then write it: the seconds of each, and its JSON.

    Raises:
        RuntimeError: the manifest has findings.
    """
    start = time.perf_counter()
    findings = manifest_findings(manifest)
    validate_s = time.perf_counter() - start
    if findings:
        raise RuntimeError(f"synthetic manifest has {len(findings)} finding(s), e.g. {findings[0]}")
    start = time.perf_counter()
    data = manifest_to_json(manifest)
    return validate_s, time.perf_counter() - start, data


def run_scale(n_tensors: int, ranks: int, dp: int) -> ScaleResult:
    """Build, validate, serialize and parse the synthetic manifest, timing each stage.

    Raises:
        RuntimeError: the manifest has findings, or does not survive a JSON round trip.
    """
    manifest, inputs_s, build_s = build_manifest(n_tensors, ranks, dp)
    validate_s, serialize_s, data = validate_and_serialize(manifest)
    start = time.perf_counter()
    parsed = parse_manifest(data)
    parse_s = time.perf_counter() - start
    if parsed != manifest:
        raise RuntimeError("the parsed manifest differs from the one serialized")
    grids = sum(1 for e in manifest.tensors.values() if e.shards.layout == "grid")
    boxes = sum(len(e.shards.boxes) for e in manifest.tensors.values() if e.shards.layout == "boxes")
    return ScaleResult(
        inputs_s, build_s, validate_s, serialize_s, parse_s, len(data), inline_digest_bytes(manifest.files),
        n_tensors, ranks, grids, len(manifest.tensors) - grids, boxes,
    )
