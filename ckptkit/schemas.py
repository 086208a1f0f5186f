"""Generate the published JSON Schemas (manifest, layout, run record and CLI reports) from the pydantic models.

Run ``python -m ckptkit.schemas [DIR]`` to rewrite them (default: ./schemas); a test
regenerates them and fails on any difference. Never edit the files by hand.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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
from .writer.clean import CleanReport
from .writer.prune import PruneReport


def all_schemas() -> dict[str, dict[str, Any]]:
    """Return relative file path -> JSON Schema for every published document."""
    out = {f"manifest/v{SCHEMA_MAJOR}.schema.json": manifest_json_schema(), "layout/v1.schema.json": layout_json_schema()}
    run = RunRecord.model_json_schema()
    run["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    out["run/v1.schema.json"] = run
    for name, model in (("verify", VerifyReport), ("inspect", InspectReport), ("ls", ListingReport), ("reshard", ReshardReport),
                        ("export", ExportReport), ("convert", ConvertReport), ("clean", CleanReport), ("prune", PruneReport), ("diff", DiffReport),
                        ("error", ErrorReport)):
        schema = model.model_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out[f"cli/{name}.v1.schema.json"] = schema
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
