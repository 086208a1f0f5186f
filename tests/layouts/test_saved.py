"""The boxes a topology saves of a layout, derived per rank and per tensor, against brute force."""

from __future__ import annotations

import math
import random

import pytest

from ckptkit.boxes import Box, full_box, tiling_problems
from ckptkit.layouts import Zero, rank_boxes, reference_llama, reference_llama_moe
from ckptkit.layouts.saved import Saved
from ckptkit.manifest import Topology

LLAMA = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
MOE = {**LLAMA, "num_experts": 4}


def topo(tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1, zero: int = 1) -> Topology:
    return Topology(world_size=tp * pp * dp * cp, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero_stage=zero)


CASES = [
    ("llama", topo(dp=2, zero=0)),
    ("llama", topo(tp=2, pp=2, dp=2, zero=1)),
    ("llama", topo(tp=2, dp=3, cp=2, zero=3)),
    ("llama-stage", topo(pp=2, dp=4, zero=1)),
    ("llama-param", topo(tp=2, dp=3, zero=3)),
    ("moe", topo(tp=2, dp=4, ep=2, zero=1)),
    ("moe", topo(pp=2, dp=4, ep=4, zero=0)),
    ("moe", topo(tp=2, dp=2, ep=2, zero=3)),
    ("dense-then-moe", topo(tp=2, pp=2, dp=4, ep=2, zero=1)),
]


def layout_of(name: str):
    if name == "moe":
        return reference_llama_moe(MOE)
    if name == "dense-then-moe":  # one unit name on the dense first layer and on the others (DeepSeek's form)
        dense, moe = reference_llama(LLAMA), reference_llama_moe(MOE)
        first, layer, *last = dense.units
        units = (first, layer.model_copy(update={"layers": (0,)}),
                 *(u.model_copy(update={"layers": (1, 2, 3)}) for u in moe.units if u.place == "layers"), *last)
        assert units[1].name == units[2].name
        return moe.model_copy(update={"units": units})
    layout = reference_llama(LLAMA)
    if name == "llama-stage":
        return layout.model_copy(update={"zero": Zero(flatten="stage", align=4)})
    if name == "llama-param":
        return layout.model_copy(update={"zero": Zero(flatten="param")})
    return layout


def every_write(saved: Saved) -> list[tuple[int, str, Box, str]]:
    return [(rank, w.fqn, w.box, w.key) for rank in range(saved.topology.world_size) for w in saved.writes(rank)]


@pytest.mark.parametrize(("name", "topology"), CASES)
def test_the_writes_tile_every_tensor_once_each_from_a_rank_holding_it(name: str, topology: Topology) -> None:
    layout = layout_of(name)
    saved = Saved(layout, topology)
    writes = every_write(saved)
    by_fqn: dict[str, list[Box]] = {}
    for _, fqn, box, _ in writes:
        by_fqn.setdefault(fqn, []).append(box)
    shapes = saved.shapes()
    assert set(by_fqn) == set(shapes)
    for fqn, boxes in by_fqn.items():
        assert tiling_problems(shapes[fqn], boxes) == [], fqn
        assert sum(b.volume for b in boxes) == math.prod(shapes[fqn])
    held = {rank: rank_boxes(layout, topology, rank) for rank in range(topology.world_size)}
    labels = {g.fqn(n): (g.label, n) for g in layout.states for n in layout.tensors()}
    for rank, fqn, box, _ in writes:
        label, name_ = labels[fqn]
        assert any(h.contains(box) for h in held[rank][label][name_]), (rank, fqn, box)
    keys = [(rank, key) for rank, _, _, key in writes]
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize(("name", "topology"), CASES)
def test_tensors_of_one_boxes_key_are_cut_into_the_same_boxes(name: str, topology: Topology) -> None:
    saved = Saved(layout_of(name), topology)
    boxes: dict[str, set[Box]] = {}
    for _, fqn, box, _ in every_write(saved):
        boxes.setdefault(fqn, set()).add(box)
    by_key: dict[object, list[str]] = {}
    for fqn in saved.shapes():
        by_key.setdefault(saved.boxes_key(fqn), []).append(fqn)
    assert None not in by_key and len(by_key) < len(boxes)  # some tensors share a key (the groups cut alike)
    for key, fqns in by_key.items():
        assert all(boxes[f] == boxes[fqns[0]] for f in fqns), key
    whole, sharded = ({f for f in saved.shapes() if saved.boxes_key(f)[1] == s} for s in (False, True))  # type: ignore[index]
    assert whole and sharded if 0 < topology.zero_stage < 3 else not (whole and sharded)


@pytest.mark.parametrize(("name", "topology"), CASES)
def test_a_tensor_s_boxes_and_those_meeting_a_box_are_found_without_the_other_ranks(name: str, topology: Topology) -> None:
    saved = Saved(layout_of(name), topology)
    writes = every_write(saved)
    rng = random.Random(7)
    fresh = Saved(layout_of(name), topology)  # nothing cached from the writes
    for fqn, shape in saved.shapes().items():
        mine = {(box, rank, key) for rank, f, box, key in writes if f == fqn}
        assert {(s.box, s.file, s.key) for s in fresh.overlapping(fqn, full_box(shape))} == mine
        if not shape:
            continue
        lo = [rng.randrange(n) for n in shape]
        query = Box(tuple(lo), tuple(rng.randrange(1, n - a + 1) for a, n in zip(lo, shape)))
        want = {m for m in mine if m[0].intersect(query) is not None}
        assert {(s.box, s.file, s.key) for s in fresh.overlapping(fqn, query)} == want


def test_replicated_boxes_are_dealt_so_that_replicas_write_about_the_same() -> None:
    saved = Saved(reference_llama(LLAMA), topo(dp=3, zero=0))
    written = [sum(w.box.volume for w in saved.writes(rank)) for rank in range(3)]
    largest = max(math.prod(s) for s in saved.shapes().values())
    assert max(written) - min(written) <= largest
    assert min(written) > 0


def test_names_outside_the_layout_are_not_found() -> None:
    saved = Saved(reference_llama_moe(MOE), topo(dp=2, ep=2))
    assert saved.find("model/layers.1.mlp.experts.3.gate.weight") is not None
    for fqn in ("model/layers.9.attn.q.weight", "model/layers.1.mlp.experts.4.gate.weight", "model/layers.01.attn.q.weight",
                "rng/cpu", "model/nothing", "optimizer/exp_avg/layers.0.mlp.experts.x.up.weight"):
        assert saved.find(fqn) is None, fqn
        assert saved.overlapping(fqn, Box((0,), (1,))) == []
