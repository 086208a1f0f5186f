"""Save a nested state of tensors and JSON values as a committed checkpoint, in one process or collectively."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from typing import Any

import torch

from .. import __version__
from ..boxes import Box
from ..io.catalog import Location, locate
from ..io.commit import Staging, commit, discard, refuse_existing, staging
from .collective import Collective, default_collective, guard, unwrap
from ..errors import CkptkitError, LayoutError, StorageError, summarize
from ..layouts import Layout, fit_problems, topology_problems
from ..layouts.saved import RULE, Saved
from ..manifest import (
    KINDS,
    CheckpointInfo,
    FileEntry,
    Manifest,
    Patch,
    Producer,
    TensorEntry,
    TokenizerInfo,
    Topology,
    manifest_to_json,
)
from ..manifest.model import Derived, DerivedGroup
from ..io.write import Written, write_safetensors, write_small
from ..plan.incremental import Ask, Outcome
from .incremental import Base, assembled, base_reader, find_base, no_base, write_changed
from ..plan.save import FilePlan, ItemDesc, SavePlan, derived_file, derived_groups, file_name, layout_share, plan_save, tensor_entries
from ..storage import Storage
from ..state.device import DEFAULT_PINNED_BYTES, BouncePool, device_problems, staged_bytes
from ..state.torch_io import byte_view, dtype_name, host_contiguous, is_leaf, leaf_shards
from ..state.tree import as_json, flatten, json_problems

DEFAULT_KINDS = {"model": "param", "optimizer": "optimizer", "optim": "optimizer", "rng": "rng", "buffers": "buffer"}


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    step: int,
    topology: Topology | None = None,
    info: CheckpointInfo | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
    kinds: Mapping[str, str] | None = None,
    process_group: Any = None,
    max_file_bytes: int | None = None,
    io_threads: int = 2,
    update_latest: bool = True,
    storage: Storage | None = None,
    layout: Layout | None = None,
    pinned_bytes: int = DEFAULT_PINNED_BYTES,
    incremental: bool = False,
    digests_in_manifest: bool = False,
) -> Manifest:
    """Write `state` as the committed checkpoint directory `path`.

    Under torch.distributed every rank of the group calls this with its own state: tensors
    that are plain ``torch.Tensor`` are replicas of a whole tensor, ``ShardedTensor`` values
    (or lists of them) are boxes of a global tensor; identical boxes are written once. Each
    rank writes only its own payload files; rank 0 checks that the boxes tile every tensor,
    writes the manifest last, renames the checkpoint into place and moves the root's
    ``latest`` pointer. Non-tensor values must be JSON and are taken from rank 0.

    Args:
        state: nested dict with string keys; leaves are tensors, ShardedTensors or JSON values.
        path: the checkpoint directory to create, e.g. ``ckpts/step_00000100``.
        step: the training step recorded in the manifest.
        topology: the job's parallel layout (default: plain data parallel over the group).
        info: training assets (optimizer, scheduler, data progress, versions, model config).
        tokenizer: a tokenizer file or directory copied into the checkpoint and hashed.
        kinds: tensor kind by fqn prefix, overriding the defaults (model -> param,
            optimizer/optim -> optimizer, rng -> rng, buffers -> buffer, else other).
        process_group: torch.distributed group (default: the default group, if initialized).
        max_file_bytes: start a new payload file when a rank's file would grow past this.
        io_threads: files each rank writes in parallel; a rank's payload is split into this
            many files of about equal size once it holds 64 MiB per file.
        update_latest: move the root's ``latest`` pointer to this checkpoint, if `step` is higher
            than the step of the one it names (``latest`` never moves back).
        storage: write through this backend; `path` is then the checkpoint's name under its root.
        layout: the model's layout (``ckptkit.layouts``), recorded in the manifest so that the
            checkpoint can be resharded offline to any topology the layout allows; checked
            against the saved tensors and the topology first.
        pinned_bytes: the host memory CUDA tensors are staged through: a pool of reused pinned
            buffers (default 1 GiB in all), device-to-host copies on a side stream overlapping
            the hashing and writing of the bytes before them; never a host copy of the state.
        incremental: write only the boxes that changed since the checkpoint the root's
            ``latest`` names (if it was saved incrementally too): each rank hashes its boxes
            (xxh3-128; a CUDA tensor through a host copy, one at a time), a box whose digest
            equals the one recorded there for the same tensor and box is not written again but
            read from that checkpoint's file (which retention then keeps as long as this one).
            Every box's digest is recorded, so the next incremental save can do the same.
        digests_in_manifest: keep each file's block digests in the manifest (as schema 1.4
            did) rather than in its sidecar beside it (``<file>.blocks``): the memory tier's
            snapshots, whose transfers carry the listed files alone.

    Returns:
        The manifest that was committed.

    Raises:
        LayoutError: boxes overlap or leave gaps, shapes or dtypes disagree across ranks,
            a value is neither a tensor nor JSON, a tensor is on a device other than cpu and
            cuda, or the layout does not fit the tensors or the topology.
        CheckpointExistsError: something already exists at `path`.
        StorageError: a write failed; nothing was committed, unless the message says the
            checkpoint is committed and only the root's ``latest`` pointer was not moved.
    """
    coll = default_collective(process_group)
    loc = locate(path, storage)
    local, descs, objects, error = _describe(state, kinds or {})
    pool = _pool(local.values(), pinned_bytes) if not error else None
    saved = _derivable(layout, topology, coll, incremental or max_file_bytes is not None)
    share, sent = None, descs
    if saved is not None and not error:
        try:
            share, sent = layout_share(saved, coll.rank, descs)
        except CkptkitError as exc:
            error = f"{type(exc).__name__}: {exc}"
    gathered = coll.gather((sent, share, _digest(objects), error))
    groups: dict[str, DerivedGroup] | None = None
    if saved is not None:  # every rank lists its layout boxes too unless rank 0 can derive them all
        groups = coll.broadcast(_groups(gathered, saved, kinds or {}) if gathered is not None else None)
        if groups is None:
            kept = {id(d) for d in sent}
            rest = coll.gather([d for d in descs if id(d) not in kept] if share is not None else [])
            if gathered is not None and rest is not None:
                gathered = [(g[0] + more, None, g[2], g[3]) for g, more in zip(gathered, rest)]
    planned: tuple[str, Any] = ("ok", None)
    plan: SavePlan | None = None
    topo: Topology | None = None
    shares = None
    with contextlib.ExitStack() as held_base:  # rank 0 leases the base until the commit
        base: Base | None = None
        if gathered is not None:
            planned = guard(lambda: _plan(gathered, loc, (max_file_bytes, io_threads if groups is None else 1), topology,
                                          layout if groups is None else None, coll))
            if planned[0] == "ok":
                plan, uid, topo = planned[1]
                if incremental:
                    base = find_base(loc, plan, held_base)
                asks = base.asks(plan) if base is not None else no_base(plan)
                shares = [(files, uid, ask) for files, ask in zip(plan.files, asks)]
        # Every rank learns whether planning worked, then receives only its own files.
        unwrap(coll.broadcast(("ok", None) if planned[0] == "ok" else planned))
        my_files, uid, found = coll.scatter(shares)
        if groups is not None and saved is not None:
            mine = Saved(saved.layout, saved.topology, list(groups))
            my_files = (derived_file(mine, coll.rank, {d.fqn: d for d in descs}, my_files),)
        stage = staging(loc, uid)
        written = guard(lambda: _write_files(loc.storage, stage, my_files, local, io_threads, pool, found if incremental else None,
                                             not digests_in_manifest))
        results = coll.gather(written)
        outcome: tuple[str, Any] = ("ok", None)
        if results is not None:
            assert plan is not None and topo is not None  # rank 0 planned
            outcome = guard(
                lambda: _commit(results, plan, loc, stage, step, topo, info, tokenizer, objects, kinds, update_latest, layout, base,
                                groups)
            )
            if outcome[0] != "ok":
                discard(loc.storage, stage)
    return unwrap(coll.broadcast(outcome))  # type: ignore[no-any-return]


def _derivable(layout: Layout | None, topology: Topology | None, coll: Collective, listed: bool) -> Saved | None:
    """The layout's saves over the job's topology, when this save may derive its layout tensors
    (a layout, the topology it fits, one file per rank, not incremental); None otherwise. The
    same on every rank."""
    topo = topology or Topology(world_size=coll.world_size, dp=coll.world_size)
    if layout is None or listed or topo.world_size != coll.world_size or topology_problems(layout, topo):
        return None
    return Saved(layout, topo)


def _groups(gathered: list[Any], saved: Saved, kinds: Mapping[str, str]) -> dict[str, DerivedGroup] | None:
    """The derived groups (dtype, kind) of a save whose ranks each hold exactly their layout boxes
    and whose every group has one dtype and one kind; None otherwise (the save lists its boxes)."""
    if any(err or share is None for _, share, _, err in gathered):
        return None
    dtypes = derived_groups([share for _, share, _, _ in gathered])
    if dtypes is None:
        return None
    out = {}
    for group in saved.groups:
        if group.label not in dtypes:
            continue
        names = [group.fqn(n) for n in saved.layout.tensors()] if kinds else [group.prefix]  # else: by the top key
        found = {kind_of(fqn, kinds) for fqn in names}
        if len(found) != 1:
            return None
        out[group.label] = DerivedGroup(dtype=dtypes[group.label], kind=found.pop())  # type: ignore[arg-type]
    return out


def _describe(
    state: Mapping[str, Any], kinds: Mapping[str, str]
) -> tuple[dict[tuple[str, Box], torch.Tensor], list[ItemDesc], dict[str, Any], str]:
    try:
        unknown = sorted(k for k in kinds.values() if k not in KINDS)
        if unknown:
            raise LayoutError(f"unknown tensor kind(s) {unknown}; kinds are {', '.join(KINDS)}")
        tensors, objects = flatten(state, is_leaf)
        local: dict[tuple[str, Box], torch.Tensor] = {}
        descs: list[ItemDesc] = []
        for fqn, leaf in tensors.items():
            for piece in leaf_shards(leaf):
                item = ItemDesc(fqn, dtype_name(piece.local.dtype, fqn=fqn), piece.global_shape, piece.box)
                local[(fqn, piece.box)] = piece.local
                descs.append(item)
        devices = device_problems((fqn, t.device) for (fqn, _), t in local.items())
        if devices:
            raise LayoutError("cannot save tensors on these devices: " + summarize(devices))
        problems = json_problems(objects)
        if problems:
            raise LayoutError("values must be tensors or JSON: " + summarize(problems))
        objects = {fqn: as_json(value) for fqn, value in objects.items()}  # tuples as lists
    except CkptkitError as exc:
        return {}, [], {}, f"{type(exc).__name__}: {exc}"
    return local, descs, objects, ""


def _pool(tensors: Any, pinned_bytes: int) -> BouncePool | None:
    """The staging pool of the CUDA tensors to save (None without any), its side streams
    ordered after the work the caller has queued on them."""
    cuda = [t for t in tensors if t.device.type == "cuda"]
    if not cuda:
        return None
    pool = BouncePool(pinned_bytes, moving=sum(t.numel() * t.element_size() for t in cuda))
    pool.follow(t.device for t in cuda)
    return pool


def _digest(objects: dict[str, Any]) -> str:
    return json.dumps(objects, sort_keys=True, default=str)


def _plan(
    gathered: list[Any], loc: Location, split: tuple[int | None, int], topology: Topology | None, layout: Layout | None,
    coll: Collective,
) -> tuple[SavePlan, str, Topology]:
    errors = [f"rank {r}: {err}" for r, (_, _, _, err) in enumerate(gathered) if err]
    if errors:
        raise LayoutError(summarize(errors))
    differing = [r for r, (_, _, digest, _) in enumerate(gathered) if digest != gathered[0][2]]
    if differing:
        raise LayoutError(f"non-tensor values differ from rank 0's on ranks {differing}; save per-rank values as tensors")
    refuse_existing(loc)
    topo = topology or Topology(world_size=coll.world_size, dp=coll.world_size)
    if topo.world_size != coll.world_size or topo.tp * topo.pp * topo.dp * topo.cp != topo.world_size:
        raise LayoutError(
            f"topology tp={topo.tp} pp={topo.pp} dp={topo.dp} cp={topo.cp} world_size={topo.world_size} "
            f"does not match {coll.world_size} saving rank(s)"
        )
    plan = plan_save([descs for descs, _, _, _ in gathered], max_file_bytes=split[0], files_per_rank=split[1])
    if layout is not None:
        _check_layout(layout, topo, {fqn: shape for fqn, (_, shape) in plan.tensors.items()})
    return plan, uuid.uuid4().hex[:12], topo


def _check_layout(layout: Layout, topology: Topology, shapes: dict[str, tuple[int, ...]]) -> None:
    problems = fit_problems(layout, shapes) + topology_problems(layout, topology)
    if problems:
        raise LayoutError(f"the layout {layout.name!r} does not fit this save: " + summarize(problems))


def _write_files(
    storage: Storage, stage: Staging, files: tuple[FilePlan, ...], local: dict[tuple[str, Box], torch.Tensor], threads: int,
    staging_pool: BouncePool | None, asks: tuple[str, list[list[Ask]]] | None, sidecar: bool = True,
) -> list[tuple[Written | None, Outcome | None]]:
    """Write this rank's files; incrementally (`asks`: the base's name and what it holds of each
    item), only what changed, and with what was done with each item."""
    base = base_reader(storage, asks[0]) if asks is not None and any(a.patch_budget for f in asks[1] for a in f) else None

    def one(n: int) -> tuple[Written | None, Outcome | None]:
        f = files[n]
        if asks is None:
            return _write_file(storage, stage.key(f.path), f, local, staging_pool, sidecar), None
        return write_changed(storage, stage.key(f.path), f, local, asks[1][n], base)

    if threads <= 1 or len(files) <= 1:
        return [one(n) for n in range(len(files))]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(one, range(len(files))))


def _write_file(
    storage: Storage, key: str, plan: FilePlan, local: dict[tuple[str, Box], torch.Tensor], pool: BouncePool | None,
    sidecar: bool = True,
) -> Written:
    tensors = [local[(item.fqn, item.box)] for item, _ in plan.items]
    bodies = staged_bytes(tensors, pool) if pool is not None else (byte_view(host_contiguous(t)) for t in tensors)
    return write_safetensors(storage, key, plan.path, [(k, item.dtype, item.box.lengths) for item, k in plan.items], bodies,
                             sidecar=sidecar)


def _commit(
    results: list[Any],
    plan: SavePlan,
    loc: Location,
    stage: Staging,
    step: int,
    topo: Topology,
    info: CheckpointInfo | None,
    tokenizer: str | os.PathLike[str] | None,
    objects: dict[str, Any],
    kinds: Mapping[str, str] | None,
    update_latest: bool,
    layout: Layout | None,
    base: Base | None,
    groups: dict[str, DerivedGroup] | None = None,
) -> Manifest:
    errors = [f"rank {r}: {res[1]}" for r, res in enumerate(results) if res[0] != "ok"]
    if errors:
        raise StorageError("payload writes failed, nothing committed: " + summarize(errors))
    patches: dict[str, list[Patch]] = {}
    if any(outcome is not None for _, done in results for _, outcome in done):
        parts = assembled(results, plan, stage, base)
        plan, files, patches = parts.plan, parts.files, parts.patches
    elif groups is not None:  # one file per rank, in rank order: file r is rank r's
        files = [ws[0][0].entry(stage.path(ws[0][0].path)) for _, ws in results]
    else:
        written = {w.path: w for _, ws in results for w, _ in ws}
        files = [written[f.path].entry(stage.path(f.path)) for f in plan.all_files()]
    paths = [file_name(r, None) for r in range(len(results))] if groups is not None else [f.path for f in plan.all_files()]
    index = {p: i for i, p in enumerate(paths)}
    tok_info = None
    if tokenizer is not None:
        tok_files = _copy_tokenizer(loc.storage, stage, tokenizer)
        files += tok_files
        tok_info = TokenizerInfo(name=os.path.basename(os.fspath(tokenizer).rstrip("/")), files=tuple(f.path for f in tok_files))
    manifest = Manifest(
        checkpoint_id=uuid.uuid4().hex,
        step=step,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        producer=Producer(ckptkit=__version__, torch=torch.__version__, python=platform.python_version()),
        topology=topo,
        files=tuple(files),
        tensors=_with_patches(tensor_entries(plan, index, lambda fqn: kind_of(fqn, kinds or {})), patches),
        objects=objects,
        info=info or CheckpointInfo(),
        tokenizer=tok_info,
        layout=None if layout is None else layout.to_json(),
        derived=None if groups is None else Derived(rule=RULE, groups=groups),
    )
    commit(loc, stage, manifest_to_json(manifest), update_latest=update_latest, step=step)
    return manifest


def _with_patches(tensors: dict[str, TensorEntry], patches: dict[str, list[Patch]]) -> dict[str, TensorEntry]:
    return {fqn: e.model_copy(update={"patches": tuple(patches[fqn])}) if patches.get(fqn) else e for fqn, e in tensors.items()}


def kind_of(fqn: str, kinds: Mapping[str, str]) -> str:
    """Return a tensor's kind: the longest matching user prefix, else the default for its top key."""
    for prefix in sorted(kinds, key=len, reverse=True):
        if fqn == prefix or fqn.startswith(prefix.rstrip("/") + "/"):
            kind = kinds[prefix]
            if kind not in KINDS:
                raise LayoutError(f"kind {kind!r} for {prefix!r} is not one of {', '.join(KINDS)}")
            return kind
    return DEFAULT_KINDS.get(fqn.split("/", 1)[0], "other")


def _copy_tokenizer(storage: Storage, stage: Staging, source: str | os.PathLike[str]) -> list[FileEntry]:
    src = os.fspath(source)
    if os.path.isdir(src):
        names = sorted(
            os.path.relpath(os.path.join(d, n), src) for d, _, ns in os.walk(src) for n in ns
        )
        paths = [(os.path.join(src, n), n.replace(os.sep, "/")) for n in names]
    elif os.path.isfile(src):
        paths = [(src, os.path.basename(src))]
    else:
        raise StorageError(f"tokenizer {src}: no such file or directory")
    entries = []
    for file_path, rel in paths:
        with open(file_path, "rb") as f:
            data = f.read()
        entries.append(write_small(storage, stage, f"tokenizer/{rel}", data, role="tokenizer"))
    return entries
