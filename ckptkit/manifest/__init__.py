"""The checkpoint manifest: its pydantic models and versions (``model``), the dtypes it names, its
shard specs (``shards``) and its checks against itself (``consistency``). Pure: no torch, no I/O."""

from . import strictjson
from .model import (
    FORMAT,
    KINDS,
    MANIFEST_LIMIT,
    MANIFEST_NAME,
    SCHEMA_MAJOR,
    SCHEMA_MINOR,
    SCHEMA_VERSION,
    BlockChecksums,
    BoxShard,
    BoxShards,
    CheckpointInfo,
    CodeVersion,
    DataProgress,
    DataVersion,
    FileEntry,
    FileRange,
    GridShards,
    Kind,
    Manifest,
    Model,
    ModelInfo,
    OptimizerInfo,
    ParamGroup,
    Producer,
    ShardSpec,
    SourceInfo,
    TensorEntry,
    TokenizerInfo,
    Topology,
    check_seal,
    check_version,
    manifest_json_schema,
    manifest_to_json,
    parse_manifest,
    seal,
)

__all__ = [
    "FORMAT", "KINDS", "MANIFEST_LIMIT", "MANIFEST_NAME", "SCHEMA_MAJOR", "SCHEMA_MINOR", "SCHEMA_VERSION", "BlockChecksums", "BoxShard",
    "BoxShards", "CheckpointInfo", "CodeVersion", "DataProgress", "DataVersion", "FileEntry", "FileRange", "GridShards",
    "Kind", "Manifest", "Model", "ModelInfo", "OptimizerInfo", "ParamGroup", "Producer", "ShardSpec", "SourceInfo", "TensorEntry",
    "TokenizerInfo", "Topology", "check_seal", "check_version", "manifest_json_schema", "manifest_to_json", "parse_manifest",
    "seal",
]
