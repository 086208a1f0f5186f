"""64 gloo ranks save a layout's state, each loads its own boxes back: a manifest that lists
neither the files nor the layout's tensors, and each rank reading only the files that hold its boxes."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.layouts import rank_boxes, reference_llama
from ckptkit.layouts.saved import Saved
from ckptkit.manifest import Topology
from ckptkit.storage import LocalStorage
from ckptkit.trainer.launch import run_ranks

pytestmark = pytest.mark.multiprocess

LAYOUT = reference_llama({"vocab_size": 40, "hidden_size": 8, "intermediate_size": 16, "num_layers": 2, "num_heads": 2,
                          "num_kv_heads": 2})
TOPOLOGY = Topology(world_size=64, tp=2, pp=2, dp=16, zero_stage=1)
DTYPES = {"model": torch.bfloat16, "optimizer/exp_avg": torch.float32, "optimizer/exp_avg_sq": torch.float32}


def _whole(fqn: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    seed = zlib.crc32(fqn.encode())
    return (torch.arange(int(torch.tensor(shape).prod().item()) if shape else 1, dtype=torch.float64) * 0.37 + seed % 101).reshape(
        tuple(shape)).to(dtype)


def _state(rank: int, blank: bool) -> dict:
    shapes = LAYOUT.tensors()
    state: dict = {}
    for group in LAYOUT.states:
        for name, boxes in rank_boxes(LAYOUT, TOPOLOGY, rank)[group.label].items():
            whole = _whole(group.fqn(name), shapes[name], DTYPES[group.label])
            pieces = [ShardedTensor(torch.zeros_like(whole[b.slices()]) if blank else whole[b.slices()].clone(), shapes[name], b.offsets)
                      for b in boxes if b.volume]
            node = state
            for part in group.prefix.split("/"):
                node = node.setdefault(part, {})
            node[name] = pieces if len(pieces) > 1 else pieces[0]
    state["rng"] = {"cpu": ShardedTensor(torch.full((1, 4), 0 if blank else rank, dtype=torch.uint8), (64, 4), (rank, 0))}
    return state


class Counting(LocalStorage):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.read_from: set[str] = set()

    def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        super().readv(key, offset, buffers)
        self.read_from.add(key)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        self.read_from.add(key)
        return super().read(key, offset, length)


def _job(rank: int, world: int, root: str, out: str) -> None:
    ckptkit.save(_state(rank, blank=False), f"{root}/step_1", step=1, topology=TOPOLOGY, layout=LAYOUT)
    storage = Counting(root)
    target = _state(rank, blank=True)
    ckptkit.load("step_1", target, storage=storage)
    want = _state(rank, blank=False)
    flat_got, flat_want = _leaves(target), _leaves(want)
    wrong = [k for k in flat_want if not all(torch.equal(a.local, b.local) for a, b in zip(flat_got[k], flat_want[k]))]
    payloads = sorted(k.split("/")[-1] for k in storage.read_from if k.endswith(".safetensors"))
    Path(out, f"{rank}.json").write_text(json.dumps({"wrong": wrong, "read": payloads}))


def _leaves(state: dict, prefix: str = "") -> dict[str, list[ShardedTensor]]:
    out: dict[str, list[ShardedTensor]] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = value if isinstance(value, list) else [value]
    return out


def test_sixty_four_ranks_save_a_described_checkpoint_and_each_reads_only_the_files_of_its_boxes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_job, 64, str(tmp_path), str(out))
    doc = json.loads((tmp_path / "step_1" / "manifest.json").read_text())
    assert doc["schema_version"] == "1.6" and doc["file_table"]["count"] == 64 and doc["files"] == []
    assert list(doc["tensors"]) == ["rng/cpu"] and set(doc["derived"]["groups"]) == set(DTYPES)
    assert len((tmp_path / "step_1" / "manifest.json").read_bytes()) < 12_000
    assert ckptkit.verify(str(tmp_path / "step_1")).ok
    # Which files hold a box meeting each rank's boxes, found from every rank's writes (not the rank's own plan).
    saved = Saved(LAYOUT, TOPOLOGY)
    writes = [(r, w) for r in range(64) for w in saved.writes(r)]
    for rank in range(64):
        result = json.loads((out / f"{rank}.json").read_text())
        assert result["wrong"] == [], rank
        mine = [(g.fqn(n), b) for g in LAYOUT.states for n, bs in rank_boxes(LAYOUT, TOPOLOGY, rank)[g.label].items() for b in bs]
        holding = {r for r, w in writes for fqn, b in mine if w.fqn == fqn and w.box.intersect(b) is not None} | {rank}
        assert result["read"] == sorted(f"rank{r:05d}.safetensors" for r in holding), rank
