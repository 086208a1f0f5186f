"""Hostile and damaged checkpoints: every reader refuses them with a one-line error, promptly, in
bounded memory, and never returns altered data.

Each case here failed before the reliability work: FIFOs hung verify and inspect, a character
device exhausted memory, malformed headers ended as internal errors, a flipped manifest value
was accepted, a grid of 10^9 cells built a billion cut positions, and two shards naming one
payload key were loaded twice.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit import CheckpointNotFoundError, IntegrityError, ManifestError, ShardedTensor, StorageError
from ckptkit.io.catalog import read_latest
from ckptkit.io.safetensors import parse_header
from ckptkit.manifest import seal
from ckptkit.storage import open_storage

from .conftest import _ckptkit_command

NAME = "step_00000001"
Run = Callable[..., subprocess.CompletedProcess[str]]


def _state() -> dict[str, Any]:
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    return {
        "model": {"w": [ShardedTensor(w[2 * i : 2 * i + 2].clone(), (8, 6), (2 * i, 0)) for i in range(4)], "b": torch.ones(3)},
        "scheduler": {"lr": 0.5, "step": 7},
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root holding one committed checkpoint: a grid tensor over four files, a box tensor, JSON values, a tokenizer."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"model": "toy"}')
    ckptkit.save(_state(), tmp_path / "ck" / NAME, step=1, max_file_bytes=64, tokenizer=str(tok))
    return tmp_path / "ck"


def _manifest(root: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((root / NAME / "manifest.json").read_bytes())
    return doc


def _reseal(root: Path, doc: dict[str, Any]) -> None:
    """Write an edited manifest with a valid seal: what a buggy writer could commit."""
    (root / NAME / "manifest.json").write_bytes(seal(doc))


def _replace(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
    elif kind == "directory":
        path.mkdir()
    else:
        os.symlink(path.with_name("rank00000-001.safetensors"), path)


def _measured(args: list[str]) -> tuple[int, str, int]:
    """Run the real command; return its exit code, its output (stdout and stderr) and peak resident memory in KiB. A hang
    would fail the test through the timeout."""
    env = {k: v for k, v in os.environ.items() if k != "CKPTKIT_DEBUG"}
    with subprocess.Popen([*_ckptkit_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as p:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            pytest.fail(f"ckptkit {' '.join(args)} hung")
        _, _, usage = os.wait4(p.pid, 0) if p.returncode is None else (0, 0, None)
    return p.returncode, out + err, usage.ru_maxrss if usage else 0


def _one_line_error(code: int, err: str) -> None:
    assert code in (1, 2), err
    assert "Traceback" not in err and "internal error" not in err, err


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "symlink"])
@pytest.mark.parametrize("victim", ["rank00000-000.safetensors", "manifest.json", "tokenizer/tokenizer.json"])
def test_special_files_are_refused_by_every_command(root: Path, tmp_path: Path, kind: str, victim: str) -> None:
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    _replace(root / NAME / victim, kind)
    ck = str(root / NAME)
    commands = [["verify", ck], ["verify", "--quick", ck], ["inspect", ck], ["ls", str(root)], ["diff", ck, ck],
                ["export", ck, str(tmp_path / "out"), "--format", "zarr"]]
    for args in commands:
        code, err, _ = _measured(args)
        if args[0] == "ls":  # a listing: the checkpoint with a damaged manifest is named (not committed, not a leftover)
            assert code == 0, err
            if victim == "manifest.json":
                assert f"{NAME}\tdamaged: unreadable manifest.json:" in err and "not a regular file" in err, err
            continue
        if args[0] == "inspect" and victim != "manifest.json" or args[0] == "diff" and victim.startswith("tokenizer"):
            assert code == 0, err  # inspect reads the manifest only, diff the tensors
            continue
        _one_line_error(code, err)
        assert victim.split("/")[-1] in err, err
        assert not (tmp_path / "out").exists()
    if victim.startswith("rank"):  # load reads the payloads (not the tokenizer)
        with pytest.raises((IntegrityError, StorageError)):
            ckptkit.load(ck)


def test_a_device_in_place_of_the_manifest_costs_no_memory(root: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    _, _, baseline = _measured(["inspect", str(root / NAME)])
    _replace(root / NAME / "manifest.json", "device")
    for args in (["verify", str(root / NAME)], ["inspect", str(root / NAME)]):
        code, err, peak = _measured(args)
        _one_line_error(code, err)
        assert "character device" in err
        assert peak - baseline < 100 * 1024, f"{args[0]} used {peak - baseline} KiB more than reading a sound manifest"


def test_a_flipped_manifest_value_is_caught_by_every_reader(root: Path, run_ckptkit: Run, tmp_path: Path) -> None:
    path = root / NAME / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"step":7', b'"step":6'))
    for args in (["verify", str(root)], ["verify", "--quick", str(root)], ["inspect", str(root)],
                 ["reshard", str(root), str(tmp_path / "r"), "--tp", "1"], ["export", str(root), str(tmp_path / "e"), "--format", "zarr"]):
        result = run_ckptkit(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert "manifest_checksum" in result.stdout + result.stderr
    assert not (tmp_path / "r").exists() and not (tmp_path / "e").exists()
    with pytest.raises(ManifestError, match="manifest_checksum"):
        ckptkit.load(root)
    with pytest.raises(ManifestError, match="manifest_checksum"):
        ckptkit.load(root, {"model": {"b": torch.empty(3)}})


def test_a_manifest_without_its_checksum_is_refused(root: Path) -> None:
    doc = _manifest(root)
    del doc["manifest_checksum"]
    (root / NAME / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="no manifest_checksum"):
        ckptkit.read_manifest(root)
    assert not ckptkit.verify(root).ok


def test_a_huge_grid_count_is_a_finding_not_a_memory_bomb(root: Path) -> None:
    doc = _manifest(root)
    doc["tensors"]["model/w"]["shards"]["cuts"] = [10**9, 1]
    _reseal(root, doc)
    report = ckptkit.verify(root)
    assert [(f.code, f.where) for f in report.findings] == [("tiling", "model/w")]
    assert "from 1 to the size 8" in report.findings[0].message
    for call in (lambda: ckptkit.load(root), lambda: ckptkit.inspect(root)):
        with pytest.raises(ManifestError, match="chunk count 1000000000"):
            call()


@pytest.mark.parametrize("edit", ["shape", "size"])
def test_a_size_beyond_any_tensor_or_file_is_a_finding(root: Path, run_ckptkit: Run, edit: str) -> None:
    """A re-signed manifest with a dimension or a file size of 2^63 and more: a finding for every
    reader, never an overflow in the checks (found by the fuzz test)."""
    doc = _manifest(root)
    if edit == "shape":
        doc["tensors"]["model/w"]["shape"] = [8, 2**63]
        where = "model/w"
    else:
        doc["files"][1]["size"] = 2**64
        where = doc["files"][1]["path"]
    _reseal(root, doc)
    report = ckptkit.verify(root)
    assert any(f.code == "schema" and f.where == where and "limit 2^62 bytes" in f.message for f in report.findings), report.findings
    with pytest.raises(ManifestError, match="limit 2\\^62 bytes"):
        ckptkit.load(root)
    for command in ("inspect", "diff"):
        args = [str(root)] * (2 if command == "diff" else 1)
        result = run_ckptkit(command, *args)
        assert result.returncode == 1 and "limit 2^62 bytes" in result.stderr, result.stderr


def test_two_shards_naming_one_key_are_a_finding_for_every_reader(root: Path, run_ckptkit: Run) -> None:
    doc = _manifest(root)
    doc["tensors"]["model/w"]["shards"] = {"layout": "boxes", "boxes": [
        {"offsets": [0, 0], "lengths": [4, 6], "file": 0, "key": "model/w"},
        {"offsets": [4, 0], "lengths": [4, 6], "file": 0, "key": "model/w"},
    ]}
    _reseal(root, doc)
    report = ckptkit.verify(root)
    assert any(f.code == "mapping" and "two shards read key 'model/w'" in f.message for f in report.findings)
    with pytest.raises(ManifestError, match="two shards read key"):
        ckptkit.load(root)
    assert run_ckptkit("inspect", str(root)).returncode == 1


@pytest.mark.parametrize("alone", [False, True], ids=["sharing-a-file", "alone-in-its-file"])
def test_a_tensor_emptied_by_the_manifest_is_found_in_its_file_by_every_reader(
    root: Path, tmp_path: Path, run_ckptkit: Run, alone: bool
) -> None:
    """The manifest says a saved tensor is empty: no read needs its bytes, yet its file still holds
    them under its key. Whole loads, export and verify read that file's header and refuse it, also
    when no other tensor's read opens the file."""
    if alone:
        root = tmp_path / "alone"
        ckptkit.save({"model": {"a": torch.ones(16), "b": torch.ones(3)}}, root / NAME, step=1, max_file_bytes=16)
    doc = _manifest(root)
    assert alone == (len({b["file"] for t in doc["tensors"].values() if "boxes" in t["shards"] for b in t["shards"]["boxes"]}) == 2)
    doc["tensors"]["model/b"]["shape"] = [0]
    doc["tensors"]["model/b"]["shards"]["boxes"][0]["lengths"] = [0]
    _reseal(root, doc)
    report = ckptkit.verify(root)
    assert any(f.code == "header" and "'model/b' is not in the manifest" in f.message for f in report.findings), report.findings
    with pytest.raises(IntegrityError, match="'model/b' is not in the manifest"):
        ckptkit.load(root)
    result = run_ckptkit("export", str(root), str(tmp_path / "out"), "--format", "zarr")
    assert result.returncode == 1 and "'model/b' is not in the manifest" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_a_safetensors_file_marked_raw_is_a_finding(root: Path) -> None:
    doc = _manifest(root)
    doc["files"][1]["encoding"] = "raw"
    _reseal(root, doc)
    report = ckptkit.verify(root)
    assert any(f.code == "mapping" and f.where == doc["files"][1]["path"] for f in report.findings), report.findings
    with pytest.raises(ManifestError, match="raw file"):
        ckptkit.load(root)


@pytest.mark.parametrize(
    "header, phrase",
    [
        (b'{"t":{"dtype":"F32","shape":[1e999],"data_offsets":[0,4]}}', "too large for a float"),
        (b'{"t":{"dtype":"F32","shape":[4611686018427387904, 4],"data_offsets":[0,4]}}', "does not fit shape"),
        (b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', "appears twice"),
        (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
        (b'{"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', "malformed"),
        (b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}}', "malformed"),
        (b'{"__metadata__":{"a":[1]}}', "__metadata__"),
    ],
)
def test_malformed_safetensors_headers_are_integrity_errors(header: bytes, phrase: str) -> None:
    with pytest.raises(IntegrityError, match=phrase):
        parse_header(header, where="f.safetensors", file_size=8 + len(header) + 4)


def test_a_malformed_header_on_disk_is_a_finding_for_verify_and_load(root: Path, run_ckptkit: Run) -> None:
    path = root / NAME / "rank00000-002.safetensors"
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + n].decode()
    bad = text.replace('"format":"pt",', "").replace('"shape":[2,6]', '"shape":[1e999,6]', 1).encode()
    assert len(bad) <= n and bad != data[8 : 8 + n]
    data[8 : 8 + n] = bad.ljust(n)
    path.write_bytes(bytes(data))
    for args in (["verify", str(root)], ["verify", "--quick", str(root)], ["diff", str(root), str(root)]):
        result = run_ckptkit(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "rank00000-002.safetensors" in result.stdout + result.stderr
        assert "Traceback" not in result.stderr
    with pytest.raises(IntegrityError):
        ckptkit.load(root)


def test_latest_carries_a_checksum_and_a_damaged_one_is_refused(root: Path, tmp_path: Path) -> None:
    storage = open_storage(str(root))
    lines = (root / "latest").read_text().split("\n")
    assert lines[0] == NAME and lines[1].startswith("xxh3-128:")
    assert read_latest(storage) == NAME
    (root / "latest").write_text(f"{NAME[:-1]}2\n{lines[1]}\n")  # another name, the old checksum
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        ckptkit.load(root)
    (root / "latest").write_text(f"{NAME}\n")  # a pointer from before the checksum still reads
    assert read_latest(storage) == NAME
    for garbage in (b"../outside\n", b"\xff\xfe\n", b"a\nb\nc\n", b"x" * 10_000):
        (root / "latest").write_bytes(garbage)
        with pytest.raises(IntegrityError):
            read_latest(storage)
    _replace(root / "latest", "fifo")
    with pytest.raises(StorageError, match="FIFO"):
        read_latest(storage)


def test_a_checkpoint_removed_while_being_read_is_reported_removed(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    opened = ckptkit.open(root)
    shutil.rmtree(root / NAME)  # what retention does after the reader opened it
    with pytest.raises(CheckpointNotFoundError, match="removed while it was being read"):
        opened.load()


def test_a_symlink_inside_the_checkpoint_is_not_followed(root: Path) -> None:
    _replace(root / NAME / "rank00000-000.safetensors", "symlink")
    report = ckptkit.verify(root)
    assert [f.where for f in report.findings] == ["rank00000-000.safetensors"]
    assert "symlink" in report.findings[0].message


def test_the_sound_checkpoint_still_reads_exactly(root: Path) -> None:
    """The checks refuse nothing a writer produces."""
    assert ckptkit.verify(root).ok
    out = ckptkit.load(root)
    assert torch.equal(out["model"]["w"], torch.arange(48, dtype=torch.float32).reshape(8, 6))
    assert out["scheduler"] == {"lr": 0.5, "step": 7}
    assert ckptkit.inspect(root).shards == 5


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
