"""What every export format shares: the source being read, the export report (no torch)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from .convert import convert
from ..io.catalog import Location
from ..io.checksum import checksum_of
from ..io.commit import REPORT_NAME
from ..manifest.dtypes import itemsize
from ..manifest import Manifest, Topology
from ..boxes import Box
from ..io.read import Reader, byte_shape
from ..storage import Storage
from ..ops.reports import SkippedEntry

if TYPE_CHECKING:
    from ..ops.convert import Progress
    from ..models.compose import Run

READ_THREADS = 4
AHEAD_THREADS = 3
AHEAD_BYTES = 128 << 20
SCRATCH_BYTES = 128 << 20  # the read buffers of converted tensors kept for the next ones (fresh memory costs its faults)


@dataclass
class Source:
    """The checkpoint being exported: its location, checked manifest, the reader that checks
    every byte it returns, and the threads that read it. Use as a context manager (the threads
    stop at exit)."""

    loc: Location
    manifest: Manifest
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(READ_THREADS))
    reader: Reader = field(init=False)
    progress: Progress | None = None  # called with (bytes read, bytes expected) after each tensor
    expected: int = 0
    done: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    scratch: list[np.ndarray[Any, Any]] = field(default_factory=list)  # idle read buffers, largest first

    def __post_init__(self) -> None:
        self.reader = Reader(self.loc, self.manifest)

    def expect(self, fqns: Iterable[str]) -> None:
        """Say which tensors the export will read (the total its progress counts towards)."""
        self.expected += sum(math.prod(self.manifest.tensors[f].shape) * itemsize(self.manifest.tensors[f].dtype) for f in fqns)

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def read(self, fqn: str, dtype: str | None = None) -> np.ndarray[Any, Any]:
        """Return tensor `fqn` whole as flat bytes (C order), converted to `dtype` if given (read
        into a buffer of the source's own, used again for the next tensor converted)."""
        entry = self.manifest.tensors[fqn]
        nbytes = math.prod(entry.shape) * itemsize(entry.dtype)
        converted = dtype is not None and dtype != entry.dtype
        buffer = self._take_scratch(nbytes) if converted else None
        data = self.reader.read_whole(fqn, pool=self.pool, into=buffer)
        if self.progress is not None:
            with self.lock:
                self.done += nbytes
                self.progress(self.done, max(self.expected, self.done))
        try:
            return convert(data, entry.dtype, dtype or entry.dtype)  # (converted: in new memory, the buffer free again)
        finally:
            if buffer is not None:
                self._give_scratch(buffer)

    def _take_scratch(self, nbytes: int) -> np.ndarray[Any, Any]:
        """The smallest idle read buffer of at least `nbytes`, or a new one."""
        with self.lock:
            fits = [i for i, b in enumerate(self.scratch) if b.size >= nbytes]
            if fits:
                return self.scratch.pop(fits[-1])
        return np.empty(max(nbytes, 1), np.uint8)

    def _give_scratch(self, buffer: np.ndarray[Any, Any]) -> None:
        """Keep `buffer` for later reads: the largest idle buffers, as many as SCRATCH_BYTES holds (at least one)."""
        with self.lock:
            idle, held = sorted([*self.scratch, buffer], key=lambda b: -b.size), 0
            self.scratch = []
            for b in idle:
                if self.scratch and held + b.size > SCRATCH_BYTES:
                    break
                self.scratch.append(b)
                held += b.size

    def read_box(self, fqn: str, box: Box) -> np.ndarray[Any, Any]:
        """Return `box` of tensor `fqn` as flat bytes (C order), in its saved dtype, reading
        only the bytes the box needs."""
        from ..plan.load import plan_load

        entry = self.manifest.tensors[fqn]
        self.reader.open_files_of([fqn])
        out = np.empty(byte_shape(box.lengths, itemsize(entry.dtype)), np.uint8)
        self.reader.fill(plan_load(self.manifest, [(fqn, box)]).targets, [out], pool=self.pool)
        if self.progress is not None:
            with self.lock:
                self.done += math.prod(box.lengths) * itemsize(entry.dtype)
                self.progress(self.done, max(self.expected, self.done))
        return out.reshape(-1)

    def read_pieces(self, pieces: Sequence[tuple[str, Box]]) -> list[np.ndarray[Any, Any]]:
        """Return each (tensor, box) piece as bytes shaped as its box (the element as a last axis
        of its itemsize), in the saved dtype: a tensor giving one piece of itself read by its box,
        one giving all of itself or several pieces (rows in another order: torchtitan's rotary
        rows) read whole, once."""
        uses: dict[str, int] = {}
        for fqn, box in pieces:
            whole = box.lengths == tuple(self.manifest.tensors[fqn].shape)
            uses[fqn] = uses.get(fqn, 0) + (2 if whole else 1)
        read = {fqn: self._shaped(fqn, self.read(fqn), self.manifest.tensors[fqn].shape) for fqn, n in uses.items() if n > 1}
        return [read[fqn][tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))] if fqn in read
                else self._shaped(fqn, self.read_box(fqn, box), box.lengths) for fqn, box in pieces]

    def _shaped(self, fqn: str, data: np.ndarray[Any, Any], shape: Sequence[int]) -> np.ndarray[Any, Any]:
        return data.reshape(*shape, itemsize(self.manifest.tensors[fqn].dtype))

    def read_runs(self, runs: Sequence[Run]) -> np.ndarray[Any, Any]:
        """Return the tensor made of `runs` (rows of source tensors, in order: ``models.compose``)
        as flat bytes, in the sources' saved dtype, reading only the rows it needs."""
        parts = []
        for r in runs:
            shape = self.manifest.tensors[r.fqn].shape
            if r.src_row == 0 and r.count == (shape[0] if shape else 1):
                parts.append(self.read(r.fqn))
            else:
                parts.append(self.read_box(r.fqn, Box((r.src_row, *(0 for _ in shape[1:])), (r.count, *shape[1:]))))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def stream(self, fqns: Sequence[str], dtype: Callable[[str], str | None]) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
        """Yield (fqn, bytes) for `fqns` in order, each converted to ``dtype(fqn)``.

        Helper threads read and convert the next tensors while the caller uses the current
        one, up to AHEAD_BYTES of saved bytes ahead (always at least the next tensor), so many
        small tensors keep the disk busy and memory stays bounded.
        """
        sizes = [math.prod(self.manifest.tensors[f].shape) * itemsize(self.manifest.tensors[f].dtype) for f in fqns]
        with ThreadPoolExecutor(AHEAD_THREADS) as ahead:
            queue: deque[tuple[str, Future[np.ndarray[Any, Any]], int]] = deque()
            submitted = 0
            held = 0
            for _ in fqns:
                while submitted < len(fqns) and (not queue or held + sizes[submitted] <= AHEAD_BYTES):
                    fqn = fqns[submitted]
                    queue.append((fqn, ahead.submit(self.read, fqn, dtype(fqn)), sizes[submitted]))
                    held += sizes[submitted]
                    submitted += 1
                fqn, future, size = queue.popleft()
                data = future.result()
                held -= size
                yield fqn, data
                del data


class ExportedTensor(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    source: str
    shape: list[int]
    source_dtype: str
    dtype: str
    file: str
    checksum: str


class ExportedFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    path: str
    size: int
    checksum: str


# The start of a skipped tensor's reason when the format holds its kind but could not write it.
LEFT_OUT = "left out (--allow-skip):"
# A value under these (a DCP save's param groups) is the optimizer's: written with --include-optimizer.
OPTIMIZER_PARTS = ("optim", "optimizer")


class ExportReport(BaseModel):
    """What ``ckptkit export --json`` prints, also written as ``export_report.json`` in DST."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    format: str
    form: str | None = None  # dcp: "fsdp2" (what FSDP2's get_state_dict gives) or "plain" (the checkpoint's names)
    dtype: str
    source: str
    source_checkpoint_id: str
    step: int
    source_topology: Topology
    destination: str
    tensors: int
    tensor_list: list[ExportedTensor]
    files: int
    file_list: list[ExportedFile]
    # every tensor not written, and why: of a kind the format does not hold, or (the reason starting
    # with LEFT_OUT, `left_out`) of a kind it holds that it could not write, left out only when allowed
    skipped: list[SkippedEntry]
    not_held: dict[str, int] = {}  # the other tensors not written, counted by kind (kinds the format does not hold)
    warnings: list[str] = []  # what the format holds only approximately, said
    seconds: float = 0.0  # from opening the source to the last tensor written

    @property
    def left_out(self) -> list[str]:
        """The tensors of kinds the format holds that it could not write (exported with --allow-skip)."""
        return [e.name for e in self.skipped if e.reason.startswith(LEFT_OUT)]


@dataclass
class Written:
    """What a format's writer wrote: the report's tensors and files, and for a format that is
    also a checkpoint (the zarr form), its manifest given the report's file."""

    tensors: list[ExportedTensor]
    files: list[ExportedFile]
    manifest: Callable[[ExportedFile], bytes] | None = None


@dataclass(frozen=True)
class Writer:
    """A format's export, planned, before a byte is written: the checkpoint's tensors it leaves
    out (so that an export leaving out what its format holds is refused before it writes);
    `write`, (source, destination storage, temporary name) -> what it wrote; and the checkpoint's
    values it carries, as saved or as what stands for them in the format (Megatron's arguments
    with the export's parallel sizes). Every other value is listed as skipped in the report;
    `warnings`, what the format holds only approximately (Megatron's scheduler for another's
    schedule), are the report's."""

    skipped: list[str]
    write: Callable[[Source, Storage, str], Written]
    values: frozenset[str] = frozenset()
    reasons: Mapping[str, str] = field(default_factory=dict)  # why, where the writer knows better than the kind does
    warnings: Sequence[str] = ()
    # The part of the files rank r of n writes, for a format whose files several processes can
    # write (the parts of every rank together being what `write` writes, their tensors in file
    # order once sorted by file); None: one process writes them all.
    write_part: Callable[[Source, Storage, str, int, int], Written] | None = None


def report_bytes(report: ExportReport) -> bytes:
    return report.model_dump_json(indent=2).encode()


def exported(source: Source, name: str, fqn: str, data: memoryview, dtype: str, file: str,
             shape: tuple[int, ...] | None = None, described: str | None = None) -> ExportedTensor:
    """The report line of tensor `fqn` exported as `name` (bytes `data` in `dtype`) in `file`: of
    `shape` (default: the source's), its source `described` (default: `fqn`) when it is made of more."""
    entry = source.manifest.tensors[fqn]
    return ExportedTensor(name=name, source=described or fqn, shape=list(entry.shape if shape is None else shape),
                          source_dtype=entry.dtype, dtype=dtype, file=file, checksum=checksum_of(data))
