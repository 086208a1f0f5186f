"""Layout documents: every mistake is found and listed; sound documents round-trip through JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ckptkit.errors import LayoutError
from ckptkit.layouts import builtin, layout_json_schema, layout_problems, parse_layout, reference_llama

LLAMA = dict(vocab_size=98, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=4)


def test_a_layout_round_trips_through_json_and_matches_the_published_schema() -> None:
    for layout in (reference_llama(LLAMA), builtin("gpt2", dict(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=8))):
        doc = layout.to_json()
        jsonschema.validate(doc, layout_json_schema())
        assert parse_layout(json.dumps(doc)) == layout and layout_problems(doc) == []


def _mistaken() -> dict:
    doc = reference_llama(LLAMA).to_json()
    layer = doc["units"][1]
    layer["params"][1]["tp"]["dim"] = 2  # attn.qkv.weight: dim out of range
    layer["params"][4]["parts"][0]["length"] = 100  # mlp.gate: its partitions no longer add up to 128 rows
    return doc


def test_every_mistake_is_listed_once() -> None:
    problems = layout_problems(_mistaken())
    assert problems == [
        "unit 'layers.{layer}' param 'attn.qkv.weight': dim 2 is out of range for 'layers.{layer}.attn.q.weight' of shape [64, 64]",
        "unit 'layers.{layer}' param 'attn.qkv.weight': dim 2 is out of range for 'layers.{layer}.attn.k.weight' of shape [32, 64]",
        "unit 'layers.{layer}' param 'attn.qkv.weight': dim 2 is out of range for 'layers.{layer}.attn.v.weight' of shape [32, 64]",
        "tensor 'layers.{layer}.mlp.gate.weight': its partitions along dim 0 add up to 100, not its size 128",
    ]
    with pytest.raises(LayoutError, match=r"(?s)my.json: 4 problem\(s\) in the layout:\n  unit .*\n  tensor 'layers"):
        parse_layout(_mistaken(), source="my.json")


@pytest.mark.parametrize("edit,problem", [
    (lambda d: d.update(format="other"), "format is 'other', expected 'ckptkit-layout'"),
    (lambda d: d.update(schema_version="2.0"), "schema version 2.0 is not read by this ckptkit (it reads 1.x)"),
    (lambda d: d.update(mesh=["tp", "dp", "dp", "pp"]), "mesh ['tp', 'dp', 'dp', 'pp'] must order each of tp, cp, dp, pp once"),
    (lambda d: d["units"][0].update(place="layers"), "unit 'embed': a per-layer unit's name must contain {layer}"),
    (lambda d: d["units"][1]["params"][1]["parts"][1].update(shape=[32, 60]),
     "unit 'layers.{layer}' param 'attn.qkv.weight': fused parts differ outside dim 0: [[60], [64]]"),
    (lambda d: d["units"][1]["params"].append(d["units"][1]["params"][0]),
     "unit 'layers.{layer}' param 'attn_norm.weight': listed twice"),
    (lambda d: d.update(zero={"flatten": "rows"}), "zero.flatten: Input should be 'unit', 'stage' or 'param'"),
    (lambda d: d["units"][0].update(layers=[0]), "unit 'embed': only per-layer units (place 'layers') may list layers"),
    (lambda d: d["units"][1].update(layers=[2, 1]), "unit 'layers.{layer}': its layers [2, 1] must be in increasing order, each once"),
    (lambda d: d["units"][1].update(layers=[3, 4, 7]), "unit 'layers.{layer}': layers [4, 7] are not layers of the model's 4"),
    (lambda d: (d["units"][1].update(layers=[0, 1]), d["units"].insert(2, dict(d["units"][1], layers=[1, 2, 3]))),
     "unit 'layers.{layer}' param 'attn_norm.weight': listed twice"),
])
def test_each_kind_of_mistake_is_named(edit, problem: str) -> None:  # type: ignore[no-untyped-def]
    doc = reference_llama(LLAMA).to_json()
    edit(doc)
    assert problem in layout_problems(doc)


def test_units_of_one_name_on_disjoint_layers_describe_one_module_each() -> None:
    doc = reference_llama(LLAMA).to_json()
    dense = dict(doc["units"][1], layers=[0, 1])
    other = dict(doc["units"][1], layers=[2, 3], params=doc["units"][1]["params"][:3])  # attention only
    doc["units"][1:2] = [dense, other]
    layout = parse_layout(doc)
    names = layout.tensors()
    assert "layers.1.mlp.down.weight" in names and "layers.2.mlp.down.weight" not in names
    assert "layers.3.attn.q.weight" in names and layout.unit_layers(layout.units[2]) == (2, 3)


def test_not_json_is_one_problem() -> None:
    assert layout_problems(b"{oops")[0].startswith("not valid JSON")


MOE = dict(LLAMA, num_layers=2, intermediate_size=64, num_experts=8)


def test_expert_units_are_checked_and_expand_per_expert() -> None:
    from ckptkit.layouts import reference_llama_moe

    layout = reference_llama_moe(MOE)
    assert layout.experts == 8 and layout_problems(layout.to_json()) == []
    assert "layers.1.mlp.experts.7.down.weight" in layout.tensors()
    doc = layout.to_json()
    doc["units"][2]["params"][0]["parts"][0]["tensor"] = "layers.{layer}.mlp.gate.weight"  # no {expert} in an expert unit
    doc["units"][0]["experts"] = 2  # experts outside the layers
    problems = layout_problems(doc)
    assert problems == [
        "expert units hold different numbers of experts (2, 8); they must hold the same",
        "unit 'embed': only per-layer units (place 'layers') may hold experts",
        "unit 'embed' param 'weight': tensor 'embed.weight' must contain {expert} (its unit holds experts)",
        "unit 'layers.{layer}.experts' param '{expert}.gate_up.weight': tensor 'layers.{layer}.mlp.gate.weight' must "
        "contain {expert} (its unit holds experts)",
    ]


def test_ep_is_refused_where_the_layout_cannot_hold_it() -> None:
    from ckptkit.layouts import reference_llama_moe, topology_problems
    from ckptkit.manifest import Topology

    moe, dense = reference_llama_moe(MOE), reference_llama(LLAMA)
    assert topology_problems(moe, Topology(world_size=4, dp=4, ep=4)) == []
    assert topology_problems(moe, Topology(world_size=6, dp=6, ep=3)) == ["8 experts are not divisible by ep 3"]
    assert topology_problems(moe, Topology(world_size=2, dp=2, ep=4)) == [
        "ep 4 does not divide dp 2 (expert-parallel ranks are carved out of the data-parallel ranks)"]
    assert topology_problems(dense, Topology(world_size=2, dp=2, ep=2)) == ["the llama layout has no experts (ep must be 1)"]
