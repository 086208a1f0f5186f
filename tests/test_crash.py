"""SIGKILL a saving process at random instants: nothing that looks committed is ever broken."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit

pytestmark = pytest.mark.slow

TRIALS = 24


def _save_forever(root: str, first: int, ready: Any) -> None:
    """The process killed: saves steps from `first` on, each as the one `_expected` gives."""
    ready.set()
    for step in range(first, first + 1000):
        state = {"model": _expected(step), "meta": {"step": step}}
        ckptkit.save(state, f"{root}/step_{step:04d}", step=step, max_file_bytes=600_000)


def _expected(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"w{i}": torch.randn(64, 1024, generator=g) for i in range(6)}


# The saving processes are forked from a server that imported torch and ckptkit once, so that
# a trial does not pay an interpreter's start; each is still a process of its own, SIGKILLed.
_PROCESSES = multiprocessing.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["torch", "ckptkit", __name__])


def _kill_at_random(root: Path, first_step: int, delay: float) -> None:
    ready = _PROCESSES.Event()
    child = _PROCESSES.Process(target=_save_forever, args=(str(root), first_step, ready))
    child.start()
    assert ready.wait(60), "the saving process did not start"
    time.sleep(delay)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL


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
