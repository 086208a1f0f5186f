"""The reference trainer with a memory tier, killed at random instants: every restart restores
the newest fully replicated step, and the losses after it are bitwise those of a run never
killed; after losing a node it also continues on 3 ranks with no sample repeated or skipped.

Four gloo ranks as two simulated nodes (``--ranks-per-node 2``), a snapshot every step. The
run never killed is trained once for both tests. The longer campaign, with node losses and
corrupted replicas, is ``python -m benchmarks.tier_faults``."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tier_faults import expected_step, kill_at, records, train

pytestmark = pytest.mark.multiprocess

STEPS = 6


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Each step's record of the run never killed (4 ranks, TP 2 x DP 2)."""
    baseline = tmp_path_factory.mktemp("unkilled") / "run"
    assert train(baseline, STEPS).wait(timeout=300) == 0
    return {r["step"]: r for r in records(baseline) if "event" not in r}


def test_killed_runs_restore_the_newest_replicated_step_with_the_losses_of_an_unkilled_run(
    tmp_path: Path, unkilled: dict[int, dict[str, Any]]
) -> None:
    expected = unkilled

    out, shm = tmp_path / "run", tmp_path / "shm"
    rng = random.Random(20261204)
    kills = 0
    befores = []
    for attempt in range(8):
        before = expected_step(shm, out=out)  # memory, or storage where a flush on SIGTERM put a step
        befores.append(before)
        proc = train(out, STEPS, memory=shm)
        # Killed at a random instant after its next snapshot committed (so that each restart has
        # one to restore, however slow the machine).
        if attempt < 2 and kill_at(proc, rng.uniform(0.0, 0.2), rng, "job" if attempt == 1 else "rank", log=out,
                                   event="snapshot"):
            kills += 1
            continue
        assert proc.wait(timeout=300) == 0, proc.stderr.read().decode() if proc.stderr else ""
        break
    else:
        pytest.fail("the run never finished")
    log = records(out)
    steps = [r for r in log if "event" not in r]
    # Every step any attempt logged has the loss and the samples of the run never killed.
    assert {r["step"] for r in steps} == set(expected)
    for r in steps:
        assert (r["loss"], r["sample_ids"]) == (expected[r["step"]]["loss"], expected[r["step"]]["sample_ids"]), r["step"]
    # Each restart restored the newest step with a whole copy, as it was when it started.
    restored = [r["step"] for r in log if r.get("event") == "restore"]
    assert kills >= 1 and restored and before is not None and restored[-1] == before
    assert set(restored) <= set(befores)


def test_a_lost_node_the_job_continues_on_three_ranks_without_repeating_a_sample(
    tmp_path: Path, unkilled: dict[int, dict[str, Any]]
) -> None:
    expected = {step: r["sample_ids"] for step, r in unkilled.items()}
    out, shm = tmp_path / "run", tmp_path / "shm"
    assert train(out, 3, memory=shm).wait(timeout=300) == 0
    shutil.rmtree(shm / "node1")  # node1 lost: its processes and its folder
    proc = train(out, STEPS, world=(1, 3), memory=shm)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode() if proc.stderr else ""
    log = records(out)
    restore = [r for r in log if r.get("event") == "restore"]
    assert [r["step"] for r in restore] == [3]
    steps = [r for r in log if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["sample_ids"] == expected[r["step"]] for r in steps)  # none repeated, none skipped
