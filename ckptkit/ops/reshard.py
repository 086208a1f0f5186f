"""Offline resharding: write the checkpoint another topology would have saved (no torch).

Call order: every process opens the source and plans (pure, the same everywhere); rank 0
checks the destination; every process writes its share of the target files, each file
streamed piece by piece from the source shards on a few threads with bounded memory,
while the source checksums are checked alongside; rank 0 commits as a save does:
manifest last, rename, latest pointer. Nothing is written before the plan succeeded, and
a failed or interrupted reshard leaves no committed destination.
"""

from __future__ import annotations

import datetime
import math
import mmap
import os
import platform
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from .. import __version__
from ..boxes import Box, flat_range_to_boxes
from ..io.catalog import Location, is_run_root, locate, read_latest, refuse_nesting, still_committed
from ..io.commit import Staging, commit, discard, refuse_existing, staging
from ..io.checksum import hasher_for
from ..io.read import PIECE, SMALL_RUN, Reader, byte_shape
from ..io.write import Written, write_safetensors
from .collective import default_collective, guard, unwrap
from .convert import Progress
from ..manifest.dtypes import itemsize
from ..errors import IntegrityError, StorageError, summarize
from ..layouts import Layout, layout_for
from ..manifest import FileEntry, Manifest, Producer, Topology, manifest_to_json
from ..manifest.model import Derived, DerivedGroup
from ..layouts.saved import RULE
from ..io.payload import open_checkpoint, read_checked
from ..plan.load import Read, ShardLookup, TargetPlan
from ..plan.reshard import FileJob, ReshardPlan, collector_paused, plan_reads, plan_reshard
from ..plan.save import ItemDesc, tensor_entries
from ..storage.local import open_regular
from ..storage import Storage
from .verify import checksum_findings

# A target file is filled and written PIECE bytes at a time (each writer thread holds one piece
# buffer, and the engine's scratch, whatever the size of the tensors); source runs shorter than
# SMALL_RUN are read as their whole span and gathered (see ckptkit.io.read).
THREADS = 4


class ReshardReport(BaseModel):
    """What ``ckptkit reshard --json`` prints."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    source: str
    destination: str
    step: int
    source_topology: Topology
    topology: Topology
    tensors: int
    unplaced: list[str]  # tensors the layout does not place, kept with their saved boxes (per-rank RNG states)
    files: int
    bytes_written: int
    bytes_read: int
    source_checked: bool
    latest_moved: bool  # the destination root's latest pointer now names the destination
    latest: str | None  # what the destination root's latest pointer names afterwards (null: none)
    seconds: float


def reshard(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    topology: Topology,
    *,
    threads: int = THREADS,
    files_per_rank: int | None = None,
    max_file_bytes: int | None = None,
    check_source: bool = True,
    update_latest: bool = True,
    layout: Layout | None = None,
    process_group: Any = None,
    storage: Storage | None = None,
    dst_storage: Storage | None = None,
    progress: Progress | None = None,
) -> ReshardReport:
    """Write the checkpoint at `src` as the checkpoint `topology`'s ranks would have saved, at `dst`.

    Every tensor is copied bitwise: the parameters and optimizer state the model's layout
    places (from ``info.model``) get the target's boxes; other tensors (RNG rows) keep their
    saved boxes. Non-tensor values, training assets (``info``) and tokenizer files are copied
    unchanged. Under torch.distributed every rank of the group calls this with the same
    arguments and writes a share of the target files.

    Args:
        src: a committed checkpoint, or a root whose ``latest`` names one.
        dst: the checkpoint directory to create.
        topology: the target; ``world_size`` must be tp x pp x dp.
        threads: target files each process writes at once.
        files_per_rank: payload files per target rank; given, the target lists its boxes (default: one
            per rank, its layout tensors derived as a save with the layout has them, manifest 1.6).
        max_file_bytes: start a new payload file when one would grow past this.
        check_source: check every source file's checksum while copying; the destination is
            committed only if they all match.
        update_latest: move the latest pointer of `dst`'s root to it, when that root is a run's
            (it holds ``latest`` or a run record, or is new) and the step is higher than the
            one ``latest`` names; a reshard never moves ``latest`` back, nor writes one into a
            directory that is not a run root (such as the working directory).
        layout: where the target's ranks hold which boxes (default: the layout the source records, or
            the built-in layout of the family its ``info.model`` names); the target records it.
        storage: read `src` through this backend (names under its root).
        dst_storage: write `dst` through this backend (names under its root).
        progress: called with (bytes written, bytes this process writes) as the target files fill.

    Raises:
        LayoutError: the model cannot be laid out over `topology` (before anything is written).
        CheckpointExistsError: something exists at `dst`.
        IntegrityError: a source file does not match its manifest; nothing was committed.
        StorageError: a read or write failed; nothing was committed.
    """
    started = time.perf_counter()
    src_loc, manifest = open_checkpoint(src, storage)
    layout = layout if layout is not None else layout_for(manifest, where=str(src_loc))
    topology = topology.model_copy(update={"rank_order": "-".join(layout.mesh)})
    plan = plan_reshard(manifest, layout, topology, files_per_rank=files_per_rank, max_file_bytes=max_file_bytes)
    with still_committed(src_loc):
        return write_reshard(src_loc, manifest, plan, dst, threads=threads, check_source=check_source,
                             update_latest=update_latest, process_group=process_group, dst_storage=dst_storage, started=started,
                             progress=progress)


def write_reshard(
    src_loc: Location,
    manifest: Manifest,
    plan: ReshardPlan,
    dst: str | os.PathLike[str],
    *,
    threads: int = THREADS,
    check_source: bool = True,
    update_latest: bool = True,
    process_group: Any = None,
    dst_storage: Storage | None = None,
    started: float | None = None,
    progress: Progress | None = None,
) -> ReshardReport:
    """Write and commit the target a finished `plan` describes, from the source checkpoint
    (`src_loc`, `manifest`), at `dst`; the I/O half of `reshard` (same arguments, same errors)."""
    started = time.perf_counter() if started is None else started
    coll = default_collective(process_group)
    topology = plan.topology
    dst_loc = locate(dst, dst_storage)
    refuse_nesting(src_loc, dst_loc)
    uid, run_root = unwrap(coll.broadcast(guard(lambda: _claim(dst_loc)) if coll.rank == 0 else None))
    stage = staging(dst_loc, uid)
    mine = [job for job in plan.jobs if job.rank % coll.world_size == coll.rank]
    checked = [i for i, f in enumerate(manifest.files) if f.role == "tensors" and i % coll.world_size == coll.rank]
    try:
        written = guard(
            lambda: _write_jobs(src_loc, manifest, dst_loc.storage, stage, mine, threads, checked if check_source else [],
                                _Counter(progress, sum(job.nbytes for job in mine)))
        )
        results = coll.gather(written)
        outcome: tuple[str, Any] = ("ok", None)
        if results is not None:
            outcome = guard(lambda: _commit(results, plan, src_loc, manifest, dst_loc, stage, update_latest and run_root))
            if outcome[0] != "ok":
                discard(dst_loc.storage, stage)
        bytes_read, moved, latest = unwrap(coll.broadcast(outcome))
    except BaseException:
        if coll.world_size == 1:  # interrupted: leave no temporary directory behind
            discard(dst_loc.storage, stage)
        raise
    return ReshardReport(
        source=str(src_loc),
        destination=str(dst_loc),
        step=manifest.step,
        source_topology=manifest.topology,
        topology=topology,
        tensors=len(manifest.tensors),  # every tensor of the source, placed anew or kept
        unplaced=list(plan.kept),
        files=len(plan.jobs),
        bytes_written=plan.nbytes,
        bytes_read=bytes_read,
        source_checked=check_source,
        latest_moved=moved,
        latest=latest,
        seconds=round(time.perf_counter() - started, 3),
    )


def _claim(loc: Location) -> tuple[str, bool]:
    """Check that the destination is free; return the id of the files being written and whether
    the destination's root is a run root (decided before anything is written into it)."""
    refuse_existing(loc)
    return uuid.uuid4().hex[:12], is_run_root(loc.storage)


class _Counter:
    """Bytes written so far by the writer threads, passed on to a progress callback."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        if self.progress is None:
            return
        with self.lock:
            self.done += n
            self.progress(self.done, self.total)


def _write_jobs(
    src_loc: Location, manifest: Manifest, dst: Storage, stage: Staging, jobs: list[FileJob], threads: int, checked: list[int],
    counter: _Counter,
) -> tuple[list[Written], int]:
    """Write this process's target files; return them and the bytes read from the source."""
    lookup = ShardLookup(manifest)
    with collector_paused():
        reads = {job.plan.path: plan_reads(manifest, job, lookup) for job in jobs}
    # Each writer thread fills one piece per call: it keeps the scratch of a piece between calls.
    reader = Reader(src_loc, manifest, piece=PIECE, small_run=SMALL_RUN, keep_scratch=2 * PIECE)
    files = sorted({r.file for targets in reads.values() for target in targets for r in target.reads})
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for _ in pool.map(reader.header_of, files):
            pass
    local = threading.local()
    order = sorted(jobs, key=lambda j: -j.nbytes)  # largest first: the threads finish together

    def write(job: FileJob) -> Written:
        return _write_job(reader, dst, stage.key(job.plan.path), job, reads[job.plan.path], local, counter)

    # Files with block checksums are checked by every read; older ones are hashed whole alongside.
    whole = [i for i in checked if manifest.files[i].blocks is None]
    with ThreadPoolExecutor(max_workers=1) as checker, ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        findings = checker.submit(_check_sources, src_loc, manifest, whole)
        written = list(pool.map(write, order))
        problems = findings.result()
    if problems:
        raise IntegrityError("the source does not match its manifest: " + summarize(problems))
    return written, reader.bytes_read


def _check_sources(loc: Location, manifest: Manifest, files: list[int]) -> list[str]:
    """Check the whole-file checksums of source payload files; return the problems.

    Local files are hashed through a read-only memory map: the pages the copy threads read
    are hashed in place from the page cache, without a second copy into this process.
    """
    if not loc.storage.capabilities.local_files:
        return [f"{loc}/{f.where}: {f.message}" for f in checksum_findings(loc, manifest, files, 1, None)[0]]
    problems = []
    for index in files:
        entry = manifest.files[index]
        hasher = hasher_for(entry.checksum)
        try:
            fd, size = open_regular(loc.storage.local_path(loc.file_key(entry)))
            with os.fdopen(fd, "rb") as f:
                if size:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                        mapped.madvise(mmap.MADV_SEQUENTIAL)
                        view = memoryview(mapped)
                        for offset in range(0, size, PIECE):
                            hasher.update(view[offset : offset + PIECE])
                        view.release()
        except OSError as exc:
            problems.append(f"{loc.file_str(entry)}: cannot read ({exc.strerror or exc})")
            continue
        if size != entry.size or hasher.digest() != entry.checksum:
            problems.append(f"{loc.file_str(entry)}: content hashes to {hasher.digest()}, manifest says {entry.checksum}")
    return problems


def _write_job(
    reader: Reader, dst: Storage, key: str, job: FileJob, reads: tuple[TargetPlan, ...], local: threading.local,
    counter: _Counter,
) -> Written:
    if not hasattr(local, "piece"):  # one piece buffer per thread, allocated once
        local.piece = np.empty(PIECE, dtype=np.uint8)

    def bodies() -> Iterator[memoryview]:
        for (item, _), target in zip(job.plan.items, reads):
            for piece in _pieces(reader, item, target, local.piece):
                yield piece
                counter.add(piece.nbytes)

    tensors = [(k, item.dtype, item.box.lengths) for item, k in job.plan.items]
    return write_safetensors(dst, key, job.plan.path, tensors, bodies())


def _pieces(reader: Reader, item: ItemDesc, target: TargetPlan, piece: np.ndarray) -> Iterator[memoryview]:
    """Yield the item's bytes in row-major order, at most PIECE bytes at a time."""
    size = itemsize(item.dtype)
    lengths = item.box.lengths
    total = item.box.volume
    row = math.prod(lengths[1:]) if lengths else 1
    step = max(1, PIECE // (row * size)) * row if row * size <= PIECE else PIECE // size
    for start in range(0, total, step):
        stop = min(start + step, total)
        view = piece[: (stop - start) * size]
        plans, dests = [], []
        pos = 0
        for sub in flat_range_to_boxes(lengths, start, stop):
            part = Box(tuple(o + a for o, a in zip(sub.offsets, item.box.offsets)), sub.lengths)
            n = part.volume * size
            found = [(r, r.overlap.intersect(part) if part.ndim else r.overlap) for r in target.reads]
            plans.append(TargetPlan(item.fqn, part, tuple(Read(r.file, r.key, r.src_box, o) for r, o in found if o is not None)))
            dests.append(view[pos : pos + n].reshape(byte_shape(part.lengths, size)))
            pos += n
        reader.fill(plans, dests)
        yield view.data


def _commit(
    results: list[Any], plan: ReshardPlan, src_loc: Location, manifest: Manifest, loc: Location, stage: Staging, update_latest: bool
) -> tuple[int, bool, str | None]:
    """Commit the target; return the bytes read, whether ``latest`` moved and what it names."""
    failed = [(r, res[1]) for r, res in enumerate(results) if res[0] != "ok"]
    if failed:
        said = [message if len(results) == 1 else f"rank {r}: {message}" for r, (_, message) in failed]
        unwrap(("error", (failed[0][1][0], "nothing committed: " + summarize(said))))
    written = {w.path: w for res in results for w in res[1][0]}
    planned = [j.plan for j in plan.jobs] if plan.derived is not None else plan.save.all_files()
    files = [written[f.path].entry(stage.path(f.path)) for f in planned]
    index = {f.path: i for i, f in enumerate(planned)}
    files += [_copy_asset(src_loc, loc.storage, stage, entry) for entry in manifest.files if entry.role in ("tokenizer", "asset")]
    target = Manifest(
        checkpoint_id=uuid.uuid4().hex,
        step=manifest.step,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        producer=Producer(ckptkit=__version__, python=platform.python_version()),
        topology=plan.topology,
        files=tuple(files),
        tensors=tensor_entries(plan.save, index, lambda fqn: manifest.tensors[fqn].kind),
        objects=manifest.objects,
        info=manifest.info,
        layout=manifest.layout if plan.layout is None else plan.layout.to_json(),
        derived=None if plan.derived is None else Derived(
            rule=RULE, groups={label: DerivedGroup(dtype=dtype, kind=kind) for label, (dtype, kind) in plan.derived.items()}),  # type: ignore[arg-type]
        tokenizer=None if manifest.tokenizer is None else manifest.tokenizer.model_copy(
            update={"files": tuple(stage.path(f) for f in manifest.tokenizer.files)}),
    )
    moved = commit(loc, stage, manifest_to_json(target), update_latest=update_latest, step=manifest.step)
    return sum(res[1][1] for res in results), moved, _latest_name(loc.storage)


def _latest_name(root: Storage) -> str | None:
    try:
        return read_latest(root) or None
    except (IntegrityError, StorageError):
        return None


def _copy_asset(src_loc: Location, dst: Storage, stage: Staging, entry: FileEntry) -> FileEntry:
    """Copy a non-tensor file (tokenizer, asset) unchanged, checking it against its checksum; it
    keeps its path (under the writer's prefix where the storage cannot rename)."""
    dst.write(stage.key(entry.path), [read_checked(src_loc, entry)])
    return entry.model_copy(update={"path": stage.path(entry.path), "base": None, "contents": None})
