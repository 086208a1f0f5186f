"""The reference trainer over real gloo ranks: parallel correctness and exact resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptkit.ops.diff import diff
from ckptkit.errors import LayoutError
from ckptkit.trainer.train import config_from, prepare

from .runs import save_events, train

pytestmark = pytest.mark.multiprocess

REFERENCE = (1, 1, 1, 0)
PARALLEL = [(2, 1, 1, 0), (1, 2, 1, 0), (1, 1, 2, 1), (1, 1, 2, 2), (1, 1, 2, 3), (2, 2, 2, 1)]
RESUMABLE = [(1, 1, 2, 0), (1, 1, 2, 1), (1, 1, 2, 2), (1, 1, 2, 3), (2, 2, 2, 1)]
STEPS = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each topology trained once for STEPS steps, saving at 4, 8 and 10 (cached for the module)."""
    return {"root": tmp_path_factory.mktemp("train"), "logs": {}}


def _trained(runs: dict, combo: tuple[int, int, int, int]) -> tuple[Path, list[dict]]:
    out = runs["root"] / "run-{}{}{}{}".format(*combo)
    if combo not in runs["logs"]:
        runs["logs"][combo] = train(out, combo, STEPS)
    return out, runs["logs"][combo]


@pytest.mark.parametrize("combo", PARALLEL, ids=lambda c: "tp{}-pp{}-dp{}-z{}".format(*c))
def test_every_topology_computes_the_same_losses(runs: dict, combo: tuple[int, int, int, int]) -> None:
    _, ref = _trained(runs, REFERENCE)
    _, got = _trained(runs, combo)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert abs(got[0]["loss"] - ref[0]["loss"]) <= 1e-5 * abs(ref[0]["loss"])
    for a, b in zip(got, ref):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
        assert a["sample_ids"] == b["sample_ids"]


@pytest.mark.parametrize("combo", RESUMABLE, ids=lambda c: "tp{}-pp{}-dp{}-z{}".format(*c))
def test_resume_is_bitwise_exact(runs: dict, combo: tuple[int, int, int, int], tmp_path: Path) -> None:
    out, full = _trained(runs, combo)
    resumed = train(tmp_path / "resumed", combo, 8, resume=str(out / "step_00000004"))
    assert [r["step"] for r in resumed] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[4:8]]
    assert [r["sample_ids"] for r in resumed] == [r["sample_ids"] for r in full[4:8]]
    report = diff(out / "step_00000008", tmp_path / "resumed" / "step_00000008", kinds=("param", "optimizer", "rng"))
    assert report.ok, report.differences[:3]
    assert report.tensors > 0


def test_checkpoint_holds_every_asset(runs: dict) -> None:
    import ckptkit

    out, _ = _trained(runs, (2, 2, 2, 1))
    m = ckptkit.read_manifest(str(out / "step_00000008"))
    assert m.topology.model_dump(include={"world_size", "tp", "pp", "dp", "zero_stage"}) == {
        "world_size": 8, "tp": 2, "pp": 2, "dp": 2, "zero_stage": 1}
    kinds = {t.kind for t in m.tensors.values()}
    assert kinds == {"param", "optimizer", "rng"}
    assert "model/layers.3.attn.q.weight" in m.tensors and "model/lm_head.weight" in m.tensors
    assert m.tensors["model/embed.weight"].shape[0] == 98  # logical vocabulary, not padded
    assert m.info.optimizer is not None and m.info.optimizer.step == 8
    assert m.info.data_progress is not None and m.info.data_progress.consumed_samples == 64
    assert m.info.model is not None and m.info.model.family == "llama"
    assert m.tokenizer is not None and m.tokenizer.files == ("tokenizer/tokenizer.json",)
    assert ckptkit.verify(str(out / "step_00000008")).ok


def test_impossible_topology_fails_before_any_process_starts(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="attention heads are not divisible by tp 3.*layers are not divisible by pp 3"):
        prepare(config_from(tp=3, pp=3, out=str(tmp_path)))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("combo", [(1, 1, 4, 3), (4, 1, 2, 2)], ids=lambda c: "tp{}-pp{}-dp{}-z{}".format(*c))
def test_resume_at_another_topology_continues_the_sametrain(runs: dict, combo: tuple[int, int, int, int], tmp_path: Path) -> None:

    import ckptkit

    source, full = _trained(runs, (2, 2, 2, 1))
    resumed = train(tmp_path / "resumed", combo, 8, resume=str(source / "step_00000004"))
    for got, want in zip(resumed, full[4:8]):
        assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (got["step"], got["loss"], want["loss"])
    seen = [i for r in full[:4] + resumed for i in r["sample_ids"]]
    assert [r["sample_ids"] for r in resumed] == [r["sample_ids"] for r in full[4:8]]
    assert len(seen) == len(set(seen)) == 8 * 8  # the corpus has thousands of samples: none may repeat
    rng = ckptkit.load(str(tmp_path / "resumed" / "step_00000008"))["rng"]["torch_cpu"]
    rows = {bytes(rng[r].numpy()) for r in range(rng.shape[0])}
    assert rng.shape[0] == combo[0] * combo[1] * combo[2] and len(rows) == rng.shape[0], "two ranks share an RNG stream"


def test_async_and_sync_saves_write_the_same_checkpoints_and_log_their_stalls(runs: dict, tmp_path: Path) -> None:
    combo = (1, 1, 2, 1)
    out, logs = _trained(runs, combo)  # saved in the background (the default)
    sync_logs = train(tmp_path / "sync", combo, STEPS, sync_save=True)
    assert [r["loss"] for r in sync_logs] == [r["loss"] for r in logs]
    for step in (4, 8, 10):
        name = f"step_{step:08d}"
        same = diff(str(out / name), str(tmp_path / "sync" / name), kinds=("param", "optimizer", "rng", "other"))
        assert same.ok, name
    for run, sync in ((out, False), (tmp_path / "sync", True)):
        events = save_events(run)
        assert [e["step"] for e in events] == [4, 8, 10] and all(e["sync"] is sync for e in events)
        assert all(e["stall_s"] > 0 and e["background_s"] > 0 for e in events)
