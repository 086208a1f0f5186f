"""A fault campaign for the memory tier: the reference trainer on 4 gloo ranks as 2 simulated
nodes, a memory snapshot every step, killed with SIGKILL at random instants, again and again.

Each kill takes one rank, or the whole job, or a whole node (the job and one node's folder), or
the whole job during a flush (a SIGTERM to every rank, which flushes the newest snapshot to
storage, then the SIGKILL a random instant later).
Before some restarts one byte of a random copy in a node's folder is flipped. Every restart runs
the same command (``--resume latest --resume-if-present``), like a launcher's restart. The
campaign checks, for every restart, that:

- it restored the newest step that had a good copy of every file when it started (computed
  from the folders, leaving out the copy corrupted on purpose), or started anew when none had,
  or said there was nothing to train when storage held the run's last step (a flush put it there);
- the run then finished or was killed, never failing by itself (a restart loop);
- every step any attempt logged has the loss and the samples of a run never killed, bitwise,
  so no restore read a corrupted byte;
- after a kill during a flush, every checkpoint committed in storage verifies (a flush cut off
  leaves storage as it was).

``python -m benchmarks.tier_faults --kills 200`` (about 4 s per kill here); the tests run a few
kills of the same kind (``tests/trainer/test_memory_tier.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ckptkit.plan.tiers import choose
from ckptkit.storage.local import LocalStorage
from ckptkit.writer.tier import NodeStorage, snapshots, stored

COMMON = ("--model", "tiny", "--global-batch", "12", "--seq-len", "16", "--quiet")


def train(out: Path, steps: int, *, world: tuple[int, int] = (2, 2), memory: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``ckptkit train`` at (tp, dp) = `world` up to `steps`, logging to ``<out>.jsonl``;
    with `memory`, a memory tier there (a snapshot every step, 2 ranks per node), restoring on start."""
    tp, dp = world
    command = [sys.executable, "-m", "ckptkit.cli"]
    cmd = [*command, "train", "--tp", str(tp), "--dp", str(dp), "--zero", "1", "--steps", str(steps), "--out", str(out),
           "--log-jsonl", str(out) + ".jsonl", *COMMON]
    if memory is not None:
        cmd += ["--memory-dir", str(memory), "--memory-every", "1", "--ranks-per-node", "2", "--resume", "latest",
                "--resume-if-present"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def records(out: Path) -> list[dict[str, Any]]:
    """The run's log: step records and events (restore, save); a line a kill cut off is left out."""
    path = Path(str(out) + ".jsonl")
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def descendants(pid: int, depth: int | None = None) -> list[int]:
    """Every process below `pid` (the launcher's fork server and resource tracker, the ranks the
    fork server forked), or those `depth` levels below it (2: the ranks)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [(pid, 0)]
    while todo:
        parent, level = todo.pop()
        for child in children.get(parent, []):
            if depth is None or level + 1 == depth:
                out.append(child)
            todo.append((child, level + 1))
    return out


def expected_step(shm: Path, bad: frozenset[tuple[str, str, str]] = frozenset(), out: Path | None = None) -> int | None:
    """The newest step whose every file has a good copy now in some node's folder (or in storage
    at `out`, where a flush on SIGTERM may have put one); `bad` lists the copies known to be bad
    as (node, checkpoint id, path)."""
    nodes = sorted(p for p in shm.iterdir()) if shm.exists() else []
    held = [[h for h, _ in snapshots(NodeStorage(n))] for n in nodes]
    bad_ranks = frozenset((i, cid, path) for i, n in enumerate(nodes) for node, cid, path in bad if n.name == node)
    in_storage = stored(LocalStorage(out), {h.step for hs in held for h in hs}) if out is not None and out.exists() else []
    choice = choose(held, in_storage, bad_ranks)
    return None if choice is None else choice.step


def kill_at(proc: subprocess.Popen[bytes], after_s: float, rng: random.Random, how: str, *, log: Path | None = None,
            event: str | None = None) -> bool:
    """SIGKILL one rank (`how` "rank") or every process of the job ("job", "node") `after_s`
    seconds after the start (with `log`: after the job's next line there, once it trains; with
    `event` too, its next record of that event, such as a committed ``snapshot``); with "flush",
    SIGTERM every rank then (they flush), and SIGKILL the job up to 1.5 s later. False when the
    run ended first. The job's leftover processes are killed too."""

    def count() -> int:
        return len([r for r in records(log) if event is None or r.get("event") == event]) if log is not None else 0

    lines = count()
    while log is not None and count() == lines:
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    deadline = time.monotonic() + after_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    ranks = descendants(proc.pid, depth=2)
    if not ranks:
        return False
    if how == "flush":
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(rng.uniform(0.0, 1.5))
    for pid in ([proc.pid, *descendants(proc.pid), *ranks] if how != "rank" else [rng.choice(ranks)]):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=120)
    finally:
        for pid in {*ranks, *descendants(proc.pid)}:  # the ranks too: a launcher gone first leaves them orphans
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return proc.returncode != 0  # 0: it ended just before the kill


def committed(out: Path) -> list[str]:
    """The checkpoints storage at `out` holds committed (a hidden folder is a flush being staged)."""
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and (p / "manifest.json").is_file()) if out.exists() else []


def problems_of(out: Path) -> list[str]:
    """What `verify` finds wrong with the checkpoints committed at `out`."""
    import ckptkit

    problems = []
    for name in committed(out):
        report = ckptkit.verify(out / name)
        if not report.ok:
            problems.append(f"{name}: " + "; ".join(str(f) for f in report.findings[:3]))
    return problems


def held_any(shm: Path, out: Path) -> bool:
    """Whether any node's folder or storage holds a committed snapshot or checkpoint."""
    nodes = sorted(p for p in shm.iterdir()) if shm.exists() else []
    return any(snapshots(NodeStorage(n)) for n in nodes) or (out.exists() and bool(stored(LocalStorage(out), set())))


def corrupt(shm: Path, rng: random.Random) -> tuple[str, str, str] | None:
    """Flip one byte of a random payload copy of which another node holds a copy too (a replica
    gone bad, not the loss of a file); return (node, id, path)."""
    held = {node: {h.checkpoint_id: h for h, _ in snapshots(NodeStorage(node))}
            for node in (sorted(p for p in shm.iterdir()) if shm.exists() else [])}
    copies = []
    for node, snaps in held.items():
        for cid, h in snaps.items():
            others = [o for o in held if o != node and cid in held[o]]
            copies += [(node, h, path) for path in sorted(h.present) if any(path in held[o][cid].present for o in others)]
    if not copies:
        return None
    node, snap, path = rng.choice(copies)
    target = node / snap.name / path
    data = bytearray(target.read_bytes())
    data[rng.randrange(len(data))] ^= 0xFF
    target.write_bytes(bytes(data))
    return node.name, snap.checkpoint_id, path


def campaign(kills: int, steps: int, seed: int, work: Path, say: Any) -> dict[str, Any]:
    """Kill runs until `kills` kills; return the tally of what every restart did."""
    rng = random.Random(seed)
    baseline = work / "unkilled"
    proc = train(baseline, steps)
    if proc.wait(timeout=600):
        raise RuntimeError(f"the run never killed failed: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
    expected = {r["step"]: r for r in records(baseline) if "event" not in r}
    tally: dict[str, Any] = {"kills": 0, "kinds": {"rank": 0, "job": 0, "node": 0, "flush": 0}, "corruptions": 0, "attempts": 0,
                             "restores": 0, "restores_as_expected": 0, "unexpected": [], "fresh_starts": 0, "complete": 0, "loops": 0, "unrestorable": 0,
                             "runs": 0, "steps_checked": 0, "mismatched_steps": 0,
                             "flushes_committed": 0, "storage_problems": []}
    started = time.monotonic()
    while tally["kills"] < kills:
        run = tally["runs"] + 1
        out, shm = work / f"run{run}", work / f"shm{run}"
        bad: set[tuple[str, str, str]] = set()
        seen = 0  # restore events logged so far in this run
        while True:
            before = expected_step(shm, frozenset(bad), out)
            committed_before = len(committed(out))
            proc = train(out, steps, memory=shm)
            tally["attempts"] += 1
            how = rng.choice(["rank", "rank", "job", "node", "flush"])
            # A quarter of the kills at an instant of the start (imports, restore), the others of the training.
            at_start = rng.random() < 0.25
            killed = tally["kills"] < kills and kill_at(proc, rng.uniform(0.5, 4.0) if at_start else rng.uniform(0.0, 3.0), rng, how,
                                                        log=None if at_start else out)
            lost = before is None and held_any(shm, out)  # the faults left no whole step: a refusal is right
            if not killed and proc.wait(timeout=600):
                error = proc.stderr.read().decode()[-800:] if proc.stderr else ""
                if lost and "nothing to restore whole" in error:
                    tally["unrestorable"] += 1
                    break
                tally["loops"] += 1  # a restart that failed by itself
                say(f"run {run}: a restart failed by itself: {error}")
            if os.environ.get("CKPTKIT_FAULTS_VERBOSE"):
                say(f"  attempt {tally['attempts']}: expected {before}, kill {how if killed else '-'}, rc {proc.returncode}: "
                    + (proc.stderr.read().decode()[-800:].replace(chr(10), ' | ') if proc.stderr else ""))
            restores = [r["step"] for r in records(out) if r.get("event") == "restore"]
            if len(restores) > seen:  # this attempt restored (rank 0 logs one event)
                tally["restores"] += 1
                if restores[-1] == before:
                    tally["restores_as_expected"] += 1
                else:
                    tally["unexpected"].append({"run": run, "expected": before, "restored": restores[-1]})
                seen = len(restores)
            elif not killed:  # it finished without restoring: nothing was there, or nothing left to train
                said = proc.stderr.read().decode()[-800:] if proc.stderr else ""
                if before is None:
                    tally["fresh_starts"] += 1
                elif before == steps and "nothing to train" in said:  # a flush had committed the last step to storage
                    tally["complete"] += 1
                else:
                    tally["unexpected"].append({"run": run, "expected": before, "restored": None})
            if not killed:
                break
            tally["kills"] += 1
            tally["kinds"][how] += 1
            if how == "flush":
                tally["flushes_committed"] += len(committed(out)) > committed_before
                tally["storage_problems"] += [f"run {run}: {p}" for p in problems_of(out)]
            if how == "node":
                shutil.rmtree(shm / rng.choice(["node0", "node1"]), ignore_errors=True)
            elif rng.random() < 0.25 and (flipped := corrupt(shm, rng)) is not None:
                tally["corruptions"] += 1
                bad.add(flipped)
        for r in records(out):
            if "event" in r:
                continue
            tally["steps_checked"] += 1
            if (r["loss"], r["sample_ids"]) != (expected[r["step"]]["loss"], expected[r["step"]]["sample_ids"]):
                tally["mismatched_steps"] += 1
        tally["runs"] += 1
        say(f"run {run}: {tally['kills']} kills, {tally['restores']} restores ({len(tally['unexpected'])} unexpected), "
            f"{tally['steps_checked']} step records checked ({tally['mismatched_steps']} mismatched), "
            f"{time.monotonic() - started:.0f} s")
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    tally["seconds"] = time.monotonic() - started
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tier_faults", description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30, help="steps of each run (default 30)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as work:
        tally = campaign(args.kills, args.steps, args.seed, Path(work), lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(tally, indent=1))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(tally, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
