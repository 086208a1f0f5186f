"""Seeded fuzz of every read command on damaged checkpoints.

Run: ``.venv/bin/python -m tests.fuzz --count 2000 --seed 1 --json out.json`` (prints the counts
table; ``--jobs 2`` runs two batches at once; ``--index I --work DIR`` reruns mutation ``#I`` alone
and keeps its damaged copy). ``tests/test_fuzz.py`` runs it with a fixed seed.

What it does
------------
1. Builds two small real checkpoints once per run (``build``, in a subprocess): one written by
   ``ckptkit.save`` (fp32, bf16, fp16 and int64 tensors; grid cells, explicit cuts and ZeRO-style
   boxes over seven payload files; JSON objects; a tokenizer file) and one by the reference
   trainer (tiny model, tp 2, one step), plus the golden exports of each (zarr, Hugging Face).
2. For each of N mutations drawn from the seed it copies one checkpoint root (``latest`` and
   the step directory) to a fresh directory, applies one mutation (``MUTATIONS``: manifest
   edits, safetensors header edits, payload bytes, file types, ``latest`` edits) and runs
   every read command on the copy (``COMMANDS``): the CLI (verify, verify --quick, inspect, ls,
   diff, reshard, export) and the library (``ckptkit.load``, whole and into ShardedTensor
   targets cut differently from the saved boxes), always naming the root, so that ``latest``
   is followed.
3. Commands run in one long-lived worker process per batch (``Worker``), which imports
   torch and ckptkit once and forks a child per command. The child runs in a sandbox cwd with
   ``RLIMIT_AS`` = the worker's address space + ``MEMORY_HEADROOM`` and ``CKPTKIT_DEBUG=1`` (so
   an internal error surfaces as the exception, with its traceback, instead of exit 3); the
   worker kills the child's process group when it runs past ``wall_s`` or sits blocked without
   using CPU for ``idle_s`` (a FIFO read), and reports its peak RSS from ``os.wait4``.

The property checked (``judge``)
--------------------------------
The harness computes, from bytes and without ckptkit, what a mutation changed (``Facts``):

- ``manifest_same``: manifest.json is a regular file whose JSON value equals the original's
  (types included; a duplicated key with the same value is the same, one with another value
  is not; whitespace does not matter);
- ``latest_same``: ``latest`` holds the same lines (name and its checksum; whitespace aside);
- ``files_same``: every file the original manifest lists is a regular file with the same bytes;
- ``layout_same``: ... a regular file of the same size, payloads with the same safetensors
  header (``__metadata__`` aside): only tensor (and tokenizer) bytes may differ;
- ``data_same``: every payload has the same header and tensor bytes (tokenizer files aside).

Manifests are sealed since schema 1.2 (``manifest_checksum``), so an edited manifest must be
refused by every command that reads it. Mutations marked ``+signed`` re-seal the edited
manifest, as a buggy or hostile writer would, to reach the checks behind the seal: then the
manifest is authentic, and only its consistency with the payloads is at stake; ``neutral``
signed edits (the step, dropping block checksums) leave a sound checkpoint.

A run passes when it either exits 0 and its result is exactly the saved data, or exits 1/2
with one line on stderr starting ``ckptkit: error:`` (verify and diff may instead exit 1 with
an empty stderr: their findings / differences go to stdout), and in both cases writes nothing
outside its DST folder, and leaves no DST (nor a staging leftover) when it fails. Exit 0 is
accepted when:

- ``ls``: always (a listing validates nothing);
- ``inspect``: ``latest_same`` and (``manifest_same`` or signed);
- ``verify``: ``latest_same``, ``files_same`` and (``manifest_same`` or signed neutral);
- ``verify --quick``: the same with ``layout_same`` instead of ``files_same`` (it skips checksums);
- ``load`` / ``load-sharded``: every tensor (name, dtype, shape, bytes) and JSON value equal
  the original (checked in the child), and (``manifest_same`` or signed);
- ``diff ORIGINAL COPY --include-rng`` (exit 0 = equal): ``latest_same``, ``data_same`` and
  (``manifest_same`` or signed neutral, or signed and both loads of the same copy were exact);
- ``reshard`` / ``export``: DST loads to exactly the original data (reshard: plus the same
  tokenizer bytes; export hf: every file but export_report.json byte-identical to the golden
  export; export zarr: every chunk and zarr.json identical and the DST loads exactly), and
  (``manifest_same`` or signed).

Never: exit 3 (an exception escaping the CLI), a traceback, a signal, a hang or timeout,
memory over the bound, a multi-line or malformed error, files changed outside DST.
"""

from __future__ import annotations

import argparse
import base64
import collections
import io
import json
import math
import os
import random
import re
import resource
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("load", "load-sharded", "verify", "verify-quick", "inspect", "ls", "diff", "reshard", "export")
MEMORY_HEADROOM = 768 << 20  # address space a child may add to the worker's
HUGE = 2 << 30  # sparse "huge" files: more than any child may allocate
SAVE_STEP, TRAIN_STEP = 3, 1


# ---------------------------------------------------------------------------------------------
# Building the two checkpoints and the golden exports (runs in a subprocess: it imports torch)
# ---------------------------------------------------------------------------------------------

def saved_state() -> dict[str, Any]:
    """The state that the ``save`` checkpoint holds, as ShardedTensor boxes (deterministic)."""
    import torch
    from ckptkit import ShardedTensor

    g = torch.Generator().manual_seed(7)
    w = torch.randn(12, 10, generator=g)
    m = torch.randn(12, 10, generator=g)
    b16 = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    h = torch.randn(7, generator=g).to(torch.float16)
    idx = torch.arange(30, dtype=torch.int64).reshape(5, 6) * 12345678901
    flat = m.flatten()
    return {
        "model": {
            "w": [ShardedTensor(w[0:6].clone(), (12, 10), (0, 0)), ShardedTensor(w[6:12].clone(), (12, 10), (6, 0))],
            "b16": [ShardedTensor(b16[:, 0:3].clone(), (6, 8), (0, 0)), ShardedTensor(b16[:, 3:8].clone(), (6, 8), (0, 3))],
            "h": h,
        },
        "optimizer": {"exp_avg": {"w": (ShardedTensor.from_flat(flat[0:17].clone(), (12, 10), 0)
                                        + ShardedTensor.from_flat(flat[17:100].clone(), (12, 10), 17)
                                        + ShardedTensor.from_flat(flat[100:].clone(), (12, 10), 100))}},
        "buffers": {"idx": idx},
        "scheduler": {"last_lr": 3e-4, "milestones": [1, 2, 3], "name": "cosine", "on": True, "none": None},
        "data": {"consumed": 12345, "epoch": 0},
    }


def whole_state() -> dict[str, Any]:
    """`saved_state` with every tensor whole (what a load must return)."""
    import torch
    from ckptkit import ShardedTensor

    def whole(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: whole(x) for k, x in v.items()}
        if isinstance(v, list) and v and all(isinstance(s, ShardedTensor) for s in v):
            out = torch.empty(v[0].global_shape, dtype=v[0].local.dtype)
            for s in v:
                if s.local.dim() == 1 and len(s.global_shape) == 2:  # a flat ZeRO range
                    raise AssertionError("unexpected flat range")
                out[tuple(slice(o, o + n) for o, n in zip(s.global_offsets, s.local.shape))] = s.local
            return out
        return v

    return whole(saved_state())


def build(out: Path) -> None:
    """Write both checkpoint roots and their golden exports under `out`."""
    import ckptkit

    tok = out / "tokenizer-src"
    tok.mkdir(parents=True)
    (tok / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"vocab": {"a": 0, "b": 1}}}))
    ckptkit.save(saved_state(), str(out / "save" / f"step_{SAVE_STEP:08d}"), step=SAVE_STEP, max_file_bytes=300,
                 tokenizer=str(tok))
    cli = [sys.executable, "-m", "ckptkit.cli"]
    subprocess.run([*cli, "train", "--tp", "2", "--steps", str(TRAIN_STEP), "--save-every", "1", "--out",
                    str(out / "train"), "--quiet"], check=True)
    (out / "golden").mkdir()
    subprocess.run([*cli, "export", str(out / "save"), str(out / "golden" / "save"), "--format", "zarr"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*cli, "export", str(out / "train"), str(out / "golden" / "train"), "--format", "hf"],
                   check=True, stdout=subprocess.DEVNULL)


# ---------------------------------------------------------------------------------------------
# JSON with its duplicate keys kept (for text-level mutations) and compared by value
# ---------------------------------------------------------------------------------------------

class Obj(list):  # type: ignore[type-arg]
    """A JSON object as its list of (key, value) pairs, duplicates kept."""


@dataclass(frozen=True)
class Raw:
    """A number written verbatim (``1e999``)."""

    text: str


class Conflict:
    """A key that appears twice with different values: equal to nothing."""

    def __eq__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return id(self)


def parse_pairs(text: bytes | str) -> Any:
    return json.loads(text, object_pairs_hook=Obj)


def dumps(v: Any) -> str:
    if isinstance(v, Obj):
        return "{" + ",".join(json.dumps(k) + ":" + dumps(x) for k, x in v) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dumps(x) for x in v) + "]"
    if isinstance(v, Raw):
        return v.text
    return json.dumps(v)


def _norm_pairs(pairs: list[tuple[str, Any]]) -> Any:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out and out[k] != v:
            out[k] = Conflict()
        else:
            out[k] = v
    return ("obj", tuple(sorted(out.items(), key=lambda kv: kv[0])))


def _norm_float(x: float) -> Any:
    return ("float", repr(x))


def semantic(text: bytes) -> Any:
    """A comparable form of a JSON document: values with their types; objects as sorted items,
    a key repeated with another value as a `Conflict`. Raises ValueError when not JSON."""
    def norm(v: Any) -> Any:
        if isinstance(v, tuple) and v and v[0] == "obj":
            return ("obj", tuple((k, norm(x)) for k, x in v[1]))
        if isinstance(v, list):
            return ("list", tuple(norm(x) for x in v))
        if isinstance(v, bool) or v is None:
            return ("const", v)
        if isinstance(v, int):
            return ("int", v)
        return v

    try:
        return norm(json.loads(text, object_pairs_hook=_norm_pairs, parse_float=lambda s: _norm_float(float(s)),
                               parse_constant=lambda s: ("const", s)))
    except RecursionError as exc:
        raise ValueError("too deep") from exc


def seal(doc: Obj) -> None:
    """Re-seal an edited manifest (``manifest_checksum`` = xxh3-128 of its canonical body), in place."""
    import xxhash

    body = [(k, v) for k, v in doc if k != "manifest_checksum"]
    canon = json.dumps(_plain(Obj(body)), sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                       allow_nan=False).encode()
    doc[:] = body + [("manifest_checksum", "xxh3-128:" + xxhash.xxh3_128_hexdigest(canon))]


def _plain(v: Any) -> Any:
    if isinstance(v, Obj):
        return {k: _plain(x) for k, x in v}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, Raw):
        return float(v.text)
    return v


def can_seal(manifest: bytes) -> bool:
    """Whether `seal` reproduces the checksum of this (pristine) manifest."""
    doc = parse_pairs(manifest)
    claimed = dict(doc).get("manifest_checksum")
    if not claimed:
        return False
    copy = Obj(list(doc))
    try:
        seal(copy)
    except (ImportError, ValueError):
        return False
    return dict(copy)["manifest_checksum"] == claimed


# ---------------------------------------------------------------------------------------------
# The checkpoints as the harness knows them
# ---------------------------------------------------------------------------------------------

@dataclass
class Base:
    """One pristine checkpoint root: where it is, its step directory, its listed files."""

    name: str  # "save" or "train"
    root: Path
    step_dir: str
    manifest: bytes
    files: list[dict[str, Any]]  # the manifest's file entries
    sealable: bool
    export_format: str

    @property
    def payloads(self) -> list[str]:
        return [f["path"] for f in self.files if f.get("role", "tensors") == "tensors"]

    @property
    def tokenizer_files(self) -> list[str]:
        return [f["path"] for f in self.files if f.get("role") == "tokenizer"]


def latest_lines(data: bytes) -> list[str]:
    """The lines of a ``latest`` pointer, stripped, blank ones dropped (name, then its checksum)."""
    return [line.strip() for line in data.decode("utf-8", "replace").split("\n") if line.strip()]


def load_base(name: str, root: Path) -> Base:
    step_dir = latest_lines((root / "latest").read_bytes())[0]
    manifest = (root / step_dir / "manifest.json").read_bytes()
    files = json.loads(manifest)["files"]
    return Base(name, root, step_dir, manifest, files, can_seal(manifest), "zarr" if name == "save" else "hf")


def st_header(data: bytes) -> tuple[int, bytes] | None:
    """The safetensors header (length, JSON bytes) of payload bytes, or None if malformed."""
    if len(data) < 8:
        return None
    n = struct.unpack("<Q", data[:8])[0]
    if n > len(data) - 8:
        return None
    return n, data[8 : 8 + n]


# ---------------------------------------------------------------------------------------------
# Facts: what a mutation changed, from bytes (never opens anything but regular files)
# ---------------------------------------------------------------------------------------------

@dataclass
class Facts:
    manifest_same: bool
    latest_same: bool
    files_same: bool
    layout_same: bool
    data_same: bool


def _regular_bytes(path: Path, limit: int = 64 << 20) -> bytes | None:
    try:
        st = os.stat(path)  # follows symlinks, as a reader would
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        return None
    try:
        return path.read_bytes()
    except OSError:
        return None


def _header_value(data: bytes) -> Any:
    head = st_header(data)
    if head is None:
        return None
    try:
        value = semantic(head[1])
    except ValueError:
        return None
    if isinstance(value, tuple) and value[0] == "obj":
        return ("obj", tuple(kv for kv in value[1] if kv[0] != "__metadata__"))
    return value


def compute_facts(base: Base, root: Path) -> Facts:
    latest = _regular_bytes(root / "latest")
    latest_same = latest is not None and latest_lines(latest) == latest_lines((base.root / "latest").read_bytes())
    step = root / base.step_dir
    manifest = _regular_bytes(step / "manifest.json")
    try:
        manifest_same = manifest is not None and semantic(manifest) == semantic(base.manifest)
    except ValueError:
        manifest_same = False
    files_same = layout_same = data_same = True
    for entry in base.files:
        now = _regular_bytes(step / entry["path"])
        before = (base.root / base.step_dir / entry["path"]).read_bytes()
        if now == before:
            continue
        files_same = False
        tensors = entry.get("role", "tensors") == "tensors"
        if now is None or len(now) != len(before):
            layout_same = False
            data_same = data_same and not tensors
            continue
        if not tensors:
            continue  # a tokenizer file: same size, other bytes; no header, no tensor data
        hb, hn = _header_value(before), _header_value(now)
        if hn is None or hn != hb:
            layout_same = data_same = False
            continue
        nb, nn = st_header(before), st_header(now)
        assert nb is not None and nn is not None
        if before[8 + nb[0]:] != now[8 + nn[0]:]:
            data_same = False
    return Facts(manifest_same, latest_same, files_same, layout_same, data_same)


# ---------------------------------------------------------------------------------------------
# Mutations
# ---------------------------------------------------------------------------------------------

@dataclass
class Mutation:
    kind: str  # family.name[:target][+signed]
    detail: str
    signed: bool = False
    neutral: bool = False


class Skip(Exception):
    """This mutation does not apply here (nothing to edit, mknod refused)."""


MUTATIONS = [
    "manifest.flip_bit", "manifest.flip_byte", "manifest.number", "manifest.delete_key", "manifest.dup_key",
    "manifest.shared_key", "manifest.encoding_raw", "manifest.truncate", "manifest.nest_bomb", "manifest.huge",
    "header.len_huge", "header.len_small", "header.flip", "header.shape_inf", "header.shape_2p62",
    "header.dup_key", "header.nest_bomb", "header.overlap",
    "payload.flip", "payload.truncate", "payload.append", "payload.zero_range",
    "ftype.fifo", "ftype.symlink_in", "ftype.symlink_out", "ftype.dir", "ftype.chardev",
    "latest.garbage", "latest.missing", "latest.dotdot", "latest.huge",
]
SIGNABLE = {"manifest.number", "manifest.delete_key", "manifest.dup_key", "manifest.shared_key", "manifest.encoding_raw"}


def _walk_json(v: Any, path: tuple[Any, ...] = ()) -> Any:
    """Yield (path, container, index, value) for every member of a pairs tree."""
    if isinstance(v, Obj):
        for i, (k, x) in enumerate(v):
            yield (*path, k), v, i, x
            yield from _walk_json(x, (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield (*path, i), v, i, x
            yield from _walk_json(x, (*path, i))


def _number_field(path: tuple[Any, ...]) -> str | None:
    p = [str(x) for x in path]
    if p == ["step"]:
        return "step"
    if p[0] == "tensors" and len(p) >= 3:
        if p[2] == "shape":
            return "shape"
        if "offsets" in p:
            return "offsets"
        if "lengths" in p:
            return "lengths"
        if "cuts" in p:
            return "cuts"
        if p[-1] == "file" or "files" in p:
            return "file"
    if p[0] == "files" and p[-1] == "size":
        return "block_size" if "blocks" in p else "size"
    if p[0] == "topology":
        return "topology"
    return None


def _set(container: Any, index: int, value: Any) -> None:
    if isinstance(container, Obj):
        container[index] = (container[index][0], value)
    else:
        container[index] = value


def mutate_manifest(rng: random.Random, name: str, base: Base, path: Path, signed: bool) -> Mutation:
    text = path.read_bytes()
    if name in ("flip_bit", "flip_byte"):
        data = bytearray(text)
        i = rng.randrange(len(data))
        old = data[i]
        data[i] ^= (1 << rng.randrange(8)) if name == "flip_bit" else rng.randrange(1, 256)
        path.write_bytes(bytes(data))
        return Mutation(f"manifest.{name}", f"offset {i}: {bytes([old])!r} -> {bytes([data[i]])!r} near {text[max(0, i - 30):i + 10]!r}")
    if name == "truncate":
        n = rng.randrange(len(text))
        path.write_bytes(text[:n])
        return Mutation("manifest.truncate", f"to {n} of {len(text)} bytes")
    if name == "nest_bomb":
        depth = rng.choice([2000, 100_000, 1_000_000])
        doc = parse_pairs(text)
        bomb = "[" * depth + "]" * depth
        where = rng.choice(["objects", "whole"])
        if where == "whole":
            path.write_text(bomb)
        else:
            body = dumps(Obj([(k, v) for k, v in doc if k != "objects"]))
            path.write_text(body[:-1] + ',"objects":{"x":' + bomb + "}}")
        return Mutation("manifest.nest_bomb", f"depth {depth} ({where})")
    if name == "huge":
        with open(path, "r+b") as f:
            f.truncate(HUGE)  # the original text, then NULs (sparse)
        return Mutation("manifest.huge", f"{HUGE} bytes, sparse")
    doc = parse_pairs(text)
    neutral = False
    if name == "number":
        leaves: dict[str, list[Any]] = collections.defaultdict(list)
        for p, container, i, v in _walk_json(doc):
            if isinstance(v, int) and not isinstance(v, bool):
                fieldname = _number_field(p)
                if fieldname and not (signed and fieldname in ("topology", "block_size")):
                    leaves[fieldname].append((p, container, i, v))
        fieldname = rng.choice(sorted(leaves))
        p, container, i, old = rng.choice(leaves[fieldname])
        choices = [0, 1, -1, old + 1, old - 1, 2, 2**31, 2**32 + 1, 2**53 + 1, 2**63, 2**64, 10**9, 10**18, 10**30]
        if fieldname == "cuts":
            choices += [10**9] * 6 + [10**6] * 2
        new = rng.choice([c for c in choices if c != old])
        _set(container, i, new)
        neutral = fieldname == "step" and 0 <= new < 2**63
        detail, kind = f"{'/'.join(map(str, p))}: {old} -> {new}", f"manifest.number:{fieldname}"
    elif name == "delete_key":
        members = [(p, c, i) for p, c, i, _ in _walk_json(doc) if isinstance(c, Obj)]
        if signed:  # only inside tensor and file entries: a tensor gone would be a legitimately smaller checkpoint
            members = [m for m in members if (m[0][0] == "tensors" and len(m[0]) >= 3) or (m[0][0] == "files" and len(m[0]) >= 3)]
        p, c, i = rng.choice(members)
        value = c[i][1]
        del c[i]
        # Neutral: block checksums (the file checksum still covers the file), or a file field
        # holding its default value (the manifest means the same without it).
        neutral = p[-1] == "blocks" or (p[0] == "files" and _default_of_file_field(p[2:]) == value)
        detail, kind = "/".join(map(str, p)), "manifest.delete_key"
    elif name == "dup_key":
        members = [(p, c, i) for p, c, i, _ in _walk_json(doc) if isinstance(c, Obj)]
        p, c, i = rng.choice(members)
        key, value = c[i]
        same = rng.random() < 0.5 or len(c) < 2
        other = value if same else c[(i + 1) % len(c)][1]
        c.insert(i + rng.choice([0, 1]), (key, other))
        detail, kind = f"{'/'.join(map(str, p))} ({'same' if same else 'other'} value)", "manifest.dup_key:" + ("same" if same else "other")
    elif name == "shared_key":
        detail = _share_key(rng, doc)
        kind = "manifest.shared_key"
    elif name == "encoding_raw":
        files = dict(doc)["files"]
        i = rng.choice([k for k, f in enumerate(files) if dict(f).get("role", "tensors") == "tensors"])
        entry = files[i]
        entry[:] = [(k, v) for k, v in entry if k != "encoding"] + [("encoding", "raw")]
        detail, kind = f"files/{i} ({dict(entry)['path']})", "manifest.encoding_raw"
    else:
        raise AssertionError(name)
    if signed:
        seal(doc)
        kind += "+signed"
    path.write_text(dumps(doc))
    return Mutation(kind, detail, signed=signed, neutral=signed and neutral)


def _default_of_file_field(path: tuple[Any, ...]) -> Any:
    """The schema's default of a member of a manifest file entry, by its path inside the entry
    (`("role",)`, `("blocks", "algorithm")`); a sentinel when it has none."""
    from ckptkit.manifest import BlockChecksums, FileEntry

    model = {(): FileEntry, ("blocks",): BlockChecksums}.get(tuple(path[:-1]))
    field_info = model.model_fields.get(path[-1]) if model is not None and isinstance(path[-1], str) else None
    return field_info.default if field_info is not None and not field_info.is_required() else _NO_DEFAULT


_NO_DEFAULT = object()


def _shards(entry: Obj) -> list[Obj]:
    """The objects holding a payload `key` in a tensor entry (the grid spec, or each box)."""
    spec = dict(entry)["shards"]
    d = dict(spec)
    if d.get("layout") == "boxes":
        return list(d["boxes"])
    return [spec]


def _share_key(rng: random.Random, doc: Obj) -> str:
    """Point one tensor's shard at the payload key (and file) of another tensor's shard."""
    tensors = dict(doc)["tensors"]
    holders = [(name, s) for name, entry in tensors for s in _shards(entry)]
    a_name, a = rng.choice(holders)
    others = [(n, s) for n, s in holders if dict(s)["key"] != dict(a)["key"] or n != a_name]
    same_dtype = [(n, s) for n, s in others if dict(dict(tensors)[n])["dtype"] == dict(dict(tensors)[a_name])["dtype"]]
    b_name, b = rng.choice(same_dtype or others)
    db = dict(b)
    for field_name in ("key", "file", "files"):
        if field_name in db and field_name in dict(a):
            a[:] = [(k, db[field_name] if k == field_name else v) for k, v in a]
    return f"{a_name} -> key {db['key']!r} of {b_name}"


def mutate_header(rng: random.Random, name: str, path: Path) -> Mutation:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header, rest = data[8:8 + n], data[8 + n:]
    if name == "len_huge":
        new = rng.choice([2**62, 2**64 - 1, len(data) * 1000, 2**32, HUGE])
        path.write_bytes(struct.pack("<Q", new) + data[8:])
        return Mutation("header.len_huge", f"{n} -> {new}")
    if name == "len_small":
        new = rng.choice([0, 1, 2, n - 1, n // 2])
        path.write_bytes(struct.pack("<Q", new) + data[8:])
        return Mutation("header.len_small", f"{n} -> {new}")
    if name == "flip":
        i = rng.randrange(n)
        b = bytearray(data)
        old = b[8 + i]
        b[8 + i] ^= rng.randrange(1, 256)
        path.write_bytes(bytes(b))
        return Mutation("header.flip", f"header byte {i}: {bytes([old])!r} -> {bytes([b[8 + i]])!r} near {header[max(0, i - 25):i + 10]!r}")
    if name == "nest_bomb":
        depth = rng.choice([2000, 100_000])
        bomb = ('{"__metadata__":{"x":' + "[" * depth + "]" * depth + "}}").encode()
        path.write_bytes(struct.pack("<Q", len(bomb)) + bomb + rest)
        return Mutation("header.nest_bomb", f"depth {depth}")
    doc = parse_pairs(header)
    tensors = [i for i, (k, _) in enumerate(doc) if k != "__metadata__"]
    i = rng.choice(tensors)
    key, entry = doc[i]
    if name in ("shape_inf", "shape_2p62"):
        shape = dict(entry)["shape"]
        if not shape:
            raise Skip("0-d tensor")
        j = rng.randrange(len(shape))
        shape[j] = Raw("1e999") if name == "shape_inf" else 2**62
        detail = f"{key} shape[{j}]"
    elif name == "dup_key":
        same = rng.random() < 0.5
        copy = entry if same else Obj([(k, [0, 0] if k == "data_offsets" else v) for k, v in entry])
        doc.insert(i + 1, (key, copy))
        detail = f"{key} ({'same' if same else 'other'} value)"
    elif name == "overlap":
        offs = dict(entry)["data_offsets"]
        length = offs[1] - offs[0]
        starts = [dict(doc[t][1])["data_offsets"][0] for t in tensors if t != i]
        starts = [x for x in starts if x != offs[0]] or [offs[0] - 1 if offs[0] > 0 else offs[0] + 1]
        start = rng.choice(starts)
        entry[:] = [(k, [start, start + length] if k == "data_offsets" else v) for k, v in entry]
        detail = f"{key} data_offsets {offs} -> {[start, start + length]}"
    else:
        raise AssertionError(name)
    text = dumps(doc).encode()
    if len(text) <= n:
        text += b" " * (n - len(text))  # same size: the manifest's size check does not end the story
    path.write_bytes(struct.pack("<Q", len(text)) + text + rest)
    return Mutation(f"header.{name}", detail)


def mutate_payload(rng: random.Random, name: str, path: Path) -> Mutation:
    data = bytearray(path.read_bytes())
    if name == "flip":
        i = rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
        detail = f"byte {i} of {len(data)}"
    elif name == "truncate":
        n = struct.unpack("<Q", data[:8])[0]
        cut = rng.choice([0, 4, 8, 8 + n, rng.randrange(len(data)), len(data) - 1])
        del data[cut:]
        detail = f"to {cut} bytes"
    elif name == "append":
        k = rng.choice([1, 7, 4096])
        data += bytes(rng.randrange(256) for _ in range(k))
        detail = f"{k} bytes"
    elif name == "zero_range":
        i = rng.randrange(len(data))
        j = min(len(data), i + rng.choice([1, 8, 64, 4096]))
        data[i:j] = bytes(j - i)
        detail = f"[{i}, {j})"
    else:
        raise AssertionError(name)
    path.write_bytes(bytes(data))
    return Mutation(f"payload.{name}", detail)


def _flip_copy(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` with one byte of its second half changed (same size, same header)."""
    data = bytearray(src.read_bytes())
    data[len(data) // 2 + (len(data) // 4)] ^= 0x5A
    dst.write_bytes(bytes(data))


def mutate_ftype(rng: random.Random, name: str, base: Base, root: Path, outside: Path) -> Mutation:
    step = root / base.step_dir
    targets = {"payload": None, "manifest": step / "manifest.json", "latest": root / "latest"}
    if base.tokenizer_files:
        targets["tokenizer"] = step / rng.choice(base.tokenizer_files)
    which = rng.choice(sorted(targets))
    target = targets[which] or step / rng.choice(base.payloads)
    original = target.read_bytes()
    os.remove(target)
    if name == "fifo":
        os.mkfifo(target)
    elif name == "dir":
        os.mkdir(target)
    elif name == "chardev":
        try:
            os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
        except OSError as exc:
            target.write_bytes(original)
            raise Skip(f"mknod: {exc}") from exc
    elif name == "symlink_in":
        others = [step / p for p in base.payloads + ["manifest.json"] if step / p != target]
        link = rng.choice(others) if which != "latest" else step / "manifest.json"
        os.symlink(os.path.relpath(link, target.parent), target)
    elif name == "symlink_out":
        outside.mkdir(exist_ok=True)
        dst = outside / f"{which}-{target.name}"
        if which == "latest":
            dst.write_text(f"../evil/{base.step_dir}\n")
        else:
            tmp = outside / "original"
            tmp.write_bytes(original)
            _flip_copy(tmp, dst)
            tmp.unlink()
        os.symlink(dst, target)
    else:
        raise AssertionError(name)
    return Mutation(f"ftype.{name}:{which}", str(target.relative_to(root)))


def mutate_latest(rng: random.Random, name: str, base: Base, root: Path, evil: Path) -> Mutation:
    path = root / "latest"
    if name == "garbage":
        text = rng.choice([b"", b"\x00\xff\xfe garbage", bytes(rng.randrange(256) for _ in range(40)), b"\n\n",
                           b"/", b".", b"..", b"step_\xff\xfe"])
        path.write_bytes(text)
        detail = repr(text)
    elif name == "missing":
        text = rng.choice(["step_99999999", base.step_dir + "x", base.step_dir.upper()])
        path.write_text(text + "\n")
        detail = text
    elif name == "dotdot":
        # A valid checkpoint (another one) lies there: following it would load other data.
        other = "train" if base.name == "save" else "save"
        src = base.root.parent / other
        other_step = latest_lines((src / "latest").read_bytes())[0]
        shutil.copytree(src / other_step, evil / other_step, symlinks=True)
        text = rng.choice([f"../evil/{other_step}", f"{base.step_dir}/../../evil/{other_step}",
                           str((evil / other_step).resolve())])
        path.write_text(text + "\n")
        detail = text
    elif name == "huge":
        with open(path, "r+b") as f:
            f.truncate(HUGE)
        detail = f"{HUGE} bytes, sparse"
    else:
        raise AssertionError(name)
    return Mutation(f"latest.{name}", detail)


def apply_mutation(rng: random.Random, kind: str, base: Base, run: Path) -> Mutation:
    root = run / "ckpt"
    family, name = kind.split(".")
    if family == "manifest":
        signed = kind in SIGNABLE and base.sealable and rng.random() < 0.5
        return mutate_manifest(rng, name, base, root / base.step_dir / "manifest.json", signed)
    if family == "header":
        return _on_file(mutate_header(rng, name, root / base.step_dir / (p := rng.choice(base.payloads))), p)
    if family == "payload":
        return _on_file(mutate_payload(rng, name, root / base.step_dir / (p := rng.choice(base.payloads))), p)
    if family == "ftype":
        return mutate_ftype(rng, name, base, root, run / "outside")
    return mutate_latest(rng, name, base, root, run / "evil")


def _on_file(m: Mutation, path: str) -> Mutation:
    m.detail = f"{path}: {m.detail}"
    return m


# ---------------------------------------------------------------------------------------------
# The worker: imports ckptkit once, forks a bounded child per command
# ---------------------------------------------------------------------------------------------

def _flat(node: Any, is_tensor: Any, path: str = "") -> tuple[dict[str, Any], dict[str, Any]]:
    """Tensor leaves and JSON leaves of a nested result by '/' path (a dict without tensors is a leaf)."""
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}

    def holds(v: Any) -> bool:
        return is_tensor(v) or (isinstance(v, dict) and any(holds(x) for x in v.values()))

    def walk(v: Any, p: str) -> None:
        if is_tensor(v):
            tensors[p] = v
        elif isinstance(v, dict) and (not p or holds(v)):
            for k, x in v.items():
                walk(x, f"{p}/{k}" if p else str(k))
        else:
            objects[p] = v

    walk(node, path)
    return tensors, objects


def _typed(v: Any) -> Any:
    """JSON value with its types, for exact comparison (True != 1, 1 != 1.0)."""
    if isinstance(v, dict):
        return ("obj", tuple(sorted((k, _typed(x)) for k, x in v.items())))
    if isinstance(v, (list, tuple)):
        return ("list", tuple(_typed(x) for x in v))
    if isinstance(v, float):
        return ("float", repr(v))
    return (type(v).__name__, v)


class Reference:
    """The data a load must return: tensors as (dtype, shape, bytes), JSON leaves typed."""

    def __init__(self, tensors: dict[str, Any], objects: dict[str, Any]) -> None:
        self.tensors = {k: (str(t.dtype), tuple(t.shape), _bytes(t)) for k, t in tensors.items()}
        self.whole = tensors
        self.objects = {k: _typed(v) for k, v in objects.items()}

    def compare(self, tensors: dict[str, Any], objects: dict[str, Any]) -> str:
        """'' when equal, else what differs first."""
        if set(tensors) != set(self.tensors):
            return f"tensor names differ: missing {sorted(set(self.tensors) - set(tensors))[:3]}, extra {sorted(set(tensors) - set(self.tensors))[:3]}"
        for k, t in tensors.items():
            got = (str(t.dtype), tuple(t.shape), _bytes(t))
            if got != self.tensors[k]:
                what = "dtype" if got[0] != self.tensors[k][0] else "shape" if got[1] != self.tensors[k][1] else "bytes"
                return f"{k}: {what} differ ({got[0]} {list(got[1])} vs {self.tensors[k][0]} {list(self.tensors[k][1])})"
        typed = {k: _typed(v) for k, v in objects.items()}
        if typed != self.objects:
            diff = sorted(k for k in set(typed) | set(self.objects) if typed.get(k) != self.objects.get(k))
            return f"JSON values differ: {diff[:3]}"
        return ""


def _bytes(t: Any) -> bytes:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _targets(ref: Reference) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """ShardedTensor targets cut unlike any saved boxes (3 uneven pieces along the last dim,
    pre-filled with 0xA5), nested like the state; and fqn -> pieces."""
    import torch
    from ckptkit import ShardedTensor

    nested: dict[str, Any] = {}
    pieces: dict[str, list[Any]] = {}
    for fqn, t in ref.whole.items():
        shape = tuple(t.shape)
        if not shape or shape[-1] < 3:
            parts = [ShardedTensor(_filled(torch.empty(shape, dtype=t.dtype)), shape, (0,) * len(shape))]
        else:
            n = shape[-1]
            cuts = [0, 1, max(2, n // 2 + 1), n]
            parts = []
            for a, b in zip(cuts, cuts[1:]):
                local = _filled(torch.empty((*shape[:-1], b - a), dtype=t.dtype))
                parts.append(ShardedTensor(local, shape, (0,) * (len(shape) - 1) + (a,)))
        pieces[fqn] = parts
        node = nested
        *head, last = fqn.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = parts
    return nested, pieces


def _filled(t: Any) -> Any:
    import torch

    if t.numel():
        t.reshape(-1).view(torch.uint8).fill_(0xA5)
    return t


def _assemble(ref: Reference, pieces: dict[str, list[Any]]) -> dict[str, Any]:
    import torch

    out = {}
    for fqn, parts in pieces.items():
        whole = torch.empty(ref.whole[fqn].shape, dtype=ref.whole[fqn].dtype)
        for s in parts:
            whole[tuple(slice(o, o + n) for o, n in zip(s.global_offsets, s.local.shape))] = s.local
        out[fqn] = whole
    return out


def _tree_files(root: Path, skip: set[str]) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            if rel not in skip:
                out[rel] = p.read_bytes()
    return out


class WorkerState:
    """What the worker holds: the references of both checkpoints and the golden exports' paths."""

    def __init__(self, bases_dir: Path) -> None:
        import torch

        torch.set_num_threads(1)
        import ckptkit
        import ckptkit.cli  # noqa: F401  (imported once, before any fork)
        from ckptkit.state.torch_io import is_leaf

        self.is_leaf = is_leaf
        self.bases_dir = bases_dir
        tensors, objects = _flat(whole_state(), lambda v: isinstance(v, torch.Tensor))
        self.refs = {"save": Reference(tensors, objects)}
        loaded = ckptkit.load(str(bases_dir / "train"))
        self.refs["train"] = Reference(*_flat(loaded, lambda v: isinstance(v, torch.Tensor)))
        for name in ("save", "train"):  # the pristine copies are what the references say
            problem = self.refs[name].compare(*_flat(ckptkit.load(str(bases_dir / name)), lambda v: isinstance(v, torch.Tensor)))
            if problem:
                raise RuntimeError(f"pristine {name} checkpoint does not load as saved: {problem}")
        self.tokenizer = {n: _tree_files(bases_dir / n / latest_lines((bases_dir / n / "latest").read_bytes())[0] / "tokenizer", set())
                          for n in ("save", "train")}

    def check_load(self, base: str, result: Any) -> str:
        import torch

        return self.refs[base].compare(*_flat(result, lambda v: isinstance(v, torch.Tensor)))

    def check_dst(self, base: str, cmd: str, dst: Path) -> str:
        """'' when DST holds exactly the original data (see the module docstring)."""
        import ckptkit

        if cmd == "reshard" or base == "save":
            problem = self.check_load(base, ckptkit.load(str(dst)))
            if problem:
                return f"DST loads other data: {problem}"
        if cmd == "reshard":
            step = (dst / "tokenizer") if (dst / "tokenizer").exists() else None
            got = _tree_files(step, set()) if step else {}
            if got != self.tokenizer[base]:
                return "DST tokenizer files differ from the original"
            return ""
        golden = self.bases_dir / "golden" / base
        skip = {"export_report.json", "manifest.json"}
        want, got = _tree_files(golden, skip), _tree_files(dst, skip)
        if set(want) != set(got):
            return f"DST files differ from the golden export: missing {sorted(set(want) - set(got))[:3]}, extra {sorted(set(got) - set(want))[:3]}"
        bad = sorted(k for k in want if want[k] != got[k])
        return f"DST files differ from the golden export: {bad[:3]}" if bad else ""


def _argv(req: dict[str, Any]) -> list[str]:
    root, cmd = req["root"], req["cmd"]
    dst = req["dst"]
    return {
        "verify": ["verify", root],
        "verify-quick": ["verify", "--quick", root],
        "inspect": ["inspect", root],
        "ls": ["ls", root],
        "diff": ["diff", req["original"], root, "--include-rng"],
        "reshard": ["reshard", root, dst, "--tp", "1", "--threads", "2"],
        "export": ["export", root, dst, "--format", req["export_format"]],
    }[cmd]


def _where(tb: Any) -> str:
    """The innermost frame of ckptkit in a traceback: file:line function."""
    frames = [f for f in traceback.extract_tb(tb) if "/ckptkit/" in f.filename]
    if not frames:
        frames = traceback.extract_tb(tb)[-1:]
    if not frames:
        return ""
    f = frames[-1]
    name = f.filename.split("/ckptkit/")[-1] if "/ckptkit/" in f.filename else os.path.basename(f.filename)
    return f"ckptkit/{name}:{f.lineno} {f.name}" if "/ckptkit/" in f.filename else f"{name}:{f.lineno} {f.name}"


def child_main(state: WorkerState, req: dict[str, Any], limit: int) -> None:
    """Run one command in this (forked) child and write result.json into the cwd; never returns."""
    result: dict[str, Any] = {"code": None, "error": "", "traceback": "", "where": "", "check": ""}
    try:
        os.setpgid(0, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(req["wall_s"]) + 2)
        os.chdir(req["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(os.open("stdout.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
        os.dup2(os.open("stderr.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        os.environ.update(CKPTKIT_DEBUG="1", TMPDIR=os.path.join(req["cwd"], "tmp"), HOME=req["cwd"])
        tempfile.tempdir = None
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        result["code"] = _run(state, req, result)
    except BaseException as exc:  # noqa: BLE001  (whatever escapes is the finding)
        result["code"] = 3
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
        result["traceback"] = traceback.format_exc()[-3000:]
        result["where"] = _where(exc.__traceback__)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    try:
        with open("result.tmp", "w") as f:
            json.dump(result, f)
        os.rename("result.tmp", "result.json")
    finally:
        os._exit(0)


def _run(state: WorkerState, req: dict[str, Any], result: dict[str, Any]) -> int:
    import ckptkit
    import ckptkit.cli

    cmd, base = req["cmd"], req["base"]
    if cmd in ("load", "load-sharded"):
        try:
            if cmd == "load":
                out = ckptkit.load(req["root"])
                result["check"] = state.check_load(base, out)
            else:
                ref = state.refs[base]
                target, pieces = _targets(ref)
                out = ckptkit.load(req["root"], target)
                tensors = _assemble(ref, pieces)
                _, objects = _flat(out, state.is_leaf)
                result["check"] = ref.compare(tensors, objects)
            return 0
        except ckptkit.CkptkitError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            return 2 if isinstance(exc, ckptkit.CheckpointNotFoundError) else 1
    sys.argv = ["ckptkit", *_argv(req)]
    try:
        ckptkit.cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and cmd in ("reshard", "export"):
        result["check"] = state.check_dst(base, cmd, Path(req["dst"]))
    return code


def _proc_cpu(pid: int) -> tuple[float, bool] | None:
    """CPU seconds of the process and whether any of its threads is runnable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        running = False
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("R", "D"):
                    running = True
                    break
        return cpu, running
    except (OSError, IndexError, ValueError):
        return None


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run_child(state: WorkerState, req: dict[str, Any]) -> dict[str, Any]:
    """Fork, run `req` in the child, supervise it; return the outcome."""
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    limit = _vm_size() + MEMORY_HEADROOM
    sys.stdout.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child_main(state, req, limit)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    killed = ""
    last_cpu, last_change, delay = -1.0, start, 0.002
    try:  # wakes up as soon as the child exits (Linux 5.3+); else poll with a growing delay
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        now = time.monotonic()
        sample = _proc_cpu(pid)
        if sample is not None:
            cpu, running = sample
            if cpu != last_cpu or running:
                last_cpu, last_change = cpu, now
        if now - last_change > req["idle_s"]:
            killed = f"hang: blocked for {req['idle_s']} s without using CPU"
        elif now - start > req["wall_s"]:
            killed = f"timeout: still running after {req['wall_s']} s"
        if killed:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
            _, status, usage = os.wait4(pid, 0)
            break
        if pidfd is not None:
            select.select([pidfd], [], [], 0.2)
        else:
            time.sleep(delay)
            delay = min(0.05, delay * 1.5)
    if pidfd is not None:
        os.close(pidfd)
    elapsed = time.monotonic() - start
    out: dict[str, Any] = {"elapsed": round(elapsed, 3), "rss_mb": round(usage.ru_maxrss / 1024, 1),
                           "rss_growth_mb": round(max(0, usage.ru_maxrss - base_rss) / 1024, 1), "killed": killed,
                           "signal": "", "limit_mb": limit >> 20}
    try:  # reap stray grandchildren of the command, if any
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if os.WIFSIGNALED(status) and not killed:
        out["signal"] = signal.Signals(os.WTERMSIG(status)).name
    cwd = Path(req["cwd"])
    result_file = cwd / "result.json"
    out["result"] = json.loads(result_file.read_text()) if result_file.exists() else None
    for name in ("stdout", "stderr"):
        p = cwd / f"{name}.txt"
        out[name] = p.read_bytes()[:20000].decode("utf-8", "replace") if p.exists() else ""
    return out


def worker_main(bases_dir: str) -> None:
    """Serve requests (one JSON line each on stdin) with one JSON line each on stdout."""
    state = WorkerState(Path(bases_dir))
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints must not break the protocol
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = run_child(state, req)
        except Exception as exc:  # noqa: BLE001
            reply = {"worker_error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()


class Worker:
    """The parent's handle on a worker process (restarted if it dies)."""

    def __init__(self, bases_dir: Path) -> None:
        self.bases_dir = bases_dir
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "CKPTKIT_DEBUG"}
        env.update(MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz", "--worker", str(self.bases_dir)], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fuzz worker did not start (see its stderr above)")

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc = None
            return {"worker_error": "the worker died"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
            self.proc = None


# ---------------------------------------------------------------------------------------------
# Judging one run
# ---------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    index: int
    base: str
    mutation: str
    detail: str
    command: str
    code: int | None
    outcome: str  # "ok" | "rejected" | a violation class
    violation: bool
    message: str = ""  # stderr first line, the error, or what was wrong
    where: str = ""  # innermost ckptkit frame of an exception
    elapsed: float = 0.0
    rss_mb: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


ERROR_LINE = re.compile(r"^ckptkit: error: \S")
FINDING_LINE = re.compile(r"^\[[\w.-]+\] ")


def accept_zero(cmd: str, facts: Facts, m: Mutation, loads_exact: bool) -> str:
    """'' when exit 0 is acceptable for this command and mutation, else why not."""
    manifest_ok = facts.manifest_same or (m.signed and m.neutral)
    authentic = facts.manifest_same or m.signed
    if cmd == "ls":
        return ""
    if cmd == "inspect":
        ok = facts.latest_same and authentic
    elif cmd == "verify":
        ok = facts.latest_same and facts.files_same and manifest_ok
    elif cmd == "verify-quick":
        ok = facts.latest_same and facts.layout_same and manifest_ok
    elif cmd == "diff":
        ok = facts.latest_same and facts.data_same and (manifest_ok or (m.signed and loads_exact))
    else:  # load, load-sharded, reshard, export: the data were checked in the child
        ok = authentic
    if ok:
        return ""
    changed = [n for n, v in asdict(facts).items() if not v]
    return "accepted a damaged checkpoint (changed: " + ", ".join(changed or ["signed manifest"]) + ")"


def judge(reply: dict[str, Any], cmd: str, facts: Facts, m: Mutation, loads_exact: bool) -> tuple[int | None, str, str, str]:
    """(exit code, outcome, message, where) for one run."""
    if "worker_error" in reply:
        return None, "harness-error", reply["worker_error"], ""
    result = reply["result"]
    stderr = reply["stderr"]
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if reply["killed"]:
        return None, reply["killed"].split(":")[0], reply["killed"], ""
    if reply["signal"]:
        return None, "signal", f"killed by {reply['signal']}", ""
    if result is None:
        return None, "no-result", "the child wrote no result (died)", ""
    code, where = result["code"], result["where"]
    if code == 3:
        last = result["traceback"].strip().splitlines()[-1] if result["traceback"] else result["error"]
        kind = "memory" if "MemoryError" in last else "exit3"
        return 3, kind, last, where
    if "Traceback" in stderr:
        return code, "traceback", stderr.strip().splitlines()[-1], ""
    if reply["rss_growth_mb"] * (1 << 20) > MEMORY_HEADROOM:
        return code, "memory", f"peak RSS grew by {reply['rss_growth_mb']} MB", ""
    if code == 0:
        if result["check"]:
            return 0, "wrong-data", result["check"], ""
        why = accept_zero(cmd, facts, m, loads_exact)
        return 0, ("accepted-damaged" if why else "ok"), why, ""
    if code not in (1, 2):
        return code, "bad-exit", first, ""
    if cmd in ("load", "load-sharded"):
        msg = result["error"]
        return code, ("bad-error" if "\n" in msg.strip() or not msg else "rejected"), msg.splitlines()[0] if msg else "", ""
    if not lines and code == 1 and cmd in ("verify", "verify-quick", "diff"):
        out = [ln for ln in reply["stdout"].splitlines() if ln.strip()]
        if cmd != "diff" and not all(FINDING_LINE.match(ln) for ln in out[:-1]):
            return code, "bad-output", next(ln for ln in out[:-1] if not FINDING_LINE.match(ln)), ""
        return code, "rejected", out[0] if out else "", ""
    if len(lines) != 1 or not ERROR_LINE.match(first):
        return code, "bad-stderr", f"{len(lines)} stderr line(s): {first[:300]!r}", ""
    return code, "rejected", first, ""


# ---------------------------------------------------------------------------------------------
# Running a batch
# ---------------------------------------------------------------------------------------------

def snapshot(paths: list[Path], skip: set[Path]) -> dict[str, tuple[int, int, int]]:
    """lstat of every entry under `paths` but `skip`: type, size, mtime."""
    snap = {}
    for top in paths:
        if not top.exists():
            continue
        for dirpath, dirs, names in os.walk(top):
            dirs[:] = [d for d in dirs if Path(dirpath) / d not in skip]
            for n in dirs + names:
                p = Path(dirpath) / n
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                snap[str(p)] = (stat.S_IFMT(st.st_mode), st.st_size if not stat.S_ISDIR(st.st_mode) else 0, st.st_mtime_ns)
    return snap


def _snap_diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")


def _clear(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def run_batch(bases_dir: Path, work: Path, seed: int, indices: list[int], wall_s: float, idle_s: float,
              progress: Any = None, keep: bool = False) -> list[Outcome]:
    """Run mutations `indices` (each drawn from `seed` and its index) on one worker."""
    bases = {n: load_base(n, bases_dir / n) for n in ("save", "train")}
    worker = Worker(bases_dir)
    worker.start()
    outcomes: list[Outcome] = []
    pristine = snapshot([bases_dir], set())
    try:
        for index in indices:
            outcomes += _one(worker, bases, bases_dir, work, seed, index, wall_s, idle_s, pristine, keep)
            if progress:
                progress(index)
    finally:
        worker.close()
    return outcomes


def _one(worker: Worker, bases: dict[str, Base], bases_dir: Path, work: Path, seed: int, index: int, wall_s: float,
         idle_s: float, pristine: dict[str, Any], keep: bool = False) -> list[Outcome]:
    rng = random.Random(f"{seed}:{index}")
    base = bases[rng.choice(sorted(bases))]
    run = work / f"m{index:05d}"
    for _ in range(10):
        _clear(run)
        run.mkdir(parents=True)
        shutil.copytree(base.root, run / "ckpt", symlinks=True)
        kind = rng.choice(MUTATIONS)
        try:
            m = apply_mutation(rng, kind, base, run)
            break
        except Skip:
            continue
    else:
        return []
    facts = compute_facts(base, run / "ckpt")
    out, cwd = run / "out", run / "cwd"
    watched = snapshot([run], {out, cwd})
    outcomes: list[Outcome] = []
    loads_exact = True
    for cmd in COMMANDS:
        _clear(out)
        _clear(cwd)
        out.mkdir()
        (cwd / "tmp").mkdir(parents=True)
        req = {"cmd": cmd, "base": base.name, "root": str(run / "ckpt"), "original": str(base.root),
               "dst": str(out / "dst"), "cwd": str(cwd), "export_format": base.export_format,
               "wall_s": wall_s, "idle_s": idle_s}
        reply = worker.run(req)
        code, outcome, message, where = judge(reply, cmd, facts, m, loads_exact)
        if cmd in ("load", "load-sharded") and not (code == 0 and outcome == "ok"):
            loads_exact = False
        # Side effects: nothing changed outside DST's folder; no DST after a failure.
        if outcome in ("ok", "rejected", "accepted-damaged", "wrong-data"):
            moved = _snap_diff(watched, snapshot([run], {out, cwd})) or _snap_diff(pristine, snapshot([bases_dir], set()))
            left = sorted(os.listdir(out)) if out.exists() else []
            if moved:
                outcome, message = "wrote-outside", f"changed: {moved}"
            elif code != 0 and left:
                outcome, message = "dst-left", f"left in DST's folder after exit {code}: {left}"
        violation = outcome not in ("ok", "rejected")
        outcomes.append(Outcome(index, base.name, m.kind, m.detail, cmd, code, outcome, violation, message[:400], where,
                                reply.get("elapsed", 0.0), reply.get("rss_mb", 0.0),
                                {"facts": asdict(facts)} if violation else {}))
    if not keep:
        _clear(run)
    return outcomes


# ---------------------------------------------------------------------------------------------
# The harness: build once, run batches, summarize
# ---------------------------------------------------------------------------------------------

def prepare(work: Path) -> Path:
    """Build the checkpoints and golden exports under `work`/bases (a subprocess); return it."""
    bases = work / "bases"
    env = {k: v for k, v in os.environ.items() if k != "CKPTKIT_DEBUG"}
    subprocess.run([sys.executable, "-m", "tests.fuzz", "--build", str(bases)], cwd=REPO, env=env, check=True)
    return bases


def fuzz(count: int, seed: int, *, jobs: int = 1, wall_s: float = 20.0, idle_s: float = 3.0,
         work: Path | None = None, progress: Any = None, only: int | None = None) -> list[Outcome]:
    """Run `count` mutations from `seed` (each on every read command; or just mutation `only`,
    whose copy is then kept under `work`); return every outcome."""
    tmp = None
    if work is None:
        tmp = tempfile.mkdtemp(prefix="ckptkit-fuzz-")
        work = Path(tmp)
    try:
        bases_dir = prepare(work)
        if only is not None:
            return run_batch(bases_dir, work / "runs0", seed, [only], wall_s, idle_s, progress, keep=True)
        chunks = [list(range(j, count, jobs)) for j in range(jobs)]
        if jobs == 1:
            return run_batch(bases_dir, work / "runs0", seed, chunks[0], wall_s, idle_s, progress)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(jobs) as pool:
            futures = [pool.submit(run_batch, bases_dir, work / f"runs{j}", seed, chunk, wall_s, idle_s, progress)
                       for j, chunk in enumerate(chunks)]
            outcomes = [o for f in futures for o in f.result()]
        return sorted(outcomes, key=lambda o: (o.index, COMMANDS.index(o.command)))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def summary(outcomes: list[Outcome]) -> dict[tuple[str, str, str], int]:
    """Counts by (mutation kind, command, outcome)."""
    return dict(sorted(collections.Counter((o.mutation, o.command, o.outcome) for o in outcomes).items()))


def _normalize(text: str) -> str:
    text = re.sub(r"/\S*?ckptkit-fuzz-\w+/\S*", "<path>", text)
    text = re.sub(r"/tmp/\S+", "<path>", text)
    text = re.sub(r"\b\d+\b", "N", text)
    return re.sub(r"'[^']{20,}'", "'…'", text)[:200]


def violation_classes(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Distinct violations: (mutation kind, command, outcome, exit, normalized message, where)."""
    groups: dict[tuple[str, ...], list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        if o.violation:
            groups[(o.mutation, o.command, o.outcome, str(o.code), _normalize(o.message), o.where)].append(o)
    return [{"mutation": k[0], "command": k[1], "outcome": k[2], "code": k[3], "message": v[0].message,
             "where": k[5], "count": len(v), "example": f"#{v[0].index} {v[0].base}: {v[0].detail}"[:300]}
            for k, v in sorted(groups.items())]


def format_table(outcomes: list[Outcome]) -> str:
    counts = summary(outcomes)
    width = max([len(k[0]) for k in counts] + [8])
    lines = [f"{'mutation':<{width}}  {'command':<13} {'outcome':<17} count"]
    lines += [f"{m:<{width}}  {c:<13} {o:<17} {n}" for (m, c, o), n in counts.items()]
    bad = sum(o.violation for o in outcomes)
    lines.append(f"{len(outcomes)} runs, {bad} violation(s), {len({o.index for o in outcomes})} mutations")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=100, help="mutations (each runs every command)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1, help="batches (workers) at once")
    parser.add_argument("--json", default=None, help="write every outcome, the counts and the violation classes here")
    parser.add_argument("--wall", type=float, default=20.0, help="seconds a command may run")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds a command may sit blocked without CPU")
    parser.add_argument("--work", default=None, help="keep the work folder here (default: a temp dir, removed)")
    parser.add_argument("--index", type=int, default=None,
                        help="run only mutation INDEX of the seed (as '#INDEX' in a report) and keep its copy under --work")
    parser.add_argument("--build", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build:
        build(Path(args.build))
        return 0
    if args.worker:
        worker_main(args.worker)
        return 0
    start = time.monotonic()
    work = Path(args.work) if args.work else None
    if work:
        work.mkdir(parents=True, exist_ok=True)
    outcomes = fuzz(args.count, args.seed, jobs=args.jobs, wall_s=args.wall, idle_s=args.idle, work=work, only=args.index,
                    progress=lambda i: print(f"\rmutation {i + 1}/{args.count}", end="", file=sys.stderr, flush=True))
    elapsed = time.monotonic() - start
    print(file=sys.stderr)
    print(format_table(outcomes))
    classes = violation_classes(outcomes)
    print(f"\n{len(classes)} distinct violation class(es); {elapsed:.0f} s, "
          f"{elapsed / max(1, args.count):.2f} s per mutation")
    for c in classes:
        print(f"- {c['mutation']} -> {c['command']} -> {c['outcome']} (exit {c['code']}, x{c['count']}): "
              f"{c['message'][:200]}" + (f" [{c['where']}]" if c["where"] else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "seed": args.seed, "count": args.count, "seconds": round(elapsed, 1),
            "counts": [{"mutation": k[0], "command": k[1], "outcome": k[2], "count": n} for k, n in summary(outcomes).items()],
            "violations": classes,
            "outcomes": [asdict(o) for o in outcomes],
        }, indent=1))
    return 1 if classes else 0


if __name__ == "__main__":
    sys.exit(main())
