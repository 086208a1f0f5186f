"""The cost of block checksums (manifest 1.2): save and cold load with them, as shipped, against the
same operation with them patched out, and the bytes a partial load reads against what it needs.

The saves run first, their repeats in rotated order, then the loads likewise (so that each run
follows one of its kind), each in a fresh worker process (see `benchmarks.phases`):

- ``save`` / ``save, no block hashing``: ``ckptkit.save`` of the benchmark state, durable, as the
  save phase times it. Without block hashing (the checksums as they were before blocks), the
  worker replaces ``ckptkit.io.checksum.BlockHasher`` (what ``FileHasher`` feeds every payload
  byte to) with a stand-in that hashes every byte once with a whole-file xxh3-128 and gives zero
  digests of the right count: the manifest has the same shape, nothing is hashed block by block.
  As shipped, each byte is hashed once too, block by block (the file checksum is derived from the
  block digests).
- ``load`` / ``load, no block checks``: a cold ``ckptkit.load`` of whole tensors from a checkpoint
  written once, untimed, as shipped.
- ``load sharded`` / ``load sharded, no block checks``: the same checkpoint loaded cold as 3 ranks
  would resume at another topology: every tensor cut in 3 row blocks (as ``torch.chunk`` cuts
  dim 0), each rank's blocks one ``ckptkit.open(path).load(target)`` of ``ShardedTensor``
  targets, the 3 ranks one after the other in the one process (every byte of the state once).
  Without block checks, the worker's ``Reader`` gets the manifest with the files' block checksums
  removed (so it reads exactly the ranges its targets need: no end blocks, no header blocks), and
  a file read whole is hashed whole (xxh3-128), as loads checked files before blocks; partial
  reads hash nothing (they were not checked before blocks).

Throughput ratios (with / without) are paired per repeat. Untimed, once: the bytes read from the
payload files by partial loads (rank r of 4 loading its row block of every tensor, its column
block, and rank r of 3 its row block), counted at the storage, against the bytes of the boxes,
with block checks and without; and block hashing alone on one thread, in memory.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .state import TensorSpec

SAVE = "save"
SAVE_UNHASHED = "save, no block hashing"
LOAD = "load"
LOAD_UNCHECKED = "load, no block checks"
SHARDED = "load sharded"
SHARDED_UNCHECKED = "load sharded, no block checks"
TOOLS = (SAVE, SAVE_UNHASHED, LOAD, LOAD_UNCHECKED, SHARDED, SHARDED_UNCHECKED)
PAIRS = {"save": (SAVE, SAVE_UNHASHED), "load": (LOAD, LOAD_UNCHECKED), "load_sharded": (SHARDED, SHARDED_UNCHECKED)}
SHARDED_RANKS = 3  # the timed sharded load: row blocks of 3 ranks (block edges fall inside blocks)
# Partial loads counted: (name, ranks, dim to cut: 0 rows, -1 the last dim).
PARTIAL = (("rows of 4", 4, 0), ("columns of 4", 4, -1), ("rows of 3", 3, 0))
HASH_RUNS = 3
STEP = "step_1"


def source_dir(work: str) -> str:
    return os.path.join(work, "checksums", "source")


def save_dir(work: str, tool: str) -> str:
    return os.path.join(work, "checksums", tool.replace(" ", "-").replace(",", ""))


# --- the patches, applied in a worker process only ---------------------------------------------------


class UnhashedBlocks:
    """Stands in for ``ckptkit.io.checksum.BlockHasher`` as the checksums were before blocks: every
    byte goes through one whole-file xxh3-128 (the file checksum then), none is hashed block by
    block; its digests are zeros, one per block, so that the manifest entry is well-formed."""

    def __init__(self, block: int) -> None:
        import xxhash

        self.block = block
        self.nbytes = 0
        self._whole = xxhash.xxh3_128()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._whole.update(data)
        self.nbytes += memoryview(data).nbytes

    def finish(self) -> bytes:
        return bytes(8 * -(-self.nbytes // self.block))


def disable_block_hashing() -> None:
    """Make every save of this process skip block hashing (`FileHasher` looks the class up per file)."""
    from ckptkit.io import checksum

    checksum.BlockHasher = UnhashedBlocks  # type: ignore[misc]


def unchecked_reader() -> type:
    """A ``Reader`` that knows no block checksums (it reads exactly what its targets need and hashes
    nothing), and skips the whole-file check a checksum-less file would get."""
    import warnings

    from ckptkit.io import read

    # It would say, once, that the checkpoint "was written before block checksums": as made to look.
    warnings.filterwarnings("ignore", message=".*written before block checksums.*")

    class UncheckedReader(read.Reader):
        def __init__(self, loc: Any, manifest: Any, **kwargs: Any) -> None:
            files = tuple(f.model_copy(update={"blocks": None}) for f in manifest.files)
            super().__init__(loc, manifest.model_copy(update={"files": files}), **kwargs)

    def whole_file_hash(reader: Any, file: int, span: Any) -> Callable[[], None]:
        """As before blocks: a file read whole is hashed whole (xxh3-128; its digest is not compared,
        the checksum in the manifest being now of another kind)."""
        import xxhash

        def check() -> None:
            hasher = xxhash.xxh3_128(reader.headers[file][1])
            for _, view in span.segments:
                hasher.update(view)
            hasher.digest()

        return check

    read._whole_check = whole_file_hash  # type: ignore[assignment]
    return UncheckedReader


def disable_block_checks() -> None:
    """Make every load of this process use `unchecked_reader`."""
    from ckptkit.ops import load

    load.Reader = unchecked_reader()  # type: ignore[misc]


# --- boxes ---------------------------------------------------------------------------------------------


def rank_box(shape: tuple[int, ...], ranks: int, rank: int, dim: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The box rank `rank` of `ranks` holds when `dim` is cut as ``torch.chunk`` cuts it (None: empty)."""
    dim = dim % len(shape)
    step = -(-shape[dim] // ranks)
    lo, hi = min(rank * step, shape[dim]), min((rank + 1) * step, shape[dim])
    if lo >= hi:
        return None
    offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
    lengths = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
    return offsets, lengths


def rank_target(shapes: dict[str, tuple[int, ...]], ranks: int, rank: int, dim: int) -> dict[str, Any]:
    """Empty ``ShardedTensor`` targets of rank `rank`'s box of every tensor (fp32)."""
    import torch

    from ckptkit.state.sharded import ShardedTensor

    target = {}
    for name, shape in shapes.items():
        box = rank_box(shape, ranks, rank, dim)
        if box is not None:
            target[name] = ShardedTensor(torch.empty(box[1], dtype=torch.float32), shape, box[0])
    return target


def box_mismatches(targets: list[dict[str, Any]], specs: list[TensorSpec]) -> list[str]:
    """Compare the boxes loaded for three tensors of the state with the saved values."""
    import torch

    from .state import build_tensor

    problems = []
    for spec in {s.index: s for s in (specs[0], specs[len(specs) // 2], specs[-1])}.values():
        full = build_tensor(spec)
        for target in targets:
            st = target.get(spec.name)
            if st is None:
                continue
            index = tuple(slice(o, o + n) for o, n in zip(st.global_offsets, st.local.shape))
            if not torch.equal(st.local, full[index]):
                problems.append(f"{spec.name}: box at {list(st.global_offsets)} differs from the saved values")
    return problems


# --- in the worker process ------------------------------------------------------------------------------


def run(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    """One operation of the phase (in a fresh worker process)."""
    if request["kind"] == "checksums-prepare":
        return prepare(request, specs)
    if request["kind"] == "checksums-reads":
        return partial_reads(request, specs)
    tool = request["tool"]
    if tool in (SAVE, SAVE_UNHASHED):
        return timed_save(request, specs, hashed=tool == SAVE)
    return timed_load(request, specs, checked=tool in (LOAD, SHARDED), sharded=tool in (SHARDED, SHARDED_UNCHECKED))


def timed_save(request: dict[str, Any], specs: list[TensorSpec], hashed: bool) -> dict[str, Any]:
    from ckptkit.manifest import SIDECAR_SUFFIX
    from ckptkit.ops.load import open as open_checkpoint

    from .saves import save_ckptkit
    from .state import build_state
    from .worker import import_all, measure

    import_all(("ckptkit.ops.save",))
    if not hashed:
        disable_block_hashing()
    state = build_state(specs)
    _, figures = measure(lambda: save_ckptkit(state, request["directory"]))
    # Untimed: whether the digests are real (the patch took, or did not).
    checkpoint = os.path.join(request["directory"], STEP)
    files = open_checkpoint(checkpoint).manifest.files
    digests = [open(os.path.join(checkpoint, f.path + SIDECAR_SUFFIX), "rb").read() for f in files if f.sidecar()]
    figures["block_digests"] = "real" if any(any(d) for d in digests) else "zeros"
    return figures


def timed_load(request: dict[str, Any], specs: list[TensorSpec], checked: bool, sharded: bool) -> dict[str, Any]:
    from .loads import REQUIRES, touch_pages
    from .worker import go_cold, import_all, measure, spot_check

    import_all(REQUIRES["ckptkit"])
    from ckptkit.ops import load as ops_load

    if not checked:
        disable_block_checks()
    path = os.path.join(request["directory"], STEP)
    shapes = {s.name: s.shape for s in specs}
    cold = go_cold(request)

    def load_whole() -> dict[str, Any]:
        state = ops_load.load(path)
        touch_pages(state)
        return state

    def load_ranks() -> list[dict[str, Any]]:
        targets = []
        for rank in range(SHARDED_RANKS):  # each rank opens the checkpoint itself, as a resuming rank does
            target = rank_target(shapes, SHARDED_RANKS, rank, 0)
            ops_load.open(path).load(target)
            touch_pages({name: st.local for name, st in target.items()})
            targets.append(target)
        return targets

    if sharded:
        targets, figures = measure(load_ranks)
        figures["mismatches"] = box_mismatches(targets, specs)
    else:
        state, figures = measure(load_whole)
        figures["mismatches"] = spot_check(state, specs)
    figures.update(cold)
    return figures


def prepare(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    """Write the checkpoint the loads read (untimed, as shipped); time block hashing alone."""
    from ckptkit.io.checksum import BlockHasher, block_size_for

    from .saves import save_ckptkit
    from .state import build_state, state_bytes

    shutil.rmtree(request["directory"], ignore_errors=True)
    state = build_state(specs)
    save_ckptkit(state, request["directory"])
    os.sync()
    views = [memoryview(t.numpy()).cast("B") for t in state.values()]
    runs = []
    for _ in range(HASH_RUNS):
        start = time.perf_counter()
        hasher = BlockHasher(block_size_for(state_bytes(specs)))
        for view in views:
            hasher.update(view)
        hasher.finish()
        runs.append(time.perf_counter() - start)
    return {"block_hash_s": statistics.median(runs), "block_hash_runs": runs}


def counting_storage(root: str) -> Any:
    """A local storage of `root` that counts the bytes read from payload files (``*.safetensors``)."""
    from ckptkit.storage.local import LocalStorage

    class Counting(LocalStorage):
        def __init__(self, root: str) -> None:
            super().__init__(root)
            self.payload_bytes = 0
            self.requests = 0
            self._lock = threading.Lock()

        def _count(self, key: str, n: int) -> None:
            if key.endswith(".safetensors"):
                with self._lock:
                    self.payload_bytes += n
                    self.requests += 1

        def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
            data = super().read(key, offset, length)
            self._count(key, len(data))
            return data

        def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:  # readinto calls it too
            super().readv(key, offset, buffers)
            self._count(key, sum(b.nbytes for b in buffers))

    return Counting(root)


def partial_reads(request: dict[str, Any], specs: list[TensorSpec]) -> dict[str, Any]:
    """Count the bytes partial loads read from the payload files, with block checks and without."""
    from ckptkit.io.payload import open_checkpoint
    from ckptkit.io.read import Reader
    from ckptkit.ops.load import fill

    from ckptkit.state.torch_io import leaf_shards

    readers: dict[str, Callable[..., Any]] = {"checked": Reader}
    shapes = {s.name: s.shape for s in specs}
    out: dict[str, Any] = {}
    for variant in ("checked", "unchecked"):
        if variant == "unchecked":
            readers["unchecked"] = unchecked_reader()
        for name, ranks, dim in PARTIAL:
            per_rank = []
            for rank in range(ranks):  # each rank reads alone, with its own reader, as on its own node
                storage = counting_storage(request["directory"])
                loc, manifest = open_checkpoint(STEP, storage)
                reader = readers[variant](loc, manifest)
                target = rank_target(shapes, ranks, rank, dim)
                fill(reader, {fqn: leaf_shards(st) for fqn, st in target.items()})
                needed = sum(st.local.numel() * st.local.element_size() for st in target.values())
                problems = box_mismatches([target], specs)
                if problems:
                    raise RuntimeError(f"{name}, rank {rank}, {variant}: {problems[:2]}")
                counts = {"needed_bytes": needed, "storage_bytes": storage.payload_bytes,
                          "reader_bytes": reader.bytes_read, "requests": storage.requests}
                if variant == "checked":
                    counts["touched_block_bytes"] = touched_block_bytes(reader, [(fqn, st.box) for fqn, st in target.items()])
                per_rank.append(counts)
            needed = sum(r["needed_bytes"] for r in per_rank)
            read = sum(r["storage_bytes"] for r in per_rank)
            out.setdefault(name, {})[variant] = {
                "ranks": ranks,
                "needed_bytes": needed,
                "storage_bytes": read,
                "reader_bytes": sum(r["reader_bytes"] for r in per_rank),
                "amplification": read / needed,
                "worst_rank": max(r["storage_bytes"] / r["needed_bytes"] for r in per_rank),
                "per_rank": per_rank,
            }
            if variant == "checked":
                touched = sum(r["touched_block_bytes"] for r in per_rank)
                out[name][variant].update(touched_block_bytes=touched, block_bound=touched / needed)
    return {"partial": out}


def touched_block_bytes(reader: Any, requests: list[tuple[str, Any]]) -> int:
    """The bytes of the blocks a rank's boxes (`requests`: fqn and box) touch, and of those holding
    each file's header: the least any reader that checks whole blocks must read for them (after
    `reader` filled them: it holds the files' headers)."""
    from ckptkit.boxes import byte_runs
    from ckptkit.manifest.dtypes import itemsize
    from ckptkit.plan.load import plan_load

    manifest = reader.manifest
    touched: dict[int, set[int]] = {}
    for plan in plan_load(manifest, requests).targets:
        dtype = manifest.tensors[plan.fqn].dtype
        for read in plan.reads:
            b = manifest.files[read.file].blocks.size
            begin = reader.begin(read, dtype)
            runs = byte_runs(read.src_box, read.overlap, itemsize(dtype))
            blocks = touched.setdefault(read.file, set())
            for offset in runs.offsets():
                lo = begin + int(offset)
                blocks.update(range(lo // b, (lo + runs.run_length - 1) // b + 1))
    total = 0
    for file, blocks in touched.items():
        entry = manifest.files[file]
        b = entry.blocks.size
        blocks.update(range(-(-len(reader.headers[file][1]) // b)))
        total += sum(min(b, entry.size - k * b) for k in blocks)
    return total


# --- in the parent ------------------------------------------------------------------------------------


def per_repeat_ratios(runs: dict[str, list[dict[str, Any]]], subject: str, other: str) -> list[float]:
    """Subject's throughput over other's, per repeat (other's seconds / subject's)."""
    return [b["seconds"] / a["seconds"] for a, b in zip(runs.get(subject, []), runs.get(other, []))
            if "error" not in a and "error" not in b]


def summary(runs: dict[str, list[dict[str, Any]]], prepared: dict[str, Any], reads: dict[str, Any]) -> dict[str, Any]:
    """Medians per tool, the paired throughput ratios with / without, hashing alone, the read amplification."""
    from .report import summarize

    tools = summarize(runs, "checksums")
    block: dict[str, Any] = {"tools": tools, "ratios": {}, "per_repeat": {}}
    for key, (subject, other) in PAIRS.items():
        pairs = per_repeat_ratios(runs, subject, other)
        block["per_repeat"][key] = pairs
        block["ratios"][key] = statistics.median(pairs) if pairs else None
    if "error" not in prepared:
        hash_s = prepared["block_hash_s"]
        nbytes = prepared["state_bytes"]
        block["block_hashing"] = {"seconds": hash_s, "gb_per_s": nbytes / hash_s / 1e9}
        save_s = tools.get(SAVE, {}).get("median_s")
        if save_s:
            block["block_hashing"]["share_of_save"] = hash_s / save_s
    else:
        block["block_hashing"] = {"error": prepared["error"]}
    block["partial"] = reads.get("partial", {"error": reads.get("error")})
    return block
