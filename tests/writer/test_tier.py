"""The memory tier: snapshots in each node's folder and its peers', restored from the cheapest
good copy at any world size, never from a copy that fails its checks, never mixing steps;
flushed to storage by any surviving process alone.

Four gloo ranks as two simulated nodes (``node0``: ranks 0-1, ``node1``: ranks 2-3), each node a
folder of its own; tiny tensors."""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import ckptkit
from ckptkit import CheckpointManager, MemoryTier, ShardedTensor
from ckptkit.io.catalog import read_latest
from ckptkit.plan.tiers import Held, Route, Stored, assign, choose, peers
from ckptkit.trainer.launch import run_ranks
from ckptkit.writer.tier import NodeStorage, flush
from ..conftest import cli_schema

ROWS = 24


def _value(step: int) -> torch.Tensor:
    return torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4) * 10 + step


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    n = ROWS // world
    return {"model": {"w": ShardedTensor(_value(step)[rank * n : (rank + 1) * n].clone(), (ROWS, 4), (rank * n, 0))},
            "optimizer": {"m": torch.full((3,), float(step))}, "step": step}


def _manager(base: str, rank: int, world: int, **kw: Any) -> CheckpointManager:
    node = f"node{rank * 2 // world}" if world > 1 else "node0"
    return CheckpointManager(os.path.join(base, "store"), memory=MemoryTier(os.path.join(base, "shm"), node=node, **kw))


def _save_job(rank: int, world: int, base: str, steps: list[int]) -> None:
    with _manager(base, rank, world) as m:
        for step in steps:
            m.save(step, _state(rank, world, step), tier="memory")


def _restore_job(rank: int, world: int, base: str, out: str) -> None:
    n = ROWS // world
    target = {"model": {"w": ShardedTensor(torch.zeros(n, 4), (ROWS, 4), (rank * n, 0))}, "optimizer": {"m": torch.zeros(3)}}
    with _manager(base, rank, world) as m:
        try:
            state, report = m.restore(target)
        except ckptkit.CkptkitError as exc:
            Path(out, f"rank{rank}.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
            return
    step = state["step"]
    exact = torch.equal(state["model"]["w"].local, _value(step)[rank * n : (rank + 1) * n]) and torch.equal(
        state["optimizer"]["m"], torch.full((3,), float(step)))
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"step": step, "report_step": report.step, "exact": exact, "tiers": report.tiers(),
         "files": {k.split("/")[-1]: v for k, v in report.files.items()}, "skipped": report.skipped}))


def _restore(base: Path, world: int, name: str = "") -> list[dict[str, Any]]:
    out = base / f"out{world}{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    run_ranks(_restore_job, world, str(base), str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _flip(path: Path, at: int = -20) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _file(base: Path, node: str, step: int, rank: int) -> Path:
    return next((base / "shm" / node / f"step_{step:08d}").glob(f"*/rank{rank:05d}.safetensors"))


# --- planning (pure) -------------------------------------------------------------------------


def _held(cid: str, step: int, present: set[str], files: tuple[str, ...] = ("a", "b")) -> Held:
    return Held(cid, step, f"step_{step}", tuple((f, 10) for f in files), frozenset(present))


def test_choose_takes_the_newest_step_with_a_good_copy_of_every_file() -> None:
    # node x (ranks 0, 1) holds step 2 whole, node y (rank 2) step 3 without "b" and step 2's "a".
    held = [[_held("s2", 2, {"a", "b"})]] * 2 + [[_held("s3", 3, {"a"}), _held("s2", 2, {"a"})]]
    choice = choose(held, [])
    assert choice is not None and (choice.step, dict(choice.holders)) == (2, {"a": (0, 1, 2), "b": (0, 1)})
    assert "step 3" in choice.skipped[0] and "b" in choice.skipped[0]
    # The only copies of step 2's "b" are bad: nothing whole is left in memory; storage's step 1 is.
    bad = frozenset({(0, "s2", "b"), (1, "s2", "b")})
    assert choose(held, [Stored("step_1", 1, "x1")], bad).step == 1  # type: ignore[union-attr]
    assert choose(held, [], bad) is None
    # A flushed copy of step 3 (same id) in storage stands in for the missing file, file by file.
    choice = choose(held, [Stored("step_3", 3, "s3")])
    assert choice is not None and choice.step == 3 and choice.stored is not None and choice.holders["b"] == ()
    # Storage's step 3 of another id is another checkpoint: memory's step 2 is newer than nothing of it.
    assert choose(held, [Stored("step_3", 3, "other")]).checkpoint_id == "other"  # type: ignore[union-attr]


def test_assign_reads_locally_then_from_one_peer_per_node_then_storage() -> None:
    held = [[_held("s", 5, {"a", "b"})], [_held("s", 5, {"a", "b"})], [], []]
    choice = choose(held, [Stored("step_5", 5, "s")])
    assert choice is not None
    nodes = ["x", "x", "y", "y"]
    plan = assign(choice, [["a"], ["b"], ["a", "b"], ["a"]], nodes)
    assert plan.routes[0] == {"a": Route("memory")} and plan.routes[1] == {"b": Route("memory")}
    # Node y gets each file once, from node x's ranks, balanced; rank 3 reads rank 2's received copy.
    assert sorted(plan.transfers) == [(0, 2, "a"), (1, 2, "b")]
    assert plan.routes[3]["a"] == Route("peer", 0)
    assert peers(["x", "x", "y", "y", "z", "z"], 1, 2) == [3, 5] and peers(["x", "x"], 0, 1) == []


# --- real ranks ------------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_snapshots_restore_exactly_from_memory_peers_and_at_another_world_size(tmp_path: Path) -> None:
    run_ranks(_save_job, 4, str(tmp_path), [1, 2, 3])
    shm = tmp_path / "shm"
    # keep=2: each node keeps steps 2 and 3, each with every rank's file (two nodes: one replica each).
    for node in ("node0", "node1"):
        assert sorted(p.name for p in (shm / node).iterdir()) == ["step_00000002", "step_00000003"]
        assert len(list((shm / node / "step_00000003").glob("*/rank*.safetensors"))) == 4
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())  # storage untouched
    assert ckptkit.verify(str(shm / "node0" / "step_00000003")).ok
    got = _restore(tmp_path, 4)
    assert [(g["step"], g["exact"], set(g["tiers"])) for g in got] == [(3, True, {"memory"})] * 4

    # A flipped byte in node1's copy of rank 2's file: rank 2's read fails its checks, the copy is
    # left out, and rank 2 reads node0's copy, sent over; still step 3, never the bad bytes.
    _flip(_file(tmp_path, "node1", 3, 2))
    got = _restore(tmp_path, 4)
    assert [(g["step"], g["exact"]) for g in got] == [(3, True)] * 4
    assert got[2]["files"]["rank00002.safetensors"] == "peer 0" and any("rank00002" in s and "failed its checks" in s for s in got[2]["skipped"])

    # node1 lost (its folder wiped): its ranks restore from node0, and node1 holds the files again.
    shutil.rmtree(shm / "node1")
    got = _restore(tmp_path, 4)
    assert [(g["step"], g["exact"]) for g in got] == [(3, True)] * 4 and got[3]["files"]["rank00003.safetensors"].startswith("peer")
    assert ckptkit.read_manifest(str(shm / "node1" / "step_00000003")).step == 3

    # Fewer ranks (3, on node0 and node1): resharded on load, exact.
    got = _restore(tmp_path, 3)
    assert [(g["step"], g["exact"]) for g in got] == [(3, True)] * 3

    # The only copy of one file of step 3 bad (node1 got back only the files its ranks read): step
    # 3 cannot be restored whole, so step 2 is, and the report says why; never a mix of steps.
    assert not list((shm / "node1" / "step_00000003").glob("*/rank00001.safetensors"))
    _flip(_file(tmp_path, "node0", 3, 1))
    got = _restore(tmp_path, 4)
    assert [(g["step"], g["exact"]) for g in got] == [(2, True)] * 4
    assert any("step 3" in s for s in got[0]["skipped"])
    # Step 3 is gone from every node: the run's next snapshot of step 3 must not find it there.
    assert [sorted(p.name for p in (shm / n).iterdir()) for n in ("node0", "node1")] == [["step_00000002"]] * 2


@pytest.mark.multiprocess
def test_flush_by_one_process_commits_a_normal_checkpoint_and_a_failed_one_changes_nothing(tmp_path: Path) -> None:
    run_ranks(_save_job, 4, str(tmp_path), [1, 2])
    store = tmp_path / "store"
    node0, root = NodeStorage(tmp_path / "shm" / "node0"), ckptkit.open_storage(str(store))
    # Past its deadline nothing is committed: no checkpoint, no latest.
    report = flush(node0, root, deadline_s=-1)
    assert report.committed is None and "deadline" in report.notes[0]
    assert not (store / "step_00000002").exists() and read_latest(root) == ""
    # node1 died; node0's process flushes alone: step 2 committed, latest, loads and verifies.
    report = flush(node0, root)
    assert (report.committed, report.step, len(report.written)) == ("step_00000002", 2, 4)
    assert ckptkit.verify(str(store / "step_00000002")).ok
    assert read_latest(root) == "step_00000002"
    loaded = ckptkit.load(str(store / "step_00000002"))
    assert torch.equal(loaded["model"]["w"], _value(2)) and loaded["step"] == 2
    # Flushed again (another surviving process): nothing new is written.
    assert flush(NodeStorage(tmp_path / "shm" / "node1"), root).written == []
    # Memory lost entirely: the restore reads the flushed checkpoint from storage.
    shutil.rmtree(tmp_path / "shm")
    got = _restore(tmp_path, 4)
    assert [(g["step"], g["exact"], set(g["tiers"])) for g in got] == [(2, True, {"storage"})] * 4


@pytest.mark.multiprocess
def test_a_snapshot_cut_off_before_its_replicas_is_skipped_and_racing_restores_agree(tmp_path: Path) -> None:
    run_ranks(_save_job, 4, str(tmp_path), [1, 2])
    shm = tmp_path / "shm"
    # node1 died after rank 0 committed step 2 and before the replicas: node1 has no step 2, node0
    # no copy of ranks 2 and 3's files, and its copy of rank 1's file was cut off mid-write.
    shutil.rmtree(shm / "node1" / "step_00000002")
    for rank in (2, 3):
        _file(tmp_path, "node0", 2, rank).unlink()
    cut = _file(tmp_path, "node0", 2, 1)
    cut.write_bytes(cut.read_bytes()[:100])
    # Two restarts at once (a relaunch racing a late one): both take step 1, whole and exact.
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda name: _restore(tmp_path, 4, name), ["a", "b"]))
    for got in runs:
        assert [(g["step"], g["exact"]) for g in got] == [(1, True)] * 4
    # The first to finish drops the cut-off step 2; the other says why it skipped it, if it saw it.
    assert any("step 2" in s and "no good copy of 3 file(s)" in s for got in runs for s in got[0]["skipped"])
    assert not (shm / "node0" / "step_00000002").exists()


def test_flush_leaves_out_a_copy_that_fails_its_checks_and_the_command_says_so(tmp_path: Path, run_ckptkit: Any) -> None:
    with _manager(str(tmp_path), 0, 1) as m:
        m.save(1, _state(0, 1, 1), tier="memory")
        m.save(2, _state(0, 1, 2), tier="memory")
    node, store = tmp_path / "shm" / "node0", tmp_path / "store"
    _flip(_file(tmp_path, "node0", 2, 0))
    # The newest snapshot has a bad file and no other copy: the one before it is flushed.
    proc = run_ckptkit("flush", str(node), str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, cli_schema("flush"))
    assert (doc["committed"], doc["step"]) == ("step_00000001", 1) and "do not match" in " ".join(doc["notes"])
    assert not (store / "step_00000002").exists() and ckptkit.verify(str(store)).ok
    # With step 1 gone from the node too, nothing can be flushed: exit 1, one line, storage as it was.
    shutil.rmtree(node / "step_00000001")
    proc = run_ckptkit("flush", str(node), str(store))
    assert proc.returncode == 1 and proc.stderr.startswith("ckptkit: error: ") and "nothing flushed" in proc.stderr
    assert read_latest(ckptkit.open_storage(str(store))) == "step_00000001"
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) == ["latest", "step_00000001"]


# --- one process: storage as a tier, stale names ---------------------------------------------


def _whole(step: int) -> dict[str, Any]:
    return {"model": {"w": _value(step)}, "optimizer": {"m": torch.full((3,), float(step))}, "step": step}


def _one(base: Path, **kw: Any) -> CheckpointManager:
    return CheckpointManager(base / "store", memory=MemoryTier(str(base / "shm"), node="node0"), **kw)


def test_restore_falls_back_to_an_older_storage_checkpoint_and_reads_incremental_ones_whole(tmp_path: Path) -> None:
    with _one(tmp_path, incremental=True) as m:
        for step in (1, 2, 3):  # incremental: steps 2 and 3 read what did not change from earlier ones
            m.save(step, {"model": {"w": _value(step), "frozen": torch.ones(64)}, "step": step})
        # Memory holds nothing: storage's newest is read, its earlier checkpoints' files included.
        state, report = m.restore()
        assert (report.step, report.tiers()) == (3, {"storage": 2}) and torch.equal(state["model"]["w"], _value(3))
        assert sorted(report.files) == ["../step_00000001/rank00000.safetensors", "rank00000.safetensors"]
        assert torch.equal(state["model"]["frozen"], torch.ones(64))
        _flip(next((tmp_path / "store" / "step_00000003").glob("*.safetensors")))
        state, report = m.restore()  # step 3 fails its checks: step 2, which verifies
        assert report.step == 2 and torch.equal(state["model"]["w"], _value(2))
        assert any("step 3" in s and "failed its checks" in s for s in report.skipped)


def test_an_unreadable_checkpoint_is_never_a_new_run(tmp_path: Path) -> None:
    ckptkit.save(_whole(1), tmp_path / "store" / "step_00000001", step=1)
    manifest = tmp_path / "store" / "step_00000001" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step":1,', '"step":7,'))  # its seal no longer matches
    with _one(tmp_path) as m, pytest.raises(ckptkit.IntegrityError, match="manifest cannot be read"):
        m.restore()
    shutil.rmtree(tmp_path / "store")
    with _one(tmp_path) as m, pytest.raises(ckptkit.CheckpointNotFoundError, match="nothing to restore"):
        m.restore()  # nothing anywhere: a new run


def test_a_snapshot_taken_again_replaces_the_stale_one_of_the_same_step(tmp_path: Path) -> None:
    with _one(tmp_path) as m:
        m.save(1, _whole(1), tier="memory")
        m.save(2, _whole(2), tier="memory")
        m.save(2, _whole(5) | {"step": 2}, tier="memory")  # the run went back to step 1 and on again
        state, report = m.restore()
    assert report.step == 2 and torch.equal(state["model"]["w"], _value(5))
    assert len(list((tmp_path / "shm" / "node0" / "step_00000002").iterdir())) == 2  # one id folder and the manifest


def test_flush_never_writes_into_a_storage_checkpoint_of_the_same_name(tmp_path: Path) -> None:
    with _one(tmp_path) as m:
        m.save(1, _whole(1), tier="memory")
        m.save(1, _whole(1))  # storage's own step 1: another checkpoint of the same name
        m.wait()
        report = m.flush()
    assert report.committed is None and report.written == [] and "another checkpoint of that name" in report.notes[0]
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]  # no stage left behind
