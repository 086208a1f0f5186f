"""Every architecture with a canonical model, as transformers itself makes and saves it: the
layout derived from its config.json places each saved tensor with its shape, and convert,
reshard to tp 2 x pp 2 (MoE: x ep 2; a tied head: pp 1), export --format hf gives back the
same tensors, bitwise, and transformers' logits of the original model; no layout is named."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import ckptkit
from ckptkit.layouts import fit_problems, parse_layout, topology_problems
from ckptkit.manifest import Topology
from ckptkit.models import READERS, spec_from_config
from ckptkit_adapters.hf.view import hf_layout

transformers = pytest.importorskip("transformers")

# Non-square everywhere: hidden 48, intermediate 80, 4 heads of 16 (64 != 48), 2 key/value
# heads, a vocabulary of 101 (odd, so tp pads it), experts of 24 with distinct values.
BASE = dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=None)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=24)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": BASE,
    "llama-tied": dict(BASE, tie_word_embeddings=True),
    "mistral": BASE,
    "qwen2": BASE,
    "qwen3": BASE,
    "gemma": BASE,
    "gemma2": BASE,
    "olmo": BASE,
    "olmo2": BASE,
    "phi3": dict({k: v for k, v in BASE.items() if k != "head_dim"}, hidden_size=56, num_attention_heads=4),  # heads of 14
    "mixtral": dict(BASE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(BASE, **MOE, num_experts=4, shared_expert_intermediate_size=40, mlp_only_layers=[1]),
    "qwen3_moe": dict(BASE, **MOE, num_experts=4),
    "deepseek_v3": dict(BASE, **MOE, head_dim=8, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, n_group=1, topk_group=1),
    "gpt_neox": dict(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
                     max_position_embeddings=64, bos_token_id=0, eos_token_id=1),
    "gpt2": dict(vocab_size=101, n_embd=48, n_inner=80, n_layer=4, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1),
}


def _model(name: str, dtype: torch.dtype) -> Any:
    config = transformers.AutoConfig.for_model(name.removesuffix("-tied"), **CONFIGS[name])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms and biases start at constants: make every tensor distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype).eval()


def _saved(name: str, dtype: torch.dtype, tmp_path: Path) -> tuple[Path, Any]:
    model = _model(name, dtype)
    path = tmp_path / name
    model.save_pretrained(path, max_shard_size="200KB")
    return path, model


def test_every_model_type_of_the_architectures_has_a_canonical_model() -> None:
    assert {n.removesuffix("-tied") for n in CONFIGS} <= set(READERS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_derived_layout_places_every_saved_tensor_with_its_shape(name: str, tmp_path: Path) -> None:
    path, model = _saved(name, torch.float32, tmp_path)
    config = json.loads((path / "config.json").read_text())
    layout = hf_layout(config)
    shapes = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            shapes.update({f"model/{k}": tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    assert fit_problems(layout, shapes) == []
    assert set(shapes) == {f"model/{n}" for n in layout.tensors()}
    spec = spec_from_config(config)  # its canonical tensors are the saved ones, unfused: as many elements
    assert sum(math.prod(s) for s in spec.tensors().values()) == sum(math.prod(s) for s in shapes.values())
    assert spec.tied == ("lm_head.weight" not in model.state_dict() or
                                             model.lm_head.weight is model.get_input_embeddings().weight)


def _target(layout: ckptkit.Layout) -> Topology:
    """tp 2 x pp 2 (x ep 2 over dp 2 for experts), pp 1 where the head is tied."""
    ep = 2 if layout.experts else 1
    pp = 1 if topology_problems(layout, Topology(world_size=2 * 2 * ep, tp=2, pp=2, dp=ep, ep=ep)) else 2
    return Topology(world_size=2 * pp * ep, tp=2, pp=pp, dp=ep, ep=ep, zero_stage=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_convert_reshard_export_gives_the_same_tensors_and_logits(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    src, original = _saved(name, dtype, tmp_path)
    converted, resharded, out = tmp_path / "converted", tmp_path / "resharded", tmp_path / "exported"
    ckptkit.convert(src, converted)
    manifest = ckptkit.read_manifest(converted)
    assert manifest.layout is not None and manifest.layout["name"] == f"hf-{name.removesuffix('-tied')}"
    target = _target(parse_layout(dict(manifest.layout)))
    ckptkit.reshard(converted, resharded, target, update_latest=False)
    got = ckptkit.read_manifest(resharded).topology
    assert (got.tp, got.pp, got.ep, got.world_size) == (target.tp, target.pp, target.ep, target.world_size)
    assert target.pp == 2 or "tied" in name or name in ("gemma", "gemma2", "gpt2")
    ckptkit.export(resharded, out, format="hf", dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype])
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()  # the original, as its users load it
    want, have = loaded.state_dict(), exported.state_dict()
    assert sorted(have) == sorted(want) == sorted(original.state_dict())
    assert [k for k in want if have[k].dtype != want[k].dtype or not torch.equal(have[k], want[k])] == []
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = exported(ids).logits.float(), loaded(ids).logits.float()
    assert (a - b).abs().max().item() <= 1e-5
