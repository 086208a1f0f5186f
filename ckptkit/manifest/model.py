"""The checkpoint manifest, schema v1: pydantic models, parsing with version checks, serialization.

A committed checkpoint is a directory (or prefix) holding ``manifest.json``, written last. The
manifest names every payload file with its size and checksum and every tensor with its global
shape, dtype, kind and shards (boxes of the global tensor and where their bytes are). Nothing
in it knows about TP, PP or ZeRO: a layout is only a way to cut global tensors into boxes.
"""

from __future__ import annotations

import base64
import functools
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_serializer, model_serializer, model_validator

import xxhash

from ..boxes import Box
from ..errors import ManifestError
from . import strictjson
from .derived import RULES, FileList, TensorTable, listed_files, listed_tensors, pack_table, table_files

FORMAT = "ckptkit"
SCHEMA_MAJOR = 1
SCHEMA_MINOR = 6  # 1.1: raw files, format files; 1.2: block checksums, the seal, the layout; 1.3: info.source;
# 1.4: files of an earlier checkpoint (FileEntry.base) and the digests of a file's keys (FileEntry.contents);
# 1.5: block digests in a file's sidecar (BlockChecksums.digests omitted);
# 1.6: files in a packed table (FileTable), tensors derived from the layout (Derived)
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"
MANIFEST_NAME = "manifest.json"
# No manifest is read past this size: a larger file is refused before it is parsed.
MANIFEST_LIMIT = 256 << 20
# Since 1.2 the manifest carries the checksum of its own content (see `seal`).
SEALED_SINCE = (1, 2)
# Since 1.6: file tables and derived tensors.
TABLE_SINCE = (1, 6)

Kind = Literal["param", "optimizer", "buffer", "rng", "other"]
KINDS: tuple[str, ...] = ("param", "optimizer", "buffer", "rng", "other")


class Model(BaseModel):
    """Base of every manifest model: strict, frozen, unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Producer(Model):
    """Versions of the software that wrote the checkpoint."""

    ckptkit: str
    torch: str | None = None
    python: str | None = None


class Topology(Model):
    """The parallel layout of the job that wrote the checkpoint.

    Ranks are ordered tp fastest, then cp, dp, pp (``rank_order`` names the order from
    fastest to slowest). ``ep`` divides ``dp`` for expert parallel layers.
    """

    world_size: int = Field(ge=1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    dp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    zero_stage: int = Field(default=0, ge=0, le=3)
    rank_order: str = "tp-cp-dp-pp"

    def describe(self) -> str:
        """The topology in words, as messages show it (``tp=2 pp=1 dp=4 zero=1``)."""
        extra = "".join(f" {axis}={n}" for axis, n in (("cp", self.cp), ("ep", self.ep)) if n != 1)
        return f"tp={self.tp} pp={self.pp} dp={self.dp}{extra} zero={self.zero_stage}"


SIDECAR_SUFFIX = ".blocks"  # since 1.5: a file's block digests, beside it: ``<path>.blocks``


class BlockChecksums(Model):
    """Since 1.2: the checksum of each `size`-byte block of a file (the last block may be
    shorter), so that a read of part of the file checks exactly the blocks it touches: the
    blocks' 8-byte xxh3-64 digests (big-endian), in order.

    Up to 1.4 ``digests`` holds them, in base64, in the manifest. Since 1.5 it is omitted where
    they are in the file's sidecar, ``<path>.blocks`` beside the file (`SIDECAR_SUFFIX`): those
    bytes exactly, checked against the file's ``xxh3-128-blocks:`` checksum, which is their
    xxh3-128, before any digest is used. So the manifest does not grow with the files' sizes.
    """

    algorithm: Literal["xxh3-64"] = "xxh3-64"
    size: int = Field(ge=1)
    digests: str | None = Field(default=None, exclude_if=lambda v: v is None)

    def inline(self) -> bytes | None:
        """The digests the manifest holds (None where they are in the sidecar)."""
        return None if self.digests is None else _decoded(self.digests)

    def count(self, file_size: int) -> int:
        """How many blocks a file of `file_size` bytes has."""
        return -(-file_size // self.size)


def file_checksum_of_blocks(digests: bytes | bytearray | memoryview) -> str:
    """The file checksum of a file whose block digests, concatenated, are `digests`."""
    return "xxh3-128-blocks:" + xxhash.xxh3_128_hexdigest(digests)


@functools.lru_cache(maxsize=1024)
def _decoded(digests: str) -> bytes:
    try:
        return base64.b64decode(digests, validate=True)
    except ValueError:
        return b""  # a malformed value: consistency checks report it, and no block then matches


class FileEntry(Model):
    """One payload file of the checkpoint, relative to the checkpoint directory.

    ``role``: ``tensors`` (payload), ``tokenizer`` and ``asset`` (carried over by reshard and
    export), ``format`` (since 1.1: a file of the storage form itself, such as the ``zarr.json``
    documents of the zarr form, never carried over), ``kept`` (since 1.4: a payload file of this
    checkpoint from before it was compacted, read by later checkpoints only, never carried over). ``encoding`` of a tensors file: ``safetensors`` (the default, omitted when written), or
    ``raw`` (since 1.1): the file is the bytes of exactly one shard, C order, little-endian,
    from offset 0, possibly followed by padding (the chunks of the zarr form).

    Since 1.5 a file's block digests may be in its sidecar, ``<path>.blocks`` (see `BlockChecksums`).

    Since 1.4 (incremental saves): ``base``, the name of the earlier committed checkpoint under
    the same root whose file this is (the file is ``<base>/<path>``, read and checked as any
    other; omitted for the checkpoint's own files), and ``contents``, the xxh3-128 of the bytes
    each key of a safetensors file holds, by which a later save finds what did not change.
    """

    path: str
    size: int = Field(ge=0)
    checksum: str
    role: Literal["tensors", "tokenizer", "asset", "format", "kept"] = "tensors"
    encoding: Literal["safetensors", "raw"] = Field(default="safetensors", exclude_if=lambda v: v == "safetensors")
    blocks: BlockChecksums | None = Field(default=None, exclude_if=lambda v: v is None)
    base: str | None = Field(default=None, exclude_if=lambda v: v is None)  # since 1.4
    contents: dict[str, str] | None = Field(default=None, exclude_if=lambda v: v is None)  # since 1.4

    def where(self) -> str:
        """The file as messages and reports name it, relative to the checkpoint: its path, or
        ``../<base>/<path>`` for an earlier checkpoint's file."""
        return self.path if self.base is None else f"../{self.base}/{self.path}"

    def sidecar(self) -> bool:
        """Whether the file's block digests are in its sidecar (``<path>.blocks``)."""
        return self.blocks is not None and self.blocks.digests is None


@dataclass(frozen=True, slots=True)
class Shard:
    """A box of a global tensor and where its bytes are: file index and key in that file (in
    memory: what a spec, listed or derived, expands to)."""

    box: Box
    file: int
    key: str


class BoxShard(Model):
    """One shard: a box of the global tensor and the file and key holding its bytes."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int = Field(ge=0)
    key: str


class BoxShards(Model):
    """Shards written as an explicit list of boxes."""

    layout: Literal["boxes"] = "boxes"
    boxes: tuple[BoxShard, ...]


class FileRange(Model):
    """Cell i of a grid lives in file ``start + i * step``."""

    start: int = Field(ge=0)
    step: int = Field(ge=0)


class GridShards(Model):
    """Shards written as a regular grid, for tensors cut the same way on many ranks.

    ``cuts`` has one entry per dim: a chunk count (cells of ceil(size / count) elements as
    torch.chunk cuts them, trailing cells possibly empty) or the explicit cut positions
    from 0 to the size. Cells are numbered row-major; ``files`` gives each cell's file
    index (a list, or an arithmetic range); every cell's bytes sit under the same ``key``.
    Empty cells hold no bytes.
    """

    layout: Literal["grid"] = "grid"
    cuts: tuple[Union[int, tuple[int, ...]], ...]
    files: Union[tuple[int, ...], FileRange]
    key: str


ShardSpec = Annotated[Union[BoxShards, GridShards], Field(discriminator="layout")]


class Patch(Model):
    """Since 1.4 (incremental saves): the elements of one box of a tensor that differ from what
    its shards (and the patches before this one) hold. ``indices`` names a 1-d ``uint32`` (or
    ``int64``) array of ``count`` strictly increasing flat, C-order positions inside the box,
    ``values`` a 1-d array of the tensor's dtype of their new values, both keys of payload file
    ``file``; ``digest`` is the xxh3-128 of the box's bytes once patched (what a later save
    compares its box with)."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int = Field(ge=0)
    indices: str
    values: str
    count: int = Field(ge=0)
    digest: str


class TensorEntry(Model):
    """A global (logical) tensor and its shards; since 1.4, the patches applied over them, in
    order (an incremental save's sparse changes, `Patch`)."""

    shape: tuple[int, ...]
    dtype: str
    kind: Kind
    shards: ShardSpec
    patches: tuple[Patch, ...] = Field(default=(), exclude_if=lambda v: not v)


class ParamGroup(Model):
    """An optimizer parameter group: the tensors it holds (by name) and its options."""

    params: tuple[str, ...]
    options: dict[str, JsonValue] = Field(default_factory=dict)


class OptimizerInfo(Model):
    """What optimizer the state belongs to: type, hyper-parameters, parameter groups."""

    type: str
    hyperparameters: dict[str, JsonValue] = Field(default_factory=dict)
    param_groups: tuple[ParamGroup, ...] = ()
    step: int | None = None


class DataProgress(Model):
    """Where the data stream stands, in terms that do not depend on the data-parallel size."""

    seed: int | None = None
    epoch: int = 0
    consumed_samples: int = 0
    consumed_tokens: int = 0
    state: dict[str, JsonValue] = Field(default_factory=dict)


class CodeVersion(Model):
    """The code that produced the checkpoint."""

    git_commit: str | None = None
    dirty: bool | None = None
    packages: dict[str, str] = Field(default_factory=dict)


class DataVersion(Model):
    """The data set the run trained on."""

    dataset_id: str | None = None
    fingerprint: str | None = None


class ModelInfo(Model):
    """Model family and configuration, as export needs them (e.g. ``family="llama"``)."""

    family: str
    config: dict[str, JsonValue] = Field(default_factory=dict)


class TokenizerInfo(Model):
    """The tokenizer files stored in the checkpoint (each also listed, hashed, in ``files``)."""

    name: str | None = None
    files: tuple[str, ...]


class SourceInfo(Model):
    """Since 1.3: what a converted checkpoint was converted from: the converter (``format``), the
    directory it read (absolute), the version of the tool that wrote it where the source records
    one, how many processes wrote it where its files show it, and the topology it was saved at
    where the source says (absent where it does not: a torch DCP save does not say how its ranks
    were split)."""

    format: str
    path: str
    version: str | None = Field(default=None, exclude_if=lambda v: v is None)
    ranks: int | None = Field(default=None, ge=1, exclude_if=lambda v: v is None)
    topology: Topology | None = Field(default=None, exclude_if=lambda v: v is None)


class CheckpointInfo(Model):
    """Training assets beside the tensors; every section is optional.

    ``rng`` describes the RNG streams whose states are saved as uint8 tensors of kind
    ``rng``; ``scheduler`` and ``loss_scaler`` hold the state of those objects as JSON.
    """

    optimizer: OptimizerInfo | None = None
    scheduler: dict[str, JsonValue] | None = None
    loss_scaler: dict[str, JsonValue] | None = None
    rng: dict[str, JsonValue] | None = None
    data_progress: DataProgress | None = None
    code: CodeVersion | None = None
    data: DataVersion | None = None
    config: dict[str, JsonValue] | None = None
    model: ModelInfo | None = None
    source: SourceInfo | None = Field(default=None, exclude_if=lambda v: v is None)  # since 1.3


class FileTable(Model):
    """Since 1.6: the first `count` files described rather than listed. File i is
    ``rank<i>.safetensors`` (i zero-padded to 5 digits), a tensors file in safetensors with its
    block digests in its sidecar. Base64 arrays, one item per file: ``sizes`` (8-byte
    little-endian), ``checksums`` (the 16-byte xxh3-128 of the file's block digests: its
    ``xxh3-128-blocks:`` checksum) and ``block_sizes`` (4-byte little-endian). In memory the
    manifest's ``files`` hold the table's entries first; this field is the document's only."""

    count: int = Field(ge=0)
    sizes: str
    checksums: str
    block_sizes: str


class DerivedGroup(Model):
    """The dtype and kind of every tensor of one derived state group."""

    dtype: str
    kind: Kind


class Derived(Model):
    """Since 1.6: tensors the manifest does not list. Every tensor of the layout's state groups
    named in `groups` is there, with the dtype and kind given; its boxes, the file holding each
    and the key there follow from the layout and the topology by `rule`: ``ranges`` (see
    ``ckptkit.layouts.saved``: rank r writes file r, each data-parallel rank its ZeRO ranges, a
    group held whole dealt box by box to the replicas)."""

    rule: Literal["ranges"]
    groups: dict[str, DerivedGroup]


class Manifest(Model):
    """The manifest of one committed checkpoint (schema v1).

    Since 1.6 ``files`` and ``tensors`` hold, in memory, what the document describes as well as
    what it lists (`FileTable`, `Derived`); a manifest is written with the longest run of rank
    files from the first as a table (once there are 64 of them) and without its derived tensors.
    """

    format: Literal["ckptkit"] = "ckptkit"
    schema_version: str = SCHEMA_VERSION
    checkpoint_id: str
    step: int = Field(ge=0)
    created_at: str
    producer: Producer
    topology: Topology
    files: tuple[FileEntry, ...]
    tensors: dict[str, TensorEntry]
    objects: dict[str, JsonValue] = Field(default_factory=dict)
    info: CheckpointInfo = Field(default_factory=CheckpointInfo)
    tokenizer: TokenizerInfo | None = None
    # Since 1.2: the model's layout (a ``ckptkit-layout`` document, see ``ckptkit.layouts``),
    # from which reshard places the tensors on any topology. Omitted when unknown.
    layout: dict[str, JsonValue] | None = Field(default=None, exclude_if=lambda v: v is None)
    # Since 1.2: the checksum of the rest of the document (see `seal`). Computed whenever a
    # manifest is written; checked and dropped when one is parsed, so always None in memory.
    manifest_checksum: str | None = Field(default=None, exclude=True)
    # Since 1.6: the files described by a table (the document's; in memory, part of ``files``).
    file_table: FileTable | None = Field(default=None, exclude_if=lambda v: v is None)
    # Since 1.6: the tensors derived from the layout.
    derived: Derived | None = Field(default=None, exclude_if=lambda v: v is None)

    @model_validator(mode="after")
    def _described(self) -> Manifest:
        """Take in what the document describes: a table's files, a rule's tensors."""
        if self.file_table is not None:
            try:
                files = FileList(self.file_table, self.files)
            except ValueError as exc:
                raise ValueError(f"file_table: {exc}") from None
            object.__setattr__(self, "files", files)
            object.__setattr__(self, "file_table", None)
        if self.derived is not None and not isinstance(self.tensors, TensorTable):
            factory = RULES.get(self.derived.rule)
            if factory is None:
                raise ValueError(f"derived: rule {self.derived.rule!r} is not known (import ckptkit.layouts)")
            object.__setattr__(self, "tensors", TensorTable(self.tensors, factory(self)))
        return self

    def _tabled(self) -> int:
        """How many files, from the first, this manifest writes as a table."""
        return table_files(self.files) if _version(self.schema_version) >= TABLE_SINCE else 0

    @field_serializer("files")
    def _files_listed(self, files: Any) -> tuple[FileEntry, ...]:
        return listed_files(files, self._tabled())

    @field_serializer("tensors")
    def _tensors_listed(self, tensors: Any) -> dict[str, TensorEntry]:
        return listed_tensors(tensors)

    @model_serializer(mode="wrap")
    def _with_table(self, handler: Any) -> dict[str, Any]:
        doc: dict[str, Any] = handler(self)
        count = self._tabled()
        if count:
            doc["file_table"] = pack_table(self.files, count)
        return doc

    def bases(self) -> tuple[str, ...]:
        """The earlier checkpoints (names under the same root) whose files this one refers to, sorted."""
        listed = self.files.listed if isinstance(self.files, FileList) else self.files
        return tuple(sorted({f.base for f in listed if f.base is not None}))


def manifest_to_json(manifest: Manifest) -> bytes:
    """Serialize a manifest to compact, deterministic UTF-8 JSON, sealed with its checksum (a
    manifest of a version before 1.2 is written as that version has it, unsealed)."""
    text = manifest.model_dump_json(exclude_defaults=False)
    if _version(manifest.schema_version) < SEALED_SINCE:
        return text.encode("utf-8")
    return _sealed(text, json.loads(text))


def seal(doc: dict[str, Any]) -> bytes:
    """Return the manifest document `doc` as JSON bytes ending in its ``manifest_checksum``.

    The checksum is the xxh3-128 of the canonical form of every other member (sorted keys,
    compact, UTF-8: `strictjson.canonical`), so the file stays ordinary readable JSON, and a
    change to any value, or a member added or dropped, no longer matches it.
    """
    body = {k: v for k, v in doc.items() if k != "manifest_checksum"}
    return _sealed(json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False), body)


def _sealed(text: str, body: dict[str, Any]) -> bytes:
    return (text[:-1] + f',"manifest_checksum":"{content_checksum(body)}"}}').encode("utf-8")


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a ``MAJOR.MINOR`` schema version; ValueError if it is not one."""
    major, minor = (int(p) for p in text.split("."))
    return major, minor


def content_checksum(body: dict[str, Any]) -> str:
    """The checksum of a manifest document without its own checksum member."""
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(strictjson.canonical(body))


def parse_manifest(data: bytes | str, *, source: str = "manifest.json") -> Manifest:
    """Parse and validate manifest bytes, refusing formats and versions this reader cannot read.

    Raises:
        ManifestError: larger than MANIFEST_LIMIT, malformed or duplicate-keyed JSON, another
            format, a newer major schema version, a content checksum that does not match (a
            1.2 manifest without one included), or a document that does not match the schema
            (every field error is listed).
    """
    if len(data) > MANIFEST_LIMIT:
        raise ManifestError(f"{source}: {len(data)} bytes, over the {MANIFEST_LIMIT}-byte limit of a manifest")
    try:
        raw = strictjson.loads(data)
    except strictjson.StrictJsonError as exc:
        raise ManifestError(f"{source}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    version = check_version(raw, source=source)
    check_seal(raw, version, source=source)
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise ManifestError(f"{source}: does not match manifest schema {SCHEMA_VERSION}: {_errors(exc)}") from None
    return manifest if manifest.manifest_checksum is None else manifest.model_copy(update={"manifest_checksum": None})


def check_seal(raw: dict[str, Any], version: tuple[int, int], *, source: str) -> None:
    """Refuse a manifest whose content does not match its ``manifest_checksum`` (required
    since 1.2; checked whenever present)."""
    claimed = raw.get("manifest_checksum")
    if claimed is None:
        if version >= SEALED_SINCE:
            raise ManifestError(f"{source}: no manifest_checksum (required since schema 1.2); the manifest was edited or damaged")
        return
    body = {k: v for k, v in raw.items() if k != "manifest_checksum"}
    if not isinstance(claimed, str) or content_checksum(body) != claimed:
        raise ManifestError(f"{source}: content does not match its manifest_checksum (the manifest was edited or damaged)")


def check_version(raw: dict[str, Any], *, source: str) -> tuple[int, int]:
    """Refuse a document that is not a ckptkit manifest, or one newer than this reader; return
    its (major, minor) version."""
    fmt = raw.get("format")
    if fmt != FORMAT:
        raise ManifestError(f"{source}: format is {fmt!r}, expected {FORMAT!r}")
    version = raw.get("schema_version")
    try:
        major, minor = _version(str(version))
    except ValueError:
        raise ManifestError(f"{source}: schema_version {version!r} is not MAJOR.MINOR") from None
    if major > SCHEMA_MAJOR:
        raise ManifestError(
            f"{source}: schema version {version} is newer than this ckptkit reads "
            f"({SCHEMA_VERSION}); upgrade ckptkit to a release that reads schema {major}.x"
        )
    if major < SCHEMA_MAJOR:
        raise ManifestError(f"{source}: schema version {version} is not supported by this ckptkit")
    return major, minor


def _errors(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:20]:
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {err['msg']}")
    more = len(exc.errors()) - 20
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def manifest_json_schema() -> dict[str, Any]:
    """Return the JSON Schema of manifest v1, as published under ``schemas/manifest/``."""
    schema = Manifest.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://ckptkit.dev/schemas/manifest/v{SCHEMA_MAJOR}.schema.json"
    return schema
