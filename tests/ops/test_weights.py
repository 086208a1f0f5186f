"""load_weights: a model's parameters alone, into the loading model's names and boxes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit import LayoutError, ShardedTensor
from ckptkit.layouts import builtin, reference_llama
from ckptkit.ops.weights import weight_names

LLAMA = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2)
HF = dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _hf_checkpoint(path: Path, dtype: torch.dtype = torch.bfloat16, **config: int) -> dict[str, torch.Tensor]:
    """A checkpoint holding a Hugging Face Llama under its own names (as convert writes it)."""
    layout = builtin("hf-llama", {**HF, **config})
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in layout.tensors().items()}
    ckptkit.save({"model": tensors}, path, step=7, layout=layout)
    return tensors


def test_hf_names_map_onto_the_reference_llamas() -> None:
    names = weight_names(builtin("hf-llama", HF), reference_llama(LLAMA))
    assert names["layers.1.attn.q.weight"] == "model.layers.1.self_attn.q_proj.weight"
    assert names["layers.0.mlp_norm.weight"] == "model.layers.0.post_attention_layernorm.weight"
    assert names["embed.weight"] == "model.embed_tokens.weight" and len(names) == 21
    assert weight_names(reference_llama(LLAMA), reference_llama(LLAMA))["embed.weight"] == "embed.weight"
    assert weight_names(reference_llama(LLAMA), builtin("hf-llama", HF))["model.layers.1.self_attn.q_proj.weight"] == "layers.1.attn.q.weight"
    megatron = builtin("megatron-gpt", dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2,
                                            ffn_hidden_size=24, vocab_size=40))
    with pytest.raises(LayoutError, match=r"no name map from the layout 'llama' to 'megatron-gpt': 4 tensor\(s\) are fused"):
        weight_names(reference_llama(LLAMA), megatron)  # q, k, v and gate, up fused in each of 2 layers
    with pytest.raises(LayoutError, match="no name map from the layout 'deepspeed' to 'llama'"):
        weight_names(reference_llama(LLAMA).model_copy(update={"name": "deepspeed"}), reference_llama(LLAMA))


def test_a_box_of_a_bf16_hf_weight_is_cast_into_an_fp32_target(tmp_path: Path) -> None:
    source = _hf_checkpoint(tmp_path / "ckpt")
    rows = ShardedTensor(torch.empty(8, 16), (16, 16), (8, 0))  # the second TP rank's half of q at tp 2
    norm = torch.empty(16)
    checkpoint = ckptkit.load_weights(tmp_path / "ckpt", {"layers.1.attn.q.weight": rows, "norm.weight": norm},
                                      layout=reference_llama(LLAMA))
    assert checkpoint.manifest.step == 7
    assert torch.equal(rows.local, source["model.layers.1.self_attn.q_proj.weight"][8:].float())
    assert torch.equal(norm, source["model.norm.weight"].float())


def test_another_model_is_refused_with_every_difference(tmp_path: Path) -> None:
    _hf_checkpoint(tmp_path / "ckpt", intermediate_size=32)
    with pytest.raises(LayoutError) as caught:
        ckptkit.load_weights(tmp_path / "ckpt", {"norm.weight": torch.empty(16)}, layout=reference_llama(LLAMA))
    message = str(caught.value)
    assert "its model is not the one loading it (llama): 6 difference(s)" in message
    assert "model/model.layers.0.mlp.gate_proj.weight: shape [32, 16], the model's layers.0.mlp.gate.weight is [24, 16]" in message


def test_a_parameter_the_loading_model_lacks_is_refused(tmp_path: Path) -> None:
    _hf_checkpoint(tmp_path / "ckpt")
    tied = reference_llama({**LLAMA, "tie_embeddings": True})
    with pytest.raises(LayoutError, match=r"1 difference\(s\): model/lm_head.weight: the model has no such parameter"):
        ckptkit.load_weights(tmp_path / "ckpt", {"norm.weight": torch.empty(16)}, layout=tied)


def test_without_a_layout_names_are_the_checkpoints(tmp_path: Path) -> None:
    ckptkit.save({"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"m": torch.ones(2)}}, tmp_path / "c", step=1)
    w = torch.empty(2, 3, dtype=torch.float64)
    ckptkit.load_weights(tmp_path / "c", {"w": w})
    assert torch.equal(w, torch.arange(6.0, dtype=torch.float64).reshape(2, 3))


def test_weights_saved_in_another_float_dtype_are_cast_into_parameters_a_batch_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(0)
    saved = {f"w{i}": torch.randn(4, 8, generator=g).to(torch.bfloat16) for i in range(5)}
    ckptkit.save({"model": saved}, tmp_path / "c", step=1)
    loads = []
    real = ckptkit.Checkpoint.load
    monkeypatch.setattr(ckptkit.Checkpoint, "load", lambda self, target, **kw: loads.append(sorted(target["model"])) or real(self, target, **kw))
    monkeypatch.setattr("ckptkit.ops.weights.STAGED_BYTES", 2 * 4 * 8 * 2)  # two bf16 tensors' bytes
    params = {name: torch.nn.Parameter(torch.zeros(4, 8)) for name in saved}
    ckptkit.load_weights(tmp_path / "c", params)
    assert loads == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    for name, param in params.items():
        assert torch.equal(param.detach(), saved[name].float()), name
        assert param.is_leaf and param.requires_grad and param.dtype == torch.float32
