"""The committed fixtures: the golden v1 checkpoint reads back exactly, every corrupt case is caught.

Each corrupt case (fixtures/corrupt/<case>/, a checkpoint root; see fixtures/README.md) must
give one finding from ``verify``, a ckptkit error from ``load`` and exit 1 from ``ckptkit verify``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit import (
    CheckpointNotFoundError,
    CkptkitError,
    IntegrityError,
    ManifestError,
    ShardedTensor,
    StorageError,
)
from ckptkit.cli import cli
from ckptkit.ops.verify import verify

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN_V1 = FIXTURES / "v1"
CORRUPT = FIXTURES / "corrupt"
NAME = "step_00000005"

# case -> (the one finding verify reports: code and where, the error load raises, a phrase of its message)
CASES: dict[str, tuple[str, str, type[Exception], str]] = {
    "truncated_payload": ("size", "rank00000-000.safetensors", IntegrityError, "truncated"),
    "flipped_byte": ("checksum", "rank00000-001.safetensors", IntegrityError, "checksum"),
    "missing_file": ("missing", "rank00000-003.safetensors", IntegrityError, "listed in the manifest but missing"),
    "overlapping_shards": ("tiling", "model/mlp.weight", ManifestError, "overlap"),
    "gap": ("tiling", "model/mlp.weight", ManifestError, "gap: 4 of 28 elements"),
    "path_traversal": ("path", "../outside.safetensors", ManifestError, "escapes the checkpoint"),
    "symlink_escape": ("path", "rank00000-000.safetensors", StorageError, "resolves outside"),
    "symlink_to_sibling": ("path", "rank00000-000.safetensors", CkptkitError, "outside"),
    "newer_schema": ("manifest", "manifest.json", ManifestError, "upgrade ckptkit"),
    "malformed_json": ("manifest", "manifest.json", ManifestError, "not valid JSON"),
    "oversized_header": ("header", "rank00000-000.safetensors", IntegrityError, "exceeds the 100000000-byte limit"),
}


def _leaf(state: dict[str, Any], fqn: str) -> Any:
    for key in fqn.split("/"):
        state = state[key]
    return state


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# --- the corrupt corpus ------------------------------------------------------------------------


def test_corpus_holds_exactly_the_listed_cases() -> None:
    assert sorted(os.listdir(CORRUPT)) == sorted([*CASES, "missing_manifest"])


@pytest.mark.parametrize("case", list(CASES))
def test_verify_reports_the_defect_as_its_one_finding(case: str) -> None:
    code, where, _, _ = CASES[case]
    report = verify(CORRUPT / case)
    assert not report.ok
    assert [(f.code, f.where) for f in report.findings] == [(code, where)]


@pytest.mark.parametrize("case", list(CASES))
def test_load_raises_a_ckptkit_error_naming_the_defect(case: str) -> None:
    _, _, error, phrase = CASES[case]
    with pytest.raises(error, match=re.escape(phrase)):
        ckptkit.load(CORRUPT / case)


@pytest.mark.parametrize("case", list(CASES))
def test_cli_verify_exits_1_and_prints_the_finding(case: str) -> None:
    code, where, _, _ = CASES[case]
    result = CliRunner().invoke(cli, ["verify", str(CORRUPT / case)])
    assert result.exit_code == 1
    assert isinstance(result.exception, SystemExit)  # not an escaped error that also reads as 1
    assert f"[{code}] {where}: " in result.stdout
    assert "1 problem(s)" in result.stdout
    assert "Traceback" not in result.output


@pytest.mark.parametrize("case", ["truncated_payload", "symlink_escape"])
def test_verify_entry_point_prints_finding_without_traceback(case: str, run_ckptkit: Any) -> None:
    proc = run_ckptkit("verify", str(CORRUPT / case))
    assert proc.returncode == 1
    assert f"[{CASES[case][0]}] " in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_verify_of_root_whose_latest_has_no_manifest_raises_not_found() -> None:
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        verify(CORRUPT / "missing_manifest")


def test_load_of_root_whose_latest_has_no_manifest_raises_not_found() -> None:
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint"):
        ckptkit.load(CORRUPT / "missing_manifest")


def test_cli_verify_of_checkpoint_without_manifest_exits_2_with_one_line_error(run_ckptkit: Any) -> None:
    proc = run_ckptkit("verify", str(CORRUPT / "missing_manifest" / NAME))
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptkit: error: ")
    assert "no manifest.json, so not a committed checkpoint" in lines[0]


# --- the golden checkpoint of schema v1 --------------------------------------------------------


def test_golden_v1_verifies_clean() -> None:
    report = verify(GOLDEN_V1)
    assert (report.ok, report.findings, report.files, report.tensors) == (True, [], 5, 7)
    assert report.bytes_read == sum(
        p.stat().st_size for p in (GOLDEN_V1 / NAME).rglob("*") if p.name != "manifest.json" and p.is_file()
    )


def test_golden_v1_manifest_is_schema_1_0_with_both_shard_layouts() -> None:
    manifest = ckptkit.read_manifest(str(GOLDEN_V1))
    assert (manifest.format, manifest.schema_version, manifest.step) == ("ckptkit", "1.0", 5)
    assert {t.shards.layout for t in manifest.tensors.values()} == {"boxes", "grid"}


def test_golden_v1_loads_the_expected_tensor_bytes(make_fixtures: Any) -> None:
    loaded = ckptkit.load(GOLDEN_V1)
    for fqn, want in make_fixtures.expected_tensors().items():
        got = _leaf(loaded, fqn)
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), fqn
        assert _bytes(got) == _bytes(want), fqn


def test_golden_v1_loads_its_json_objects(make_fixtures: Any) -> None:
    loaded = ckptkit.load(GOLDEN_V1)
    assert loaded["trainer"] == make_fixtures.OBJECTS["trainer"]


def test_golden_v1_loads_into_other_shardings(make_fixtures: Any) -> None:
    want = make_fixtures.expected_tensors()
    mlp = torch.zeros(4, 6)  # saved as column halves: load row halves
    head = torch.zeros(8, 5)  # saved as a grid of row halves: load column pieces
    target = {
        "model": {"mlp.weight": [ShardedTensor(mlp[:2], (4, 6), (0, 0)), ShardedTensor(mlp[2:], (4, 6), (2, 0))]},
        "optimizer": {
            "exp_avg": {
                "lm_head.weight": [
                    ShardedTensor(head[:, :2], (8, 5), (0, 0)),
                    ShardedTensor(head[:, 2:], (8, 5), (0, 2)),
                ]
            }
        },
    }
    ckptkit.load(GOLDEN_V1, target)
    assert _bytes(mlp) == _bytes(want["model/mlp.weight"])
    assert _bytes(head) == _bytes(want["optimizer/exp_avg/lm_head.weight"])


def test_golden_v1_records_every_info_section_and_the_tokenizer(make_fixtures: Any) -> None:
    manifest = ckptkit.read_manifest(str(GOLDEN_V1))
    assert manifest.info == make_fixtures.golden_info()
    assert manifest.tokenizer is not None
    assert manifest.tokenizer.files == ("tokenizer/tokenizer.json",)


def test_golden_v1_payloads_hold_manifest_boxes_for_the_reference_safetensors_reader(make_fixtures: Any) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from ckptkit.manifest.shards import iter_shards

    manifest = ckptkit.read_manifest(str(GOLDEN_V1))
    payloads = [
        safetensors_torch.load_file(GOLDEN_V1 / NAME / f.path) if f.role == "tensors" else {} for f in manifest.files
    ]
    want = make_fixtures.expected_tensors()
    for fqn, entry in manifest.tensors.items():
        for shard in iter_shards(entry):
            expected = want[fqn][shard.box.slices()] if shard.box.ndim else want[fqn]
            assert _bytes(payloads[shard.file][shard.key]) == _bytes(expected), (fqn, shard)


def test_every_fixture_file_is_under_1_mb_and_all_under_6() -> None:
    """Fixtures stay small: each file under 1 MiB, all of them (the other tools' real saves
    included, torchtitan's mid-run save the largest at 0.7 MB) a few MB: 5.0 MB today."""
    sizes = {p: p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file() and not p.is_symlink()}
    assert max(sizes.values()) < 1 << 20
    assert sum(sizes.values()) < 6 << 20


def test_make_fixtures_reproduces_the_committed_bytes(make_fixtures: Any, tmp_path: Path, capsys: Any) -> None:
    assert make_fixtures.main(["--out", str(tmp_path)]) == 0
    for sub in make_fixtures.SUBDIRS:
        assert _snapshot(tmp_path / sub) == _snapshot(FIXTURES / sub), sub


def _snapshot(root: Path) -> dict[str, Any]:
    """Return relative path -> file bytes, symlink target or "dir" for everything under `root`."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                out[rel] = ("symlink", os.readlink(path))
            elif path.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = path.read_bytes()
    return out


def test_checkpoint_with_a_zero_size_tensor_verifies_clean(tmp_path: Path) -> None:
    ckptkit.save({"model": {"empty": torch.zeros(0, 4), "w": torch.ones(2)}}, tmp_path / NAME, step=5)
    assert verify(tmp_path / NAME).findings == []
