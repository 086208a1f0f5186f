"""The run a root belongs to: ``run.json``, written at the root's first save.

A run root holds the checkpoints of one run and a record of that run: an id, the model and the
topology of the command that started it, when it started, and the checkpoint it started from
(when it was resumed from another root). A new run into a root that holds another run's
checkpoints is refused (by the trainer) before anything is written; the record names that run.
"""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import IntegrityError, StorageError
from ..manifest import Topology
from ..storage import Storage
from .catalog import RUN_NAME

RUN_FORMAT = "ckptkit-run"
RUN_SCHEMA_VERSION = "1.0"
RUN_LIMIT = 1 << 16  # a run record is a few hundred bytes; anything larger is not one


class RunRecord(BaseModel):
    """What ``run.json`` holds (``schemas/run/v1.schema.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["ckptkit-run"] = "ckptkit-run"
    schema_version: str = RUN_SCHEMA_VERSION
    run_id: str = Field(min_length=1)
    created_at: str
    model: str | None = None  # e.g. "llama tiny": the family and size the command named
    topology: Topology | None = None  # the topology of the command that started the run
    parent: str | None = None  # the checkpoint the run was resumed from, when not its own

    @classmethod
    def start(cls, *, model: str | None, topology: Topology | None, parent: str | None = None) -> RunRecord:
        """Return the record of a run starting now, with a new id."""
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(run_id=uuid.uuid4().hex[:12], created_at=now, model=model, topology=topology, parent=parent)

    def describe(self) -> str:
        """One short phrase naming the run: id, model, topology."""
        parts = [f"run {self.run_id}"]
        if self.model:
            parts.append(self.model)
        if self.topology is not None:
            parts.append(self.topology.describe())
        return ", ".join(parts)


def read_run(root: Storage) -> RunRecord | None:
    """Return the run record of a root (None when it has none).

    Raises:
        IntegrityError: ``run.json`` is there but is not a run record (damaged?).
        StorageError: it cannot be read.
    """
    if not root.exists(RUN_NAME):
        return None
    where = f"{root.root}/{RUN_NAME}" if root.root else RUN_NAME
    size = root.size(RUN_NAME)
    if size > RUN_LIMIT:
        raise IntegrityError(f"{where}: {size} bytes, too large for a run record (damaged?)")
    try:
        return RunRecord.model_validate(json.loads(root.read(RUN_NAME, 0, size)))
    except (ValueError, ValidationError) as exc:
        raise IntegrityError(f"{where}: not a run record ({str(exc).splitlines()[0]}); remove it if it is not yours") from None


def record_run(root: Storage, record: RunRecord) -> bool:
    """Write `record` as the root's run record unless the root already records that run;
    return whether it was written. A record left by a run whose checkpoints are all gone is
    replaced (the caller decided that this run owns the root)."""
    try:
        current = read_run(root)
    except (IntegrityError, StorageError):
        current = None
    if current is not None and current.run_id == record.run_id:
        return False
    root.write(RUN_NAME, [(record.model_dump_json(indent=2) + "\n").encode()])
    return True
