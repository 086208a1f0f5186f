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
INCREMENTAL_TRIALS = 100  # the incremental issue's campaign: 100 SIGKILLs during delta saves and retention


def _save_forever(root: str, first: int, ready: Any, incremental: bool) -> None:
    """The process killed: saves steps from `first` on, each as the one `_expected` gives;
    `incremental`: through a manager keeping the last 2, each save writing what changed."""
    ready.set()
    if incremental:
        with ckptkit.CheckpointManager(root, keep_last=2, sync=True, incremental=True, name_format="step_{step:04d}",
                                       max_file_bytes=600_000, compact_after=2) as manager:
            for step in range(first, first + 1000):
                manager.save(step, {"model": _expected(step, incremental), "meta": {"step": step}})
    for step in range(first, first + 1000):
        state = {"model": _expected(step, incremental), "meta": {"step": step}}
        ckptkit.save(state, f"{root}/step_{step:04d}", step=step, max_file_bytes=600_000)


def _expected(step: int, incremental: bool = False) -> dict[str, torch.Tensor]:
    """Six tensors of `step`; incremental: the first four the same at every step (frozen), and a
    bf16 one of which each step changes one element more (patched, then compacted)."""
    g = torch.Generator().manual_seed(step)
    frozen = torch.Generator().manual_seed(0)
    out = {f"w{i}": torch.randn(64, 1024, generator=frozen if incremental and i < 4 else g) for i in range(6)}
    if incremental:
        half = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        half.view(-1)[: step % 4096] += 1
        out["half"] = half
    return out


# The saving processes are forked from a server that imported torch and ckptkit once, so that
# a trial does not pay an interpreter's start; each is still a process of its own, SIGKILLed.
_PROCESSES = multiprocessing.get_context("forkserver")
_PROCESSES.set_forkserver_preload(["torch", "ckptkit", __name__])


def _kill_at_random(root: Path, first_step: int, delay: float, incremental: bool) -> None:
    ready = _PROCESSES.Event()
    child = _PROCESSES.Process(target=_save_forever, args=(str(root), first_step, ready, incremental))
    child.start()
    assert ready.wait(60), "the saving process did not start"
    time.sleep(delay)
    assert child.pid is not None
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL


def _check(root: Path, names: set[str], incremental: bool) -> None:
    for name in sorted(names):
        report = ckptkit.verify(str(root / name))
        assert report.ok, (name, report.findings)
        state = ckptkit.load(str(root / name))
        step = state["meta"]["step"]
        assert name == f"step_{step:04d}"
        for key, value in _expected(step, incremental).items():
            assert torch.equal(state["model"][key], value), (name, key)


@pytest.mark.parametrize("incremental", [False, True], ids=["full", "incremental"])
def test_sigkill_during_saves_never_leaves_a_broken_commit(tmp_path: Path, incremental: bool) -> None:
    """Full saves; and incremental ones through a manager keeping the last 2 and compacting every
    second save (kills land in hashing, diffs, writes, commits, compactions and the retention
    that follows them): every committed checkpoint still verifies and loads, its bases included."""
    rng = random.Random(20261130)
    lives_per_root = 4
    committed = 0
    for trial in range(INCREMENTAL_TRIALS if incremental else TRIALS):
        root = tmp_path / f"root{trial // lives_per_root}"
        root.mkdir(exist_ok=True)
        before = ckptkit.list_checkpoints(str(root))
        steps = [e.step or 0 for e in before.checkpoints]
        _kill_at_random(root, max(steps, default=0) + 1, rng.uniform(0.0, 0.25 if incremental else 0.5), incremental)
        after = ckptkit.list_checkpoints(str(root))
        names = {e.name for e in after.checkpoints}
        old = {e.name for e in before.checkpoints}
        if incremental:  # retention removes old steps; every one that stays must still be whole
            # the latest may have been retired by newer saves, but never for an older one
            assert before.latest is None or (after.latest in names and after.latest >= before.latest), "latest went back"
            _check(root, names, incremental)
        else:
            assert old <= names, "a crash destroyed an earlier commit"
            # every new commit, and the previous latest, must verify and hold exactly what was saved
            _check(root, (names - old) | ({before.latest} if before.latest else set()), incremental)
        if after.latest:
            assert after.latest in names
        committed += len(names - old)
    # The kill instants must have landed both between and after commits to mean anything.
    assert committed > 0
    if incremental:  # and the saves must have patched and compacted (and read earlier ones)
        manifests = [ckptkit.read_manifest(str(d)) for d in tmp_path.glob("root*/step_*") if (d / "manifest.json").exists()]
        assert any(t.patches for m in manifests for t in m.tensors.values())
        assert any(f.role == "kept" for m in manifests for f in m.files)
        assert any(m.bases() for m in manifests)
