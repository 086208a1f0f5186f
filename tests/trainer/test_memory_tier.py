"""The reference trainer with a memory tier, killed at random instants: every restart restores
the newest fully replicated step, and the losses after it are bitwise those of a run never
killed; after losing a node it also continues on 3 ranks with no sample repeated or skipped.

Four gloo ranks as two simulated nodes (``--ranks-per-node 2``), a snapshot every step. The
run never killed is trained once for both tests."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ckptkit.plan.tiers import choose
from ckptkit.writer.tier import NodeStorage, snapshots
from ..conftest import _ckptkit_command

pytestmark = pytest.mark.multiprocess

STEPS = 8
COMMON = ("--model", "tiny", "--global-batch", "12", "--seq-len", "16", "--quiet")


def _train(out: Path, steps: int, *, world: tuple[int, int] = (2, 2), memory: Path | None = None) -> subprocess.Popen[bytes]:
    tp, dp = world
    cmd = [*_ckptkit_command(), "train", "--tp", str(tp), "--dp", str(dp), "--zero", "1", "--steps", str(steps),
           "--out", str(out), "--log-jsonl", str(out) + ".jsonl", *COMMON]
    if memory is not None:
        cmd += ["--memory-dir", str(memory), "--memory-every", "1", "--ranks-per-node", "2", "--resume", "latest",
                "--resume-if-present"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in Path(str(out) + ".jsonl").read_text().splitlines()]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (the launcher's ranks and its fork server)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _expected_step(shm: Path) -> int | None:
    """The newest step whose every file has a copy in some node's folder, now."""
    nodes = sorted(p for p in shm.iterdir()) if shm.exists() else []
    held = [[h for h, _ in snapshots(NodeStorage(n))] for n in nodes]
    choice = choose(held, [])
    return None if choice is None else choice.step


def _kill_at_random(proc: subprocess.Popen[bytes], rng: random.Random, window: tuple[float, float], whole: bool) -> bool:
    """SIGKILL one rank (or, with `whole`, every process of the job) at a random instant of
    `window` seconds after the start; False when the run ended first."""
    deadline = time.monotonic() + rng.uniform(*window)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    ranks = _descendants(proc.pid)
    if not ranks:
        return False
    victims = [proc.pid, *ranks] if whole else [rng.choice(ranks)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=120)
    for pid in _descendants(proc.pid) if not whole else []:
        os.kill(pid, signal.SIGKILL)
    return True


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Each step's record of the run never killed (4 ranks, TP 2 x DP 2)."""
    baseline = tmp_path_factory.mktemp("unkilled") / "run"
    assert _train(baseline, STEPS).wait(timeout=300) == 0
    return {r["step"]: r for r in _records(baseline) if "event" not in r}


def test_killed_runs_restore_the_newest_replicated_step_with_the_losses_of_an_unkilled_run(
    tmp_path: Path, unkilled: dict[int, dict]
) -> None:
    expected = unkilled

    out, shm = tmp_path / "run", tmp_path / "shm"
    rng = random.Random(20261204)
    kills = 0
    befores = []
    for attempt in range(8):
        before = _expected_step(shm)
        befores.append(before)
        proc = _train(out, STEPS, memory=shm)
        if attempt < 3 and _kill_at_random(proc, rng, (2.0, 5.0), whole=attempt == 2):
            kills += 1
            continue
        assert proc.wait(timeout=300) == 0, proc.stderr.read().decode() if proc.stderr else ""
        break
    else:
        pytest.fail("the run never finished")
    records = _records(out)
    steps = [r for r in records if "event" not in r]
    # Every step any attempt logged has the loss and the samples of the run never killed.
    assert {r["step"] for r in steps} == set(expected)
    for r in steps:
        assert (r["loss"], r["sample_ids"]) == (expected[r["step"]]["loss"], expected[r["step"]]["sample_ids"]), r["step"]
    # Each restart restored the newest step with a whole copy, as it was when it started.
    restored = [r["step"] for r in records if r.get("event") == "restore"]
    assert kills >= 1 and restored and before is not None and restored[-1] == before
    assert set(restored) <= set(befores)


def test_a_lost_node_the_job_continues_on_three_ranks_without_repeating_a_sample(
    tmp_path: Path, unkilled: dict[int, dict]
) -> None:
    expected = {step: r["sample_ids"] for step, r in unkilled.items()}
    out, shm = tmp_path / "run", tmp_path / "shm"
    assert _train(out, 5, memory=shm).wait(timeout=300) == 0
    shutil.rmtree(shm / "node1")  # node1 lost: its processes and its folder
    proc = _train(out, STEPS, world=(1, 3), memory=shm)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode() if proc.stderr else ""
    records = _records(out)
    restore = [r for r in records if r.get("event") == "restore"]
    assert [r["step"] for r in restore] == [5]
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["sample_ids"] == expected[r["step"]] for r in steps)  # none repeated, none skipped
