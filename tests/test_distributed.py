"""Real torch.distributed ranks (gloo): collective save, load with other shardings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ckptkit
from ckptkit import ShardedTensor
from .sharded_state import global_state, param_shapes, rank_state
from ckptkit.trainer.launch import run_ranks
from ckptkit.manifest import Topology

pytestmark = pytest.mark.multiprocess


def _save_rank(rank: int, world: int, path: str) -> None:
    ckptkit.save(rank_state(rank), path, step=7, topology=Topology(world_size=world, tp=2, dp=2, zero_stage=1))


def _load_rank(rank: int, world: int, path: str, out: str) -> None:
    """Two ranks: params split by rows (dim 0) into halves, moments as flat ZeRO ranges of the whole tensor."""
    expected = global_state()
    mismatches = []
    for name, (shape, _) in param_shapes().items():
        rows = shape[0] // world
        local = torch.empty((rows, *shape[1:]))
        param = ShardedTensor(local, shape, (rank * rows,) + (0,) * (len(shape) - 1))
        n = local.numel() * world
        cut = [0, n // 3, n][rank : rank + 2]  # uneven: a third, then two thirds
        flat = torch.empty(cut[1] - cut[0])
        target = {"model": {name: param}, "optimizer": {"exp_avg": {name: ShardedTensor.from_flat(flat, shape, cut[0])}}}
        ckptkit.load(path, target)
        if not torch.equal(local, expected[f"model/{name}"][rank * rows : (rank + 1) * rows]):
            mismatches.append(f"model/{name}")
        if not torch.equal(flat, expected[f"optimizer/exp_avg/{name}"].reshape(-1)[cut[0] : cut[1]]):
            mismatches.append(f"optimizer/exp_avg/{name}")
    Path(out, f"rank{rank}.json").write_text(json.dumps(mismatches))


def _disagreeing_rank(rank: int, world: int, path: str, out: str) -> None:
    shape = (4, 4) if rank == 0 else (4, 5)
    try:
        ckptkit.save({"model": {"w": torch.zeros(shape)}}, path, step=1)
        result = "saved"
    except ckptkit.LayoutError as exc:
        result = f"LayoutError: {exc}"
    Path(out, f"rank{rank}.txt").write_text(result)
    dist.barrier()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dist")
    run_ranks(_save_rank, 4, str(root / "step_7"))
    return root / "step_7"


def test_four_ranks_commit_one_sound_checkpoint(saved: Path) -> None:
    m = ckptkit.read_manifest(str(saved))
    assert m.topology.world_size == 4 and m.topology.zero_stage == 1
    assert sorted(f.path for f in m.files) == [f"rank{r:05d}.safetensors" for r in range(4)]
    assert ckptkit.verify(str(saved)).ok
    assert (saved.parent / "latest").read_text().split()[0] == "step_7"


def test_one_process_loads_every_tensor_bitwise(saved: Path) -> None:
    out = ckptkit.load(str(saved))
    expected = global_state()
    for fqn, value in expected.items():
        head, kind_or_name, *rest = fqn.split("/")
        got = out[head][kind_or_name] if not rest else out[head][kind_or_name][rest[0]]
        assert torch.equal(got, value), fqn
    rng = out["rng"]["torch_cpu"]
    assert rng.shape[0] == 4
    for r in range(4):
        assert torch.equal(rng[r], torch.Generator().manual_seed(1000 + r).get_state())


def test_two_ranks_load_with_another_sharding(saved: Path, tmp_path: Path) -> None:
    run_ranks(_load_rank, 2, str(saved), str(tmp_path))
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == []


def test_replicated_tensors_are_written_once_and_spread_over_ranks(saved: Path) -> None:
    m = ckptkit.read_manifest(str(saved))
    norms = [fqn for fqn in m.tensors if fqn.endswith("norm.weight") and fqn.startswith("model/")]
    files = set()
    for fqn in norms:
        spec = m.tensors[fqn].shards
        assert spec.layout == "boxes" and len(spec.boxes) == 1, fqn
        files.add(spec.boxes[0].file)
    assert len(files) > 1, "every replicated tensor was written by the same rank"


def test_ranks_that_disagree_all_get_the_same_error(tmp_path: Path) -> None:
    run_ranks(_disagreeing_rank, 2, str(tmp_path / "ck"), str(tmp_path))
    results = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert results[0] == results[1]
    assert results[0].startswith("LayoutError") and "float32[4, 5]" in results[0]
    assert not (tmp_path / "ck").exists()


def _async_rank(rank: int, world: int, root: str, out: str) -> None:
    """Four ranks save every step asynchronously while all-reducing on the default group; rank 2's
    storage fails during the third save."""
    from ckptkit.writer.manager import CheckpointManager

    from .test_manager import FailingStorage

    storage = FailingStorage(root, fail_write=10**9)
    outcome = []
    with CheckpointManager(root, storage=storage, keep_last=2) as manager:
        for step in range(1, 6):
            state = rank_state(rank)
            for t in state["model"].values():
                (t.local if isinstance(t, ShardedTensor) else t).add_(step)
            if rank == 2 and step == 3:
                manager.wait()  # save 2 is committed; save 3's first write on this rank fails
                storage.fail_write = storage.writes + 1
            try:
                manager.save(step, state, topology=Topology(world_size=world, tp=2, dp=2, zero_stage=1))
                outcome.append("started")
            except ckptkit.CkptkitError as exc:
                outcome.append(f"error: {type(exc).__name__}")
            total = torch.tensor([float(step)])
            dist.all_reduce(total)  # training collectives go on while the background save runs
            assert total.item() == step * world
        try:
            manager.wait()
        except ckptkit.CkptkitError as exc:
            outcome.append(f"error: {type(exc).__name__}")
    Path(out, f"rank{rank}.json").write_text(json.dumps(outcome))


def test_async_collective_saves_commit_once_every_rank_is_durable(tmp_path: Path) -> None:
    root, out = tmp_path / "root", tmp_path / "out"
    root.mkdir()
    out.mkdir()
    run_ranks(_async_rank, 4, str(root), str(out))
    outcomes = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    # Save 3 failed on rank 2: every rank learns it at its next save, none committed it.
    assert all(o == ["started"] * 3 + ["error: StorageError"] + ["started"] for o in outcomes), outcomes
    listing = ckptkit.list_checkpoints(str(root))
    assert [e.step for e in listing.checkpoints] == [2, 5]  # keep_last=2 over the committed 1, 2, 5
    assert (root / "latest").read_text().split()[0] == "step_00000005"
    assert ckptkit.verify(str(root / "step_00000005")).ok
    loaded = ckptkit.load(str(root / "step_00000005"))
    for fqn, tensor in global_state().items():
        group, name = fqn.split("/", 1)
        if group == "model":  # the parameters each rank shifted by the step before saving
            assert torch.equal(loaded["model"][name], tensor + 5), fqn
