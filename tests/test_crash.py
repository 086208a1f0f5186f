"""SIGKILL a saving process at random instants: nothing that looks committed is ever broken."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptkit

pytestmark = pytest.mark.slow

TRIALS = 24

_CHILD = r"""
import sys, torch, ckptkit
root, first = sys.argv[1], int(sys.argv[2])
print("ready", flush=True)
for step in range(first, first + 1000):
    g = torch.Generator().manual_seed(step)
    state = {"model": {f"w{i}": torch.randn(64, 1024, generator=g) for i in range(6)}, "meta": {"step": step}}
    ckptkit.save(state, f"{root}/step_{step:04d}", step=step, max_file_bytes=600_000)
"""


def _expected(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(64, 1024, generator=g) for i in range(6)}


def _kill_at_random(root: Path, first_step: int, delay: float) -> None:
    cmd = [sys.executable, "-c", _CHILD, str(root), str(first_step)]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()


def _check(root: Path, names: set[str]) -> None:
    for name in sorted(names):
        report = ckptkit.verify(str(root / name))
        assert report.ok, (name, report.findings)
        state = ckptkit.load(str(root / name))
        step = state["meta"]["step"]
        assert name == f"step_{step:04d}"
        for key, value in _expected(step).items():
            assert torch.equal(state["model"][key], value), (name, key)


def test_sigkill_during_saves_never_leaves_a_broken_commit(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    lives_per_root = 4
    committed = 0
    for trial in range(TRIALS):
        root = tmp_path / f"root{trial // lives_per_root}"
        root.mkdir(exist_ok=True)
        before = ckptkit.list_checkpoints(str(root))
        steps = [e.step or 0 for e in before.checkpoints]
        _kill_at_random(root, max(steps, default=0) + 1, rng.uniform(0.0, 0.5))
        after = ckptkit.list_checkpoints(str(root))
        names = {e.name for e in after.checkpoints}
        old = {e.name for e in before.checkpoints}
        assert old <= names, "a crash destroyed an earlier commit"
        # every new commit, and the previous latest, must verify and hold exactly what was saved
        _check(root, (names - old) | ({before.latest} if before.latest else set()))
        if after.latest:
            assert after.latest in names
        committed += len(names - old)
    # The kill instants must have landed both between and after commits to mean anything.
    assert committed > 0
