"""The library's reference Llama layout gives exactly the boxes the running trainer saves, for any topology."""

from __future__ import annotations

import pytest

from ckptkit.boxes import tiling_problems
from ckptkit.trainer.checkpointing import tensor_state
from ckptkit.trainer.config import model_config
from ckptkit.trainer.engine import module_params
from ckptkit.layouts import holders, rank_boxes, stage_units
from ckptkit.manifest import Topology
from ckptkit.trainer.model import Stage
from ckptkit.trainer.moe import Axis
from ckptkit.trainer.tp import TPContext
from ckptkit.trainer.zero import DPContext, Unit

def _topology(tp: int, pp: int, dp: int, zero: int) -> Topology:
    return Topology(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, zero_stage=zero)


TOPOLOGIES = [(1, 1, 1, 0), (2, 2, 2, 1), (4, 1, 2, 2), (1, 2, 4, 3), (2, 1, 3, 0)]


def _running_boxes(cfg, tp: int, pp: int, dp: int, zero: int, rank: int, cp: int = 1, ep: int = 1) -> dict:  # type: ignore[no-untyped-def]
    tp_rank, cp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)
    stage = Stage(cfg, TPContext(tp, tp_rank), pp_rank=pp_rank, pp=pp, seed=1, ep=Axis(ep, dp_rank % ep))
    experts = {id(m) for m in stage.experts}
    built = [Unit(m, module_params(m), DPContext(dp // ep, dp_rank // ep) if id(m) in experts else DPContext(dp, dp_rank), zero)
             for m in stage.param_units()]
    state = tensor_state(built)
    flat = {"model": state["model"], "optimizer/exp_avg": state["optimizer"]["exp_avg"],
            "optimizer/exp_avg_sq": state["optimizer"]["exp_avg_sq"]}
    return {k: {n: [p.box for p in ps] for n, ps in v.items()} for k, v in flat.items()}


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: "tp{}-pp{}-dp{}-z{}".format(*t))
def test_layout_matches_the_running_trainer(topology: tuple[int, int, int, int]) -> None:
    cfg = model_config("tiny", vocab_size=98)
    tp, pp, dp, zero = topology
    for rank in range(tp * pp * dp):
        assert rank_boxes(cfg.layout(), _topology(tp, pp, dp, zero), rank) == _running_boxes(cfg, tp, pp, dp, zero, rank), rank


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: "tp{}-pp{}-dp{}-z{}".format(*t))
def test_the_ranks_of_a_topology_tile_every_tensor(topology: tuple[int, int, int, int]) -> None:
    cfg = model_config("tiny", vocab_size=98)
    tp, pp, dp, zero = topology
    shapes = {p.name: p.global_shape for r in range(tp) for u in stage_units(cfg.layout(), tp, r, 1, 0) for s in u for p in s.parts}
    for key in ("model", "optimizer/exp_avg"):
        distinct: dict[str, set] = {}
        for rank in range(tp * pp * dp):
            for name, boxes in rank_boxes(cfg.layout(), _topology(tp, pp, dp, zero), rank)[key].items():
                distinct.setdefault(name, set()).update(boxes)
        assert set(distinct) == set(shapes)
        for name, boxes in distinct.items():
            assert tiling_problems(shapes[name], list(boxes)) == [], (key, name)


@pytest.mark.parametrize("topology", TOPOLOGIES + [(4, 2, 3, 1), (2, 4, 2, 3)], ids=lambda t: "tp{}-pp{}-dp{}-z{}".format(*t))
def test_topology_holders_are_the_boxes_of_every_rank_with_their_holders(topology: tuple[int, int, int, int]) -> None:
    cfg = model_config("tiny", vocab_size=98)
    tp, pp, dp, zero = topology
    want: dict[str, dict] = {}
    for rank in range(tp * pp * dp):
        for key, by_name in rank_boxes(cfg.layout(), _topology(tp, pp, dp, zero), rank).items():
            for name, boxes in by_name.items():
                for box in boxes:
                    want.setdefault(f"{key}/{name}", {}).setdefault(box, set()).add(rank)
    got = holders(cfg.layout(), _topology(tp, pp, dp, zero))
    assert {f: {b: sorted(r) for b, r in bs.items()} for f, bs in got.items()} == {
        f: {b: sorted(r) for b, r in bs.items()} for f, bs in want.items()}


# (tp, pp, dp, zero, cp, ep) of the mixture of experts
MOE = [(1, 1, 1, 0, 1, 1), (2, 1, 2, 1, 1, 2), (1, 1, 4, 1, 1, 4), (1, 2, 4, 2, 1, 2), (2, 1, 2, 3, 2, 2), (1, 1, 8, 3, 1, 4)]


def _moe_topology(tp: int, pp: int, dp: int, zero: int, cp: int, ep: int) -> Topology:
    return Topology(world_size=tp * pp * dp * cp, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, zero_stage=zero)


@pytest.mark.parametrize("topology", MOE, ids=lambda t: "tp{}-pp{}-dp{}-z{}-cp{}-ep{}".format(*t))
def test_moe_layout_matches_the_running_trainer_and_tiles_every_expert(topology: tuple[int, ...]) -> None:
    cfg = model_config("tiny-moe", vocab_size=98)
    tp, pp, dp, zero, cp, ep = topology
    t = _moe_topology(*topology)
    distinct: dict[str, set] = {}
    for rank in range(t.world_size):
        boxes = rank_boxes(cfg.layout(), t, rank)
        assert boxes == _running_boxes(cfg, tp, pp, dp, zero, rank, cp, ep), rank
        for key, by_name in boxes.items():
            for name, found in by_name.items():
                distinct.setdefault(f"{key}/{name}", set()).update(b for b in found if b.volume)
    shapes = cfg.layout().tensors()
    assert {f.split("/")[-1] for f in distinct} == set(shapes) and len(shapes) == 3 + 2 * (7 + 3 * 8)
    for fqn, boxes in distinct.items():
        assert tiling_problems(shapes[fqn.split("/")[-1]], list(boxes)) == [], fqn
    got = holders(cfg.layout(), t)
    want: dict[str, dict] = {}
    for rank in range(t.world_size):
        for key, by_name in rank_boxes(cfg.layout(), t, rank).items():
            for name, found in by_name.items():
                for box in found:
                    want.setdefault(f"{key}/{name}", {}).setdefault(box, set()).add(rank)
    assert {f: {b: sorted(r) for b, r in bs.items()} for f, bs in got.items()} == {
        f: {b: sorted(r) for b, r in bs.items()} for f, bs in want.items()}
