from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.errors import CheckpointExistsError, LayoutError, StorageError
from ckptkit.storage import MemoryStorage

from .fakes import FaultyStorage

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


def _values(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    raw = torch.arange(n, dtype=torch.int64).reshape(shape) * 7 % 251
    if dtype == torch.bool:
        return raw % 2 == 1
    return raw.to(dtype) if not dtype.is_floating_point else (raw.to(torch.float64) / 3 - 40).to(dtype)


def test_every_dtype_round_trips_bitwise(tmp_path: Path) -> None:
    state = {"model": {str(d).removeprefix("torch."): _values(d, (3, 5)) for d in DTYPES}}
    ckptkit.save(state, tmp_path / "ck", step=1)
    out = ckptkit.load(tmp_path / "ck")
    for name, t in state["model"].items():
        assert out["model"][name].dtype == t.dtype
        assert torch.equal(out["model"][name].view(torch.uint8), t.view(torch.uint8)), name


def test_scalar_empty_and_noncontiguous_tensors_round_trip(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    state = {"model": {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "t": base.t()}}
    ckptkit.save(state, tmp_path / "ck", step=1)
    out = ckptkit.load(tmp_path / "ck")["model"]
    assert out["scalar"].item() == 2.5 and out["scalar"].dim() == 0
    assert out["empty"].shape == (0, 3)
    assert torch.equal(out["t"], base.t())


def test_json_values_come_back_as_saved(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(2)}, "scheduler": {"lr": 0.25, "milestones": [1, 2]}, "note": "hi", "n": None}
    ckptkit.save(state, tmp_path / "ck", step=4)
    out = ckptkit.load(tmp_path / "ck")
    assert out["scheduler"] == {"lr": 0.25, "milestones": [1, 2]}
    assert out["note"] == "hi" and out["n"] is None


def test_tuples_are_saved_as_lists(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"betas": (0.9, 0.95), "groups": [{"pair": (1, (2, 3))}]}}
    m = ckptkit.save(state, tmp_path / "ck", step=1)
    assert m.objects["optimizer"]["betas"] == [0.9, 0.95]
    assert ckptkit.load(tmp_path / "ck")["optimizer"] == {"betas": [0.9, 0.95], "groups": [{"pair": [1, [2, 3]]}]}


def test_bytes_in_values_come_back_as_bytes(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(2)}, "data": {"sampler": b"\x00\xffstate", "nested": [b"a", {"b": b""}]}}
    m = ckptkit.save(state, tmp_path / "ck", step=1)
    assert m.objects["data"]["sampler"] == {"$bytes": "AP9zdGF0ZQ=="}  # as JSON holds them: base64
    assert ckptkit.load(tmp_path / "ck")["data"] == {"sampler": b"\x00\xffstate", "nested": [b"a", {"b": b""}]}


def test_keys_with_slashes_and_tildes_round_trip(tmp_path: Path) -> None:
    state = {"model": {"a/b": torch.ones(1), "c~d": torch.zeros(1)}}
    m = ckptkit.save(state, tmp_path / "ck", step=1)
    assert set(m.tensors) == {"model/a~1b", "model/c~0d"}
    out = ckptkit.load(tmp_path / "ck")
    assert set(out["model"]) == {"a/b", "c~d"}


def test_boxes_of_one_tensor_are_saved_as_the_global_tensor(tmp_path: Path) -> None:
    g = torch.arange(48.0).reshape(6, 8)
    pieces = [ShardedTensor(g[:, :3].clone(), (6, 8), (0, 0)), ShardedTensor(g[:, 3:].clone(), (6, 8), (0, 3))]
    m = ckptkit.save({"model": {"w": pieces}}, tmp_path / "ck", step=1)
    assert m.tensors["model/w"].shape == (6, 8)
    assert torch.equal(ckptkit.load(tmp_path / "ck")["model"]["w"], g)


def test_overlapping_boxes_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    g = torch.zeros(4, 4)
    pieces = [ShardedTensor(g[:3], (4, 4), (0, 0)), ShardedTensor(g[2:], (4, 4), (2, 0))]
    with pytest.raises(LayoutError, match="overlap"):
        ckptkit.save({"model": {"w": pieces}}, tmp_path / "ck", step=1)
    assert not (tmp_path / "ck").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_gap_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="gap: 4 of 16"):
        ckptkit.save({"model": {"w": [ShardedTensor(torch.zeros(3, 4), (4, 4), (0, 0))]}}, tmp_path / "ck", step=1)


@pytest.mark.parametrize("value", [float("nan"), object(), {1: "int key"}])
def test_non_json_values_are_refused(tmp_path: Path, value: object) -> None:
    with pytest.raises(LayoutError):
        ckptkit.save({"model": {"w": torch.ones(1)}, "bad": value}, tmp_path / "ck", step=1)
    assert not (tmp_path / "ck").exists()


def test_existing_checkpoint_is_never_overwritten(tmp_path: Path) -> None:
    ckptkit.save({"model": {"w": torch.ones(3)}}, tmp_path / "ck", step=1)
    before = (tmp_path / "ck" / "manifest.json").read_bytes()
    with pytest.raises(CheckpointExistsError):
        ckptkit.save({"model": {"w": torch.zeros(3)}}, tmp_path / "ck", step=2)
    assert (tmp_path / "ck" / "manifest.json").read_bytes() == before
    assert torch.equal(ckptkit.load(tmp_path / "ck")["model"]["w"], torch.ones(3))


def test_latest_pointer_follows_the_newest_commit(tmp_path: Path) -> None:
    for step in (1, 2):
        ckptkit.save({"model": {"w": torch.full((2,), float(step))}}, tmp_path / f"step_{step}", step=step)
    assert (tmp_path / "latest").read_text().split()[0] == "step_2"
    assert ckptkit.load(tmp_path)["model"]["w"].tolist() == [2.0, 2.0]


def test_failed_write_commits_nothing_and_keeps_the_previous_checkpoint() -> None:
    store = FaultyStorage(fail_write=5)  # 1: step_1 payload, 2: its block digests, 3: manifest, 4: latest, 5: step_2 payload
    ckptkit.save({"model": {"w": torch.ones(4)}}, "step_1", step=1, storage=store)
    with pytest.raises(StorageError, match="No space left"):
        ckptkit.save({"model": {"w": torch.zeros(4)}}, "step_2", step=2, storage=store)
    assert store.list("", recursive=False) == ["latest", "step_1/"]
    assert store.read("latest").split()[0] == b"step_1"
    assert ckptkit.verify("step_1", storage=store).ok
    assert torch.equal(ckptkit.load("latest", storage=store)["model"]["w"], torch.ones(4))


@pytest.mark.parametrize("fail_write", [2, 3], ids=["block digests", "manifest"])  # 1: the payload
def test_manifest_write_failure_leaves_no_committed_checkpoint(fail_write: int) -> None:
    store = FaultyStorage(fail_write=fail_write)
    with pytest.raises(StorageError):
        ckptkit.save({"model": {"w": torch.ones(4)}}, "step_1", step=1, storage=store)
    assert store.list("") == []


def test_files_split_at_max_file_bytes(tmp_path: Path) -> None:
    state = {"model": {f"w{i}": torch.full((256,), float(i)) for i in range(4)}}  # 1 KiB each
    m = ckptkit.save(state, tmp_path / "ck", step=1, max_file_bytes=2048)
    assert [f.path for f in m.files] == ["rank00000-000.safetensors", "rank00000-001.safetensors"]
    out = ckptkit.load(tmp_path / "ck")
    assert all(torch.equal(out["model"][k], v) for k, v in state["model"].items())


def test_kinds_follow_top_level_keys_and_overrides(tmp_path: Path) -> None:
    state = {
        "model": {"w": torch.ones(1), "rope": {"inv_freq": torch.ones(1)}},
        "optimizer": {"exp_avg": {"w": torch.ones(1)}},
        "rng": {"cpu": torch.zeros(4, dtype=torch.uint8)},
        "misc": {"x": torch.ones(1)},
    }
    m = ckptkit.save(state, tmp_path / "ck", step=1, kinds={"model/rope": "buffer"})
    assert {k: t.kind for k, t in m.tensors.items()} == {
        "misc/x": "other",
        "model/rope/inv_freq": "buffer",
        "model/w": "param",
        "optimizer/exp_avg/w": "optimizer",
        "rng/cpu": "rng",
    }


def test_tokenizer_files_are_stored_and_hashed(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    (tok / "sub").mkdir(parents=True)
    (tok / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0}}))
    (tok / "sub" / "merges.txt").write_text("a b\n")
    m = ckptkit.save({"model": {"w": torch.ones(1)}}, tmp_path / "ck", step=1, tokenizer=tok)
    assert m.tokenizer is not None and m.tokenizer.files == ("tokenizer/sub/merges.txt", "tokenizer/tokenizer.json")
    assert (tmp_path / "ck" / "tokenizer" / "sub" / "merges.txt").read_text() == "a b\n"
    assert ckptkit.verify(str(tmp_path / "ck")).ok


def test_payloads_are_plain_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    g = torch.arange(10, dtype=torch.bfloat16)
    ckptkit.save({"model": {"w": g}}, tmp_path / "ck", step=1)
    loaded = load_file(str(tmp_path / "ck" / "rank00000.safetensors"))
    assert torch.equal(loaded["model/w"], g)


def test_topology_must_match_the_saving_ranks(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="does not match 1 saving rank"):
        ckptkit.save({"model": {"w": torch.ones(1)}}, tmp_path / "ck", step=1, topology=ckptkit.Topology(world_size=2, dp=2))


def test_in_memory_storage_holds_a_whole_checkpoint() -> None:
    store = MemoryStorage()
    ckptkit.save({"model": {"w": torch.arange(5)}}, "ck", step=3, storage=store)
    assert store.list("ck") == ["ck/manifest.json", "ck/rank00000.safetensors", "ck/rank00000.safetensors.blocks"]
    assert ckptkit.load("ck", storage=store)["model"]["w"].tolist() == [0, 1, 2, 3, 4]
