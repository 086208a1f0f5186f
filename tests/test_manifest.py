from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptkit.errors import ManifestError
from ckptkit.manifest import (
    BoxShard,
    BoxShards,
    FileEntry,
    Manifest,
    Producer,
    TensorEntry,
    Topology,
    manifest_to_json,
    parse_manifest,
    seal,
)
from ckptkit.schemas import all_schemas, render

REPO = Path(__file__).resolve().parents[1]


def _manifest() -> Manifest:
    return Manifest(
        checkpoint_id="abc",
        step=3,
        created_at="2026-01-01T00:00:00+00:00",
        producer=Producer(ckptkit="0.1.0"),
        topology=Topology(world_size=1),
        files=(FileEntry(path="rank00000.safetensors", size=10, checksum="xxh3-128:00"),),
        tensors={
            "model/w": TensorEntry(
                shape=(2, 3),
                dtype="float32",
                kind="param",
                shards=BoxShards(boxes=(BoxShard(offsets=(0, 0), lengths=(2, 3), file=0, key="model/w"),)),
            )
        },
        objects={"sched": {"lr": 0.5}},
    )


def test_manifest_round_trips_through_json() -> None:
    m = _manifest()
    assert parse_manifest(manifest_to_json(m)) == m


def test_published_schemas_match_the_models() -> None:
    for rel, schema in all_schemas().items():
        path = REPO / "schemas" / rel
        assert path.exists(), f"{rel} missing: run `make schemas`"
        assert path.read_text() == render(schema), f"{rel} is stale: run `make schemas`"


def test_every_older_cli_report_schema_stays_published_and_documented() -> None:
    """A report whose fields were renamed has a new major version; its older schemas stay as
    published (valid JSON Schemas, no longer generated) and the reference page says what changed."""
    import jsonschema

    from ckptkit.schemas import CLI_REPORTS

    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    for name, (version, _) in CLI_REPORTS.items():
        for old in range(1, version):
            doc = json.loads((REPO / "schemas" / "cli" / f"{name}.v{old}.schema.json").read_text(encoding="utf-8"))
            jsonschema.Draft202012Validator.check_schema(doc)
            assert f"`{name}.v{old}`" in page, name


def test_newer_major_version_is_refused_with_upgrade_hint() -> None:
    raw = json.loads(manifest_to_json(_manifest()))
    raw["schema_version"] = "2.0"
    with pytest.raises(ManifestError, match="newer than this ckptkit reads.*upgrade ckptkit"):
        parse_manifest(json.dumps(raw))


def test_unknown_field_is_an_error_not_dropped() -> None:
    raw = json.loads(manifest_to_json(_manifest()))
    raw["tensors"]["model/w"]["sparsity"] = 0.5
    with pytest.raises(ManifestError, match="tensors.model/w.sparsity"):
        parse_manifest(seal(raw))


def test_other_format_is_refused() -> None:
    with pytest.raises(ManifestError, match="format is 'dcp'"):
        parse_manifest(json.dumps({"format": "dcp", "schema_version": "1.0"}))


def test_malformed_json_is_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(manifest_to_json(_manifest())[:50])


def test_manifest_schema_validates_a_real_manifest() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((REPO / "schemas/manifest/v1.schema.json").read_text())
    jsonschema.validate(json.loads(manifest_to_json(_manifest())), schema)


def test_verify_inspect_and_layouts_run_without_torch(tmp_path: Path) -> None:
    import torch

    import ckptkit

    ckptkit.save({"model": {"w": torch.arange(6.0)}}, tmp_path / "ck", step=1)
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.') or name == 'boto3':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import ckptkit, ckptkit.manifest, ckptkit.boxes, ckptkit.plan.load, ckptkit.manifest.shards\n"
        "import ckptkit.ops.verify, ckptkit.ops.inspect, ckptkit.manifest.consistency, ckptkit.io.catalog, ckptkit.cli, ckptkit.layouts\n"
        "from ckptkit.cli import cli\n"
        "assert ckptkit.verify(sys.argv[1]).ok\n"
        "assert ckptkit.inspect(sys.argv[1]).tensors == 1\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(("blocks", "checksum", "found"), [
    ({"size": 16}, "xxh3-128-blocks:00", []),  # 1.5: the digests in the sidecar, covered by the file checksum
    ({"size": 16}, "xxh3-128:00", [("checksum", "block checksums in a sidecar need a file checksum derived from them (xxh3-128-blocks:)")]),
    ({"size": 16, "digests": "AAAAAAAAAAA="}, "xxh3-128-blocks:00", [("schema", "block checksums do not describe 3 blocks of 16 bytes (base64 of 8 bytes each)")]),
], ids=["sidecar", "sidecar-whole-checksum", "inline-short"])
def test_block_checksums_are_checked_against_the_file_entry(blocks: dict, checksum: str, found: list) -> None:
    from ckptkit.manifest import BlockChecksums
    from ckptkit.manifest.consistency import manifest_findings

    m = _manifest()
    entry = m.files[0].model_copy(update={"size": 40, "checksum": checksum, "blocks": BlockChecksums(**blocks)})
    assert [(f.code, f.message) for f in manifest_findings(m.model_copy(update={"files": (entry,)}))] == found
    assert parse_manifest(manifest_to_json(m.model_copy(update={"files": (entry,)}))).files == (entry,)
