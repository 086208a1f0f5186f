"""Bring another tool's checkpoint in: the converter contract, finding converters, and the one
writer every converter commits through (no torch).

Converters live outside the core, each the reader of a tool's adapter (``ckptkit.adapters``:
the ``ckptkit_adapters`` package, or any distribution registering one in the
``ckptkit.adapters`` entry-point group); the core finds them through the registry, never
importing one by name.

Call order: `detect_format` (for ``--from auto``) or a name from `list_converters`; then
`convert`, which hands the work to the converter. A converter reads its source's metadata and
plans (names, kinds, what it cannot convert; an entry it cannot convert fails the conversion
before anything is written, unless ``allow_skip``), then calls `write_converted` with the
tensors' specs and a function that returns one tensor's bytes at a time. `write_converted`
refuses an existing destination, streams the payload files under a temporary name, writes the
manifest last and commits, or discards everything on failure: the destination never appears
half written.

Under torch.distributed (``torchrun``) every process runs the converter, and `write_converted`
splits the payload files: process ``r`` writes files ``r``, ``r + world``, ... (reading only
their tensors, and on rank 0 every scalar a step may come from), rank 0 its tokenizer files,
and rank 0 commits the one manifest. The files are planned as one process plans them, so the
checkpoint is the same, file for file, at any number of processes.

`survey` runs a converter without writing: inside it, `write_converted` plans the checkpoint it
would commit and returns its manifest (payload files planned, not written), reading every
tensor (``verify``) or only the scalars a step may come from (``inspect``). That is how the
commands that read a checkpoint read another tool's directly, through its adapter.
"""

from __future__ import annotations

import contextvars
import datetime
import inspect
import os
import platform
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, JsonValue

from .reports import SkippedEntry as SkippedEntry  # part of the converter contract: what a converter skips
from .. import __version__
from ..boxes import full_box
from ..errors import CheckpointExistsError, CheckpointNotFoundError, IntegrityError, LayoutError, ManifestError, summarize
from ..io.catalog import Location, locate
from ..io.commit import Staging, commit, discard, refuse_existing, staging
from ..io.write import Written, write_safetensors, write_small
from ..layouts import Layout, fit_problems
from ..manifest import CheckpointInfo, FileEntry, Manifest, Producer, SourceInfo, TokenizerInfo, Topology, manifest_to_json
from .collective import Collective, SingleProcess, default_collective, first_error, guard, unwrap
from ..plan.save import ItemDesc, SavePlan, plan_files, tensor_entries
from ..state.tree import as_json
from ..storage import Storage

# Payload files are cut at this size by default (a converted checkpoint is one rank's files).
MAX_FILE_BYTES = 4 << 30

Progress = Callable[[int, int], None]  # (bytes written so far, bytes in all)


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ConvertedTensor(_Report):
    """A tensor brought across: the source's name for it, its ckptkit name (fqn), and what it is."""

    source: str
    name: str
    kind: str
    dtype: str
    shape: list[int]
    chunks: int  # pieces of the source it was assembled from


class ConvertedObject(_Report):
    """A non-tensor value brought across as JSON: the source's name and its ckptkit name."""

    source: str
    name: str


class ConvertReport(_Report):
    """What ``ckptkit convert --json`` prints: every entry of the source is in ``tensor_list``,
    ``objects`` or ``skipped``."""

    ok: bool = True  # the command succeeded (every report has it; the error object's is false)
    format: str
    source: str
    destination: str
    step: int
    tensors: int
    tensor_list: list[ConvertedTensor]
    objects: list[ConvertedObject]
    skipped: list[SkippedEntry]
    files: int
    bytes_written: int
    seconds: float
    # what the user should know of the conversion, each in one line (a layout that could not be recorded, ...)
    warnings: list[str] = []


@runtime_checkable
class Converter(Protocol):
    """What a tool's adapter gives as its reader (``ckptkit.adapters.Adapter.converter``).

    ``detect`` must be cheap (file names, a few small reads) and never raise for a path that
    is not its format; ``convert`` commits ``dst`` through `write_converted` or raises a
    ``CkptkitError`` leaving nothing at ``dst``; a given ``layout`` is recorded instead of the
    one the converter would (it is passed only when given). A converter whose sources may not
    record all of the model's config also takes ``config`` (``--model-config``: what the user
    says of it), passed only when given. A converter of one tool's use of another's container
    (torchtitan's DCP saves) says so with ``refines`` (``"dcp"``): where both detect a path,
    it is the one chosen.
    """

    name: str
    description: str

    def detect(self, path: str) -> bool: ...

    def convert(self, src: str, dst: str, *, allow_skip: bool = False, progress: Progress | None = None,
                layout: Layout | None = None) -> ConvertReport: ...


def load_converter(name: str) -> Converter:
    """Return the converter of the tool `name` (its adapter's reader).

    Raises:
        ManifestError: no converter of that name, or it cannot be imported (its framework
            dependency missing: the message says which extra to install), or what the adapter
            gives is not a converter of that name.
    """
    from ..adapters import converter_of

    found = converter_of(name)
    if not isinstance(found, Converter) or found.name != name:
        raise ManifestError(f"the {name} adapter's reader is not a converter named {name!r}")
    return found


def list_converters() -> dict[str, str]:
    """Return the name and description of every converter that loads."""
    from ..adapters import adapters

    out = {}
    for name, adapter in adapters().items():
        if adapter.converter is None:
            continue
        try:
            out[name] = load_converter(name).description
        except ManifestError:
            continue
    return out


def detect_format(path: str | os.PathLike[str]) -> str:
    """Return the name of the one converter that recognises the files at `path` (of a converter and
    one it `refines`, the first).

    Raises:
        CheckpointNotFoundError: no directory at `path`.
        ManifestError: no converter recognises it (or several do: name one with ``--from``).
    """
    text = os.fspath(path)
    if not os.path.isdir(text):
        raise CheckpointNotFoundError(f"{text}: no such directory; a checkpoint to convert is a directory")
    found = [name for name in list_converters() if load_converter(name).detect(text)]
    refined = {getattr(load_converter(name), "refines", None) for name in found}
    found = [name for name in found if name not in refined]  # torchtitan's reader before the DCP one it reads through
    if not found:
        raise ManifestError(f"{text}: not a checkpoint any converter recognises (tried: {', '.join(list_converters())})")
    if len(found) > 1:
        raise ManifestError(f"{text}: looks like several formats ({', '.join(found)}); name one with --from")
    return found[0]


def convert(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, source_format: str = "auto", allow_skip: bool = False,
    progress: Progress | None = None, layout: Layout | None = None, config: Mapping[str, JsonValue] | None = None,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> ConvertReport:
    """Convert another tool's checkpoint at `src` into a committed ckptkit checkpoint at `dst`.

    Under torch.distributed (every process calling it alike) the processes split the payload
    files and rank 0 commits; every process returns the report.

    Args:
        src: the source checkpoint (a local directory).
        dst: the checkpoint directory to create (a local path or a storage URL).
        source_format: a converter's name (see `list_converters`), or ``auto`` to detect it.
        allow_skip: convert what can be converted and list the rest as skipped; by default an
            entry that cannot be converted fails the conversion before anything is written.
        progress: called with (bytes written, bytes in all) as tensors are written.
        layout: the model's layout, recorded in the checkpoint instead of the one the converter
            finds (if any), so that ``reshard`` and ``export`` need no ``--layout``.
        config: what the source does not record of the model's config (a Megatron-Core save
            without Megatron-LM's arguments: ``num_attention_heads``, ``num_query_groups``),
            from which the converter finds the layout; only converters that take it.
        max_file_bytes: start a new payload file when one would grow past this (more files
            split the work of several processes finer).

    Raises:
        ManifestError: unknown format, unreadable or refused source metadata, entries that
            cannot be converted (all are listed), a `config` its converter does not take.
        LayoutError: `layout` does not fit the converted tensors (nothing is written).
        IntegrityError: source files missing, truncated or inconsistent with their metadata.
        CheckpointNotFoundError: no directory at `src`.
        CheckpointExistsError: something exists at `dst`, or `dst` lies inside `src`.
        StorageError: a read or write failed; nothing was committed.
    """
    src_text, dst_text = os.fspath(src), os.fspath(dst)
    if source_format != "auto" and not os.path.isdir(src_text):
        raise CheckpointNotFoundError(f"{src_text}: no such directory; a checkpoint to convert is a directory")
    name = detect_format(src_text) if source_format == "auto" else source_format
    converter = load_converter(name)
    if "://" not in dst_text:
        a, b = os.path.realpath(src_text), os.path.realpath(dst_text)
        if b == a or b.startswith(a.rstrip("/") + "/"):
            raise CheckpointExistsError(f"{dst_text}: the destination may not be or lie inside the source {src_text}")
    given: dict[str, Any] = {} if layout is None else {"layout": layout}
    if config:
        if "config" not in inspect.signature(converter.convert).parameters:
            raise ManifestError(f"{src_text}: the {name} converter takes no --model-config (its checkpoints record the model)")
        given["config"] = dict(config)
    if max_file_bytes < 1:
        raise ManifestError(f"max_file_bytes must be positive, got {max_file_bytes}")
    conversion = _Conversion(default_collective(), max_file_bytes)
    token = _CONVERSION.set(conversion)
    try:
        if conversion.coll.world_size == 1:
            report: ConvertReport = converter.convert(src_text, dst_text, allow_skip=allow_skip, progress=progress, **given)
            return report
        outcome = guard(lambda: converter.convert(src_text, dst_text, allow_skip=allow_skip, progress=progress, **given))
        if not conversion.entered:  # failed while planning: the others wait in write_converted's first step
            first_error(conversion.coll, outcome)
        return unwrap(outcome)  # type: ignore[no-any-return]
    finally:
        _CONVERSION.reset(token)


@dataclass
class _Conversion:
    """The conversion under way: the processes that split its files, where a payload file ends,
    and whether `write_converted` was entered (its first step is a collective)."""

    coll: Collective
    max_file_bytes: int
    entered: bool = False


_CONVERSION: contextvars.ContextVar[_Conversion | None] = contextvars.ContextVar("ckptkit_conversion", default=None)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor a converter writes: its ckptkit name, the source's name for it, dtype, shape, kind."""

    name: str
    source: str
    dtype: str
    shape: tuple[int, ...]
    kind: str


@dataclass(frozen=True, slots=True)
class Committed:
    """What `write_converted` committed."""

    destination: str
    manifest: Manifest
    files: int
    bytes_written: int


def source_info(fmt: str, src: str, *, version: object = None, ranks: int | None = None,
                topology: Topology | None = None) -> SourceInfo:
    """What a converted checkpoint records of its source (``info.source``): the converter's
    name, the absolute path it read, the tool's version where the source records one (any
    value; kept as text), the processes that wrote it and the topology they were split by,
    where the source shows them (the topology's world size stands for the ranks when not given)."""
    return SourceInfo(format=fmt, path=os.path.abspath(src), version=None if version in (None, "") else str(version),
                      ranks=ranks if ranks is not None or topology is None else topology.world_size, topology=topology)


def refuse_skips(skipped: Sequence[SkippedEntry], *, allow_skip: bool, where: str) -> None:
    """Fail, listing every entry that cannot be converted, unless `allow_skip`.

    Raises:
        ManifestError: there are some and `allow_skip` is False.
    """
    if skipped and not allow_skip:
        shown = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:10])
        more = f"; and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        raise ManifestError(
            f"{where}: {len(skipped)} entr{'y' if len(skipped) == 1 else 'ies'} cannot be converted ({shown}{more}); "
            f"pass --allow-skip to convert the rest"
        )


def name_problems(names: Sequence[str]) -> list[str]:
    """Say which names cannot sit in one nested state: one is another's parent (``a/b`` and
    ``a/b/c``: the first would be both a value and a dict), or one is empty."""
    problems = [f"{n!r}: an empty name" for n in names if not n]
    present = set(names)
    for n in sorted(present):
        parts = n.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent in present:
                problems.append(f"{parent!r} is both a value and the parent of {n!r}")
                break
    return problems


def write_converted(
    dst: str | os.PathLike[str],
    tensors: Sequence[TensorSpec],
    read: Callable[[TensorSpec], memoryview],
    *,
    objects: Mapping[str, JsonValue],
    step: Callable[[], int],
    info: CheckpointInfo | None = None,
    layout: Layout | None = None,
    tokenizer: Mapping[str, bytes] | None = None,
    max_file_bytes: int | None = None,
    progress: Progress | None = None,
    storage: Storage | None = None,
    source: SourceInfo | None = None,
) -> Committed:
    """Write `tensors` (whole, one rank's files) and `objects` as the committed checkpoint `dst`.

    ``read(spec)`` returns one tensor's bytes (C order, little-endian) when its turn comes;
    it is called once per tensor with elements, in file order, so a converter holds one tensor
    at a time. ``step()`` is asked after the last tensor was read. The latest pointer of
    `dst`'s root is left alone. `layout` is recorded in the manifest (as ``ckptkit.save``
    records one); `tokenizer` maps file names (``/``-separated) to their bytes, written under
    ``tokenizer/`` as the checkpoint's tokenizer files; `source` (`source_info`) as ``info.source``,
    what the checkpoint was converted from. Payload files end at `max_file_bytes` (default: the
    `convert` call's). Under torch.distributed the processes split the files (see the module
    docstring); every process calls it alike and gets the same `Committed`.

    Raises:
        ManifestError: names that cannot sit in one nested state (nothing is written).
        LayoutError: `layout` does not fit the tensors (nothing is written).
        CheckpointExistsError: something exists at `dst`.
        IntegrityError: ``read`` returned the wrong number of bytes; nothing was committed.
        StorageError: a write failed; nothing was committed.
    """
    conversion = _CONVERSION.get() or _Conversion(SingleProcess(), MAX_FILE_BYTES)
    conversion.entered = True
    coll = conversion.coll
    size = conversion.max_file_bytes if max_file_bytes is None else max_file_bytes
    planned = _shared(coll, lambda: _planned(dst, tensors, objects, layout, size))
    if coll.world_size > 1:
        unwrap(first_error(coll, planned))
    plan = planned[1]
    if source is not None:
        info = (info or CheckpointInfo()).model_copy(update={"source": source})
    specs = {t.name: t for t in tensors}
    surveying = _SURVEY.get()
    if surveying is not None:
        return surveying.plan(os.fspath(dst), plan, specs, read, objects=objects, step=step, info=info, layout=layout,
                              tokenizer=tokenizer)
    loc = locate(dst, storage)
    files = plan.all_files()
    mine = set(range(coll.rank, len(files), coll.world_size))
    total = sum(item.nbytes for i in mine for item, _ in files[i].items)
    stage = unwrap(coll.broadcast(_shared(coll, lambda: _staged(loc)) if coll.rank == 0 else None))
    done = [0]

    def bodies(items: Sequence[tuple[ItemDesc, str]]) -> Iterator[memoryview]:
        for item, _ in items:
            data = _checked(read(specs[item.fqn]), item)
            yield data
            done[0] += item.nbytes
            if progress is not None:
                progress(done[0], total)

    def write_part() -> tuple[list[tuple[int, Written]], list[FileEntry]]:
        """This process's files (and on rank 0 the scalars of the others', where a step may be, and the tokenizer's)."""
        written = []
        for i, f in enumerate(files):
            if i in mine:
                keyed = [(key, item.dtype, item.box.lengths) for item, key in f.items]
                written.append((i, write_safetensors(loc.storage, stage.key(f.path), f.path, keyed, bodies(f.items))))
            elif coll.rank == 0:
                for item, _ in f.items:
                    if _scalar(item):
                        _checked(read(specs[item.fqn]), item)
        tok_files = [write_small(loc.storage, stage, f"tokenizer/{name}", data, role="tokenizer")
                     for name, data in sorted((tokenizer or {}).items())] if coll.rank == 0 else []
        return written, tok_files

    def commit_all(parts: list[tuple[str, Any]]) -> Committed:
        written = [w for _, w in sorted(pair for part in parts for pair in part[1][0])]
        index = {w.path: i for i, w in enumerate(written)}
        entries = (*(w.entry(stage.path(w.path)) for w in written), *parts[0][1][1])
        manifest = _manifest(plan, index, specs, entries, objects=objects, step=step(), info=info, layout=layout)
        commit(loc, stage, manifest_to_json(manifest), update_latest=False)
        return Committed(str(loc), manifest, len(entries), sum(w.size for w in written))

    try:
        parts = coll.gather(_shared(coll, write_part))
        outcome: tuple[str, Any] = ("ok", None)
        if parts is not None:
            failed = next((p for p in parts if p[0] != "ok"), None)
            outcome = failed if failed is not None else _shared(coll, lambda: commit_all(parts))
        committed: Committed = unwrap(coll.broadcast(outcome))
    except BaseException:
        if coll.rank == 0:
            discard(loc.storage, stage)
        raise
    return committed


def _shared(coll: Collective, fn: Callable[[], Any]) -> tuple[str, Any]:
    """`fn`'s outcome to share with the other processes (`guard`); alone, its result, any error raised as is."""
    return ("ok", fn()) if coll.world_size == 1 else guard(fn)


def _planned(dst: str | os.PathLike[str], tensors: Sequence[TensorSpec], objects: Mapping[str, JsonValue],
             layout: Layout | None, max_file_bytes: int) -> SavePlan:
    """The files of a converted checkpoint (the same at any number of processes), once its names and layout are checked."""
    problems = name_problems([t.name for t in tensors] + list(objects))
    if problems:
        raise ManifestError(f"{dst}: names collide: " + summarize(problems))
    fit = [] if layout is None else fit_problems(layout, {t.name: t.shape for t in tensors})
    if layout is not None and fit:
        raise LayoutError(f"{dst}: the layout {layout.name!r} does not fit the converted tensors: " + summarize(fit))
    meta = {t.name: ItemDesc(t.name, t.dtype, t.shape, full_box(t.shape)) for t in tensors}
    holders = {name: ({item.box: [0]} if item.box.volume else {}) for name, item in meta.items()}  # empty: no bytes
    return plan_files(holders, meta, 1, max_file_bytes=max_file_bytes)


def _staged(loc: Location) -> Staging:
    refuse_existing(loc)
    return staging(loc, uuid.uuid4().hex[:12])


def _scalar(item: ItemDesc) -> bool:
    """A scalar, which a source's step may be: read even where its bytes are not written (a survey, another process's file)."""
    return not item.box.lengths and item.nbytes <= _SCALAR_BYTES


def _checked(data: memoryview, item: ItemDesc) -> memoryview:
    if data.nbytes != item.nbytes:
        raise IntegrityError(f"{item.fqn}: the converter returned {data.nbytes} bytes, expected {item.nbytes}")
    return data


def _manifest(
    plan: SavePlan, index: Mapping[str, int], specs: Mapping[str, TensorSpec], files: Sequence[FileEntry], *,
    objects: Mapping[str, JsonValue], step: int, info: CheckpointInfo | None, layout: Layout | None,
) -> Manifest:
    """The manifest of a converted checkpoint whose payload files (and then tokenizer files) are `files`."""
    tok_files = [f.path for f in files if f.role == "tokenizer"]
    return Manifest(
        checkpoint_id=uuid.uuid4().hex,
        step=step,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        producer=Producer(ckptkit=__version__, python=platform.python_version()),
        topology=Topology(world_size=1),
        files=tuple(files),
        tensors=tensor_entries(plan, dict(index), lambda fqn: specs[fqn].kind),
        objects={name: as_json(value) for name, value in objects.items()},
        info=info or CheckpointInfo(),
        tokenizer=TokenizerInfo(files=tuple(tok_files)) if tok_files else None,
        layout=None if layout is None else layout.to_json(),
    )


# Scalars are read even by a survey that reads no tensor: a source's step may be one.
_SCALAR_BYTES = 16


@dataclass
class _Survey:
    """A survey under way: whether it reads every tensor, what it read, the manifest it planned."""

    read_all: bool
    bytes_read: int = 0
    manifest: Manifest | None = None

    def plan(
        self, dst: str, plan: SavePlan, specs: Mapping[str, TensorSpec], read: Callable[[TensorSpec], memoryview], *,
        objects: Mapping[str, JsonValue], step: Callable[[], int], info: CheckpointInfo | None, layout: Layout | None,
        tokenizer: Mapping[str, bytes] | None,
    ) -> Committed:
        """What `write_converted` does inside `survey`: read (every tensor, or the scalars), check
        each tensor's byte count, and return the manifest it would commit, writing nothing. The
        payload files' sizes are their tensors' bytes; no file has a checksum."""
        files: list[FileEntry] = []
        for f in plan.all_files():
            for item, _ in f.items:
                if self.read_all or _scalar(item):
                    self.bytes_read += _checked(read(specs[item.fqn]), item).nbytes
            files.append(FileEntry(path=f.path, size=sum(item.nbytes for item, _ in f.items), checksum=""))
        index = {f.path: i for i, f in enumerate(files)}
        files += [FileEntry(path=f"tokenizer/{name}", size=len(data), checksum="", role="tokenizer")
                  for name, data in sorted((tokenizer or {}).items())]
        self.manifest = _manifest(plan, index, specs, files, objects=objects, step=step(), info=info, layout=layout)
        return Committed(dst, self.manifest, len(files), 0)


_SURVEY: contextvars.ContextVar[_Survey | None] = contextvars.ContextVar("ckptkit_convert_survey", default=None)


@dataclass(frozen=True, slots=True)
class Surveyed:
    """What `survey` found: the converter's report (its skipped entries and warnings included),
    the manifest a conversion would commit, and the tensor bytes read."""

    format: str
    report: ConvertReport
    manifest: Manifest
    bytes_read: int
    files: int  # the source's files ...
    file_bytes: int  # ... and their bytes


def survey(src: str | os.PathLike[str], *, source_format: str = "auto", read: bool = False) -> Surveyed:
    """Read the checkpoint at `src` through its adapter as `convert` would, writing nothing.

    Entries the converter cannot bring in are listed in the report's ``skipped``, never refused.
    With `read`, every tensor's bytes are read and their count checked (a truncated or
    inconsistent file fails); without it only metadata and scalars are read.

    Raises:
        ManifestError, IntegrityError, LayoutError: as `convert` (nothing is written).
    """
    text = os.fspath(src)
    name = detect_format(text) if source_format == "auto" else source_format
    converter = load_converter(name)
    state = _Survey(read_all=read)
    token = _SURVEY.set(state)
    try:
        report = converter.convert(text, "-", allow_skip=True)
    finally:
        _SURVEY.reset(token)
    if state.manifest is None:
        raise ManifestError(f"the {name} converter did not plan a checkpoint for {text}")
    sizes = [os.stat(os.path.join(top, f), follow_symlinks=False).st_size for top, _, names in os.walk(text) for f in names]
    return Surveyed(name, report, state.manifest, state.bytes_read, len(sizes), sum(sizes))


def report_of(
    fmt: str, src: str, committed: Committed, tensors: Sequence[tuple[TensorSpec, int]], objects: Mapping[str, str],
    skipped: Sequence[SkippedEntry], started: float,
) -> ConvertReport:
    """The convert report of a committed conversion: `tensors` as (spec, chunks), `objects` as
    ckptkit name -> source name."""
    return ConvertReport(
        format=fmt,
        source=src,
        destination=committed.destination,
        step=committed.manifest.step,
        tensors=len(tensors),
        tensor_list=[ConvertedTensor(source=t.source, name=t.name, kind=t.kind, dtype=t.dtype, shape=list(t.shape), chunks=n)
                 for t, n in tensors],
        objects=[ConvertedObject(source=source, name=name) for name, source in objects.items()],
        skipped=list(skipped),
        files=committed.files,
        bytes_written=committed.bytes_written,
        seconds=round(time.perf_counter() - started, 3),
    )
