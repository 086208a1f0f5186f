"""The built-in layouts name and shape tensors as the real models do, and their boxes tile every tensor."""

from __future__ import annotations

import pytest
import torch
import transformers

from ckptkit.boxes import Box, tiling_problems
from ckptkit.layouts import builtin, holders, rank_boxes, stage_units, topology_problems
from ckptkit.manifest import Topology

GPT2 = dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=64)
LLAMA = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4)


def _topology(tp: int, pp: int, dp: int, zero: int) -> Topology:
    return Topology(world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, zero_stage=zero)


def _state_dict_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_gpt2_layout_has_the_tensors_of_a_real_gpt2_model() -> None:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    shapes = _state_dict_shapes(model)
    tensors = builtin("gpt2", GPT2).tensors()
    assert {k: v for k, v in shapes.items() if k in tensors} == tensors
    assert set(shapes) - set(tensors) == {"lm_head.weight"}  # tied to transformer.wte.weight


@pytest.mark.parametrize("architecture,bias", [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)])
def test_hf_llama_layout_has_the_tensors_of_real_llama_and_qwen2_models(architecture: str, bias: bool) -> None:
    config_class = transformers.LlamaConfig if architecture == "LlamaForCausalLM" else transformers.Qwen2Config
    model = getattr(transformers, architecture)(config_class(**LLAMA))
    shapes = _state_dict_shapes(model)
    layout = builtin("hf-llama", dict(LLAMA, model_type=config_class.model_type))
    assert layout.tensors() == {k: v for k, v in shapes.items() if "rotary" not in k}
    assert any(name.endswith("q_proj.bias") for name in layout.tensors()) == bias


TOPOLOGIES = [(1, 1, 1, 0), (2, 1, 2, 1), (4, 1, 1, 3), (2, 2, 2, 2), (1, 2, 3, 3)]


@pytest.mark.parametrize("family,config", [("gpt2", GPT2), ("hf-llama", LLAMA), ("llama", dict(
    vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=4))])
@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: "tp{}-pp{}-dp{}-z{}".format(*t))
def test_the_ranks_of_every_topology_tile_every_tensor(family: str, config: dict, topology: tuple[int, ...]) -> None:
    layout = builtin(family, config)
    t = _topology(*topology)
    if topology_problems(layout, t):
        assert family == "gpt2" and t.pp > 1  # the tied head needs pp 1
        return
    tensors = layout.tensors()
    found = holders(layout, t)
    assert set(found) == {f"{g}/{n}" for g in ("model", "optimizer/exp_avg", "optimizer/exp_avg_sq") for n in tensors}
    for fqn, boxes in found.items():
        assert tiling_problems(tensors[fqn.split("/")[-1]], list(boxes)) == [], fqn
    by_rank: dict[str, set[Box]] = {}
    for rank in range(t.world_size):
        for group, named in rank_boxes(layout, t, rank).items():
            for name, bs in named.items():
                by_rank.setdefault(f"{group}/{name}", set()).update(b for b in bs if b.volume)
    assert by_rank == {fqn: set(boxes) for fqn, boxes in found.items()}


def test_gpt2_c_attn_is_cut_per_q_k_v_partition_along_dim_1() -> None:
    layout = builtin("gpt2", GPT2)
    (spec,) = [s for unit in stage_units(layout, 2, 1, 1, 0) for s in unit if s.name == "attn.c_attn.weight"][:1]
    assert spec.shape == (32, 48)  # [in, 3 x 32 / tp]
    assert [(p.offsets, p.lengths, p.row0) for p in spec.parts] == [((0, 16), (32, 16), 0), ((0, 48), (32, 16), 16),
                                                                    ((0, 80), (32, 16), 32)]
    boxes = rank_boxes(layout, _topology(2, 1, 1, 0), 1)["model"]["transformer.h.0.attn.c_attn.weight"]
    assert sorted(boxes, key=lambda b: b.offsets) == [Box((0, 16), (32, 16)), Box((0, 48), (32, 16)), Box((0, 80), (32, 16))]


def test_fused_qkv_interleaved_per_group_as_megatron_stores_it() -> None:
    from ckptkit.layouts import Layout, Param, TensorPart, TPCut, Unit

    heads, groups, hd, h = 4, 2, 2, 8  # 2 query heads per key/value head
    qkv = Param(name="qkv", tp=TPCut(dim=0, groups=groups), parts=(
        TensorPart(tensor="q", shape=(heads * hd, h)), TensorPart(tensor="k", shape=(groups * hd, h)),
        TensorPart(tensor="v", shape=(groups * hd, h))))
    layout = Layout(name="megatron-qkv", units=(Unit(name="attn", place="first", params=(qkv,)),))
    (spec,) = stage_units(layout, 1, 0, 1, 0)[0]
    # Group 0's q rows, k rows and v rows, then group 1's.
    assert [(p.name, p.offsets[0], p.lengths[0], p.row0) for p in spec.parts] == [
        ("q", 0, 4, 0), ("k", 0, 2, 4), ("v", 0, 2, 6), ("q", 4, 4, 8), ("k", 2, 2, 12), ("v", 2, 2, 14)]
    (spec,) = stage_units(layout, 2, 1, 1, 0)[0]
    assert spec.shape == (8, h) and [(p.name, p.offsets[0]) for p in spec.parts] == [("q", 4), ("k", 2), ("v", 2)]
    assert "2 groups" in topology_problems(layout, _topology(4, 1, 1, 0))[0]
