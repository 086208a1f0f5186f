"""What a directory is, from the names it holds (pure): a ckptkit checkpoint, a root of them, an
export, another tool's checkpoint, the leftovers of an interrupted save. ``ckptkit ls`` sorts a
root's entries by it; a command given another tool's checkpoint says what it is and how to bring it in.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Literal

from ..errors import CheckpointNotFoundError, ForeignCheckpointError
from ..manifest import MANIFEST_NAME
from .catalog import LATEST_NAME, RUN_NAME
from .commit import CLAIM_NAME, REPORT_NAME

Kind = Literal["checkpoint", "damaged", "run-root", "hf-export", "dcp-export", "zarr-export", "megatron-export", "deepspeed-export",
               "peft-export", "hf", "hf-trainer", "peft", "dcp", "deepspeed", "megatron", "leftover", "unknown"]
# Payload files ckptkit writes (rank00000.safetensors, rank00000-1.safetensors) and the
# per-writer prefix of an object store's in-place save: their presence without a manifest
# means a save (or a deletion) was interrupted.
_PAYLOAD = re.compile(r"^(rank\d{5}(-\d+)?\.safetensors|[0-9a-f]{12}/|tokenizer/)$")
# The files of torch DCP's HuggingFaceStorageWriter (a folder without config.json: not a model directory).
_DCP_SAFETENSORS = re.compile(r"(shard-\d{5}-)?model-\d{5}-of-\d{5}\.safetensors")
DESCRIPTIONS: dict[str, str] = {
    "checkpoint": "a committed ckptkit checkpoint",
    "damaged": "a checkpoint whose manifest.json cannot be read (ckptkit verify it)",
    "run-root": "a root of ckptkit checkpoints (ckptkit ls it)",
    "hf-export": "a Hugging Face model directory written by ckptkit export",
    "dcp-export": "a torch DCP checkpoint written by ckptkit export",
    "zarr-export": "the zarr form written by ckptkit export",
    "megatron-export": "a Megatron-Core checkpoint written by ckptkit export",
    "deepspeed-export": "a DeepSpeed universal checkpoint written by ckptkit export (a DeepSpeed engine loads it)",
    "peft-export": "a peft adapter folder written by ckptkit export",
    "hf": "a Hugging Face model directory",
    "hf-trainer": "a Hugging Face Trainer checkpoint folder (ckptkit convert reads it)",
    "peft": "a peft adapter folder (ckptkit convert reads it)",
    "dcp": "a torch.distributed.checkpoint (DCP) directory (ckptkit convert reads it)",
    "deepspeed": "a DeepSpeed save (ckptkit convert reads it)",
    "megatron": "a Megatron save (ckptkit convert reads it)",
    "unknown": "not a checkpoint ckptkit knows",
}


def classify(names: Collection[str]) -> Kind:
    """Say what a directory is from the names it holds (directories end with ``/``)."""
    has = set(names).__contains__
    if has(MANIFEST_NAME) or has(MANIFEST_NAME + "/"):  # a manifest that is not a file is a damaged one
        return "zarr-export" if has(REPORT_NAME) and has("zarr.json") else "checkpoint"
    if has(REPORT_NAME):
        if has("latest_universal"):
            return "deepspeed-export"
        if has("adapter_config.json"):
            return "peft-export"
        if has("common.pt") and has("metadata.json"):
            return "megatron-export"
        return "dcp-export" if has(".metadata") else "hf-export"
    if has("adapter_config.json") and has("adapter_model.safetensors"):
        return "peft"
    if has("config.json") and any(n.endswith((".safetensors", ".bin")) or n.endswith(".index.json") for n in names):
        return "hf-trainer" if has("trainer_state.json") else "hf"
    if has("latest_checkpointed_iteration.txt") or has("common.pt") and has("metadata.json"):
        return "megatron"
    if has(".metadata") or any(re.fullmatch(r"__\d+\.metadata", n) for n in names) or any(_DCP_SAFETENSORS.fullmatch(n) for n in names):
        return "dcp"
    if has("latest") and any(n.startswith("global_step") for n in names) or any(n.endswith("model_states.pt") for n in names):
        return "deepspeed"
    if has(LATEST_NAME) or has(RUN_NAME):
        return "run-root"
    if any(_PAYLOAD.match(n) for n in names) or has(CLAIM_NAME):
        return "leftover"
    return "unknown"


FOREIGN: frozenset[str] = frozenset({"hf", "hf-trainer", "peft", "dcp", "deepspeed", "megatron", "hf-export", "dcp-export", "megatron-export",
                                     "peft-export"})  # convert reads them


def what(kind: str) -> str:
    """What a directory of `kind` is, in words (``a DeepSpeed save``)."""
    return DESCRIPTIONS.get(kind, kind).removesuffix(" (ckptkit convert reads it)")


def foreign_problem(path: str, names: Collection[str]) -> CheckpointNotFoundError | None:
    """The error a command answers with when `path`, which holds `names`, is another tool's
    checkpoint (or an export) rather than a ckptkit checkpoint, in one line naming the command
    that brings it in (a `ForeignCheckpointError` when ``convert`` reads it); None when it is not one."""
    kind = classify(names)
    if kind in FOREIGN:
        return ForeignCheckpointError(f"{path}: {what(kind)}, not a ckptkit checkpoint; bring it in with `ckptkit convert {path} DST`",
                                      kind=kind, path=path)
    if kind in ("zarr-export", "deepspeed-export"):
        return CheckpointNotFoundError(f"{path}: {DESCRIPTIONS[kind]}, not a checkpoint")
    return None


__all__ = ["DESCRIPTIONS", "FOREIGN", "Kind", "classify", "foreign_problem", "what"]
