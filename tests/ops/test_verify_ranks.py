"""`verify` under torchrun: the ranks split the files and report what one process reports."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckptkit
from ckptkit.ops.verify import share

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The reference Llama at tp 2 x dp 2 (several files), sound and with a byte flipped in two of its files; a DCP save."""
    root = tmp_path_factory.mktemp("verify")
    sound = root / "sound" / "step_00000005"
    ckptkit.reshard(FIXTURES / "llama-v1.1", sound, ckptkit.Topology(world_size=4, tp=2, dp=2, zero_stage=1))
    damaged = root / "damaged" / "step_00000005"
    shutil.copytree(sound, damaged)
    payloads = sorted(damaged.glob("*.safetensors"))
    assert len(payloads) >= 4
    for path in (payloads[0], payloads[-1]):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x40
        path.write_bytes(bytes(data))
    return {"sound": sound, "damaged": damaged, "foreign": FIXTURES / "dcp-nodist"}


def _verify(path: Path, ranks: int) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "ckptkit.cli", "verify", "--json", str(path)]
    if ranks > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "ckptkit.cli"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.stdout.count('"source"') == 1, done.stdout + done.stderr[-2000:]  # rank 0 alone prints
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("case", ["sound", "damaged", "foreign"])
def test_two_and_four_ranks_report_what_one_process_does(checkpoints: dict[str, Path], case: str) -> None:
    one = _verify(checkpoints[case], 1)
    assert one[0] == (1 if case == "damaged" else 0)
    if case == "damaged":
        assert len({f["where"] for f in one[1]["findings"]}) == 2
    if case != "foreign":  # every payload byte hashed once, by one rank or another
        assert one[1]["bytes_read"] >= sum(p.stat().st_size for p in checkpoints[case].glob("*.safetensors"))
    else:
        assert one[1]["read_through"] == "dcp" and one[1]["tensors"] > 0
    for ranks in (2, 4):
        assert _verify(checkpoints[case], ranks) == one


def test_the_files_are_shared_by_bytes_each_once(checkpoints: dict[str, Path]) -> None:
    manifest = ckptkit.read_manifest(str(checkpoints["sound"]))
    files = list(range(len(manifest.files)))
    for ranks in (1, 2, 3, 64):
        shares = share(manifest, files, ranks)
        assert len(shares) == ranks and sorted(i for s in shares for i in s) == files
        assert all(s == sorted(s) for s in shares)
        held = sorted(sum(manifest.files[i].size for i in s) for s in shares)
        # greedy largest first: no rank holds more than the lightest one plus the largest file
        assert held[-1] - held[0] <= max(f.size for f in manifest.files)
