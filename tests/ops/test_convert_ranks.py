"""`convert` under torchrun: the processes split the payload files, rank 0 commits, and the
checkpoint is the one a single process writes, file for file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptkit

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
pytestmark = pytest.mark.multiprocess
UNIQUE = ("checkpoint_id", "created_at", "manifest_checksum")  # each conversion's own


def _convert(src: Path, dst: Path, ranks: int, *options: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "ckptkit.cli", "convert", str(src), str(dst), "--json", *options]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


def _contents(out: Path) -> dict[str, object]:
    """Every file of a checkpoint by path (its manifest without what differs between two conversions)."""
    files: dict[str, object] = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
                                if p.is_file() and p.name != "manifest.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    return files | {"manifest.json": {k: v for k, v in manifest.items() if k not in UNIQUE}}


@pytest.mark.parametrize(("fixture", "ranks"), [("dcp-fsdp2-fp32", 2), ("deepspeed/zero3-bf16-dp3", 4)])
def test_processes_write_what_one_process_does(fixture: str, ranks: int, tmp_path: Path) -> None:
    ckptkit.convert(FIXTURES / fixture, tmp_path / "one", max_file_bytes=1000)
    one = _contents(tmp_path / "one")
    payloads = [p for p in one if p.endswith(".safetensors")]  # each with its block digests beside it
    assert len(payloads) >= ranks  # every process writes some
    done = _convert(FIXTURES / fixture, tmp_path / "many", ranks, "--max-file-size", "1000")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)  # rank 0 prints the report, once
    listed = json.loads((tmp_path / "one" / "manifest.json").read_text())["files"]
    assert report["files"] == len(listed) and report["destination"] == str(tmp_path / "many")
    assert _contents(tmp_path / "many") == one
    assert ckptkit.verify(tmp_path / "many").ok
    manifest = json.loads((tmp_path / "many" / "manifest.json").read_text())
    assert manifest["step"] == json.loads((tmp_path / "one" / "manifest.json").read_text())["step"] > 0


def test_a_refusal_is_said_once_and_nothing_is_written(tmp_path: Path) -> None:
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "kept.txt").write_text("mine")
    done = _convert(FIXTURES / "dcp-fsdp2-fp32", tmp_path / "dst", 2, "--max-file-size", "1000")
    assert done.returncode == 1
    error = json.loads(done.stdout)
    assert error["ok"] is False and error["error"] == "CheckpointExistsError"  # one object: rank 0 says it, once
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["kept.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no staging left behind


# Loaded by every process of the job (PYTHONPATH), it fills the disk for rank 1 alone: its writes
# of payload files fail with ENOSPC, as they would on a full disk, in the middle of the conversion.
FULL_DISK = '''
import errno, os
if os.environ.get("RANK") == "1":
    _write = os.write
    def _full(fd, data):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if ".safetensors" in path:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return _write(fd, data)
    os.write = _full
'''


def test_a_rank_failing_mid_write_fails_the_job_once_and_nothing_is_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(FULL_DISK)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    out.mkdir()
    done = _convert(FIXTURES / "dcp-fsdp2-fp32", out / "dst", 2, "--max-file-size", "1000")
    assert done.returncode == 1
    error = json.loads(done.stdout)  # rank 0 says rank 1's error, once
    assert error["error"] == "StorageError" and "No space left on device" in error["message"]
    assert len([line for line in done.stderr.splitlines() if line.startswith("ckptkit: error: ")]) == 1
    assert list(out.iterdir()) == []  # no checkpoint, and no staging left behind
