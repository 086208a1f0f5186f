"""Generate the published JSON Schemas (manifest, layout, run record and CLI reports) from the pydantic models.

Run ``python -m ckptkit.schemas [DIR]`` to rewrite them (default: ./schemas); a test
regenerates them and fails on any difference. Never edit the files by hand.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pydantic import BaseModel

from .exports.run import ExportReport
from .io.run_record import RunRecord
from .ops.convert import ConvertReport
from .ops.diff import DiffReport
from .ops.failure import ErrorReport
from .ops.inspect import InspectReport
from .layouts import layout_json_schema
from .manifest import SCHEMA_MAJOR, manifest_json_schema
from .ops.listing import ListingReport
from .ops.reshard import ReshardReport
from .ops.verify import VerifyReport
from .ops.compact import CompactReport
from .writer.clean import CleanReport
from .writer.prune import PruneReport
from .writer.tier import FlushReport


# Each command's --json report and the major version of its schema (`schemas/cli/<name>.v<N>.schema.json`).
# A version goes up when a field is renamed or changes type; the older schemas stay in `schemas/cli/`, as
# published, and docs/cli.md lists what changed.
CLI_REPORTS: dict[str, tuple[int, type[BaseModel]]] = {
    "verify": (2, VerifyReport), "inspect": (2, InspectReport), "ls": (2, ListingReport), "reshard": (2, ReshardReport),
    "export": (2, ExportReport), "convert": (2, ConvertReport), "clean": (2, CleanReport), "prune": (2, PruneReport),
    "diff": (2, DiffReport), "error": (1, ErrorReport), "compact": (1, CompactReport),
    "flush": (1, FlushReport),
}


def cli_schema_path(name: str) -> str:
    """The current schema of command `name`'s --json report, relative to `schemas/`."""
    return f"cli/{name}.v{CLI_REPORTS[name][0]}.schema.json"


def all_schemas() -> dict[str, dict[str, Any]]:
    """Return relative file path -> JSON Schema for every published document."""
    out = {f"manifest/v{SCHEMA_MAJOR}.schema.json": manifest_json_schema(), "layout/v1.schema.json": layout_json_schema()}
    run = RunRecord.model_json_schema()
    run["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["run/v1.schema.json"] = run
    for name, (_, model) in CLI_REPORTS.items():
        schema = model.model_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[cli_schema_path(name)] = schema
    return out


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def write_schemas(directory: str) -> list[str]:
    """Write every schema under `directory`; return the paths written."""
    written = []
    for rel, schema in all_schemas().items():
        path = os.path.join(directory, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(schema))
        written.append(path)
    return written


if __name__ == "__main__":
    for p in write_schemas(sys.argv[1] if len(sys.argv) > 1 else "schemas"):
        print(p)
