"""ckptkit inspect: the model's shape and every tensor with how it is cut, in text and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.schemas import cli_schema_path
from ckptkit import CheckpointInfo, ModelInfo, ShardedTensor
from ckptkit.cli import cli
from ckptkit.ops.inspect import model_summary

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / cli_schema_path("inspect")
CONFIG = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """w: two row halves (a 2 x 1 grid); z: three flat ranges (boxes, no grid); b: whole."""
    w = torch.arange(24.0).reshape(6, 4)
    z = torch.arange(12.0).reshape(3, 4)
    state = {
        "model": {
            "w": [ShardedTensor(w[:3].clone(), (6, 4), (0, 0)), ShardedTensor(w[3:].clone(), (6, 4), (3, 0))],
            "b": torch.ones(4, dtype=torch.bfloat16),
        },
        "optimizer": {"z": [ShardedTensor(z[:1].clone(), (3, 4), (0, 0)), ShardedTensor(z[1:2, :2].clone(), (3, 4), (1, 0)),
                            ShardedTensor(z[1:2, 2:].clone(), (3, 4), (1, 2)), ShardedTensor(z[2:].clone(), (3, 4), (2, 0))]},
    }
    info = CheckpointInfo(model=ModelInfo(family="llama", config=CONFIG))
    ckptkit.save(state, tmp_path / "c", step=3, info=info)
    return tmp_path / "c"


def test_inspect_reports_the_model_shape(checkpoint: Path) -> None:
    model = ckptkit.inspect(checkpoint).model
    assert model is not None
    assert (model.family, model.layers, model.hidden_size, model.heads, model.kv_heads, model.vocab_size) == ("llama", 4, 64, 8, 4, 128)
    result = CliRunner().invoke(cli, ["inspect", str(checkpoint)])
    assert "model       llama: 4 layers, hidden 64, 8 heads (4 kv), vocabulary 128, intermediate 128" in result.stdout.splitlines()


def test_inspect_lists_every_tensor_with_shape_dtype_kind_bytes_and_cut(checkpoint: Path) -> None:
    listed = {t.name: (t.shape, t.dtype, t.kind, t.bytes, t.shards, t.grid, t.cut) for t in ckptkit.inspect(checkpoint).tensor_list}
    assert listed == {
        "model/b": ([4], "bfloat16", "param", 8, 1, [1], "whole"),
        "model/w": ([6, 4], "float32", "param", 96, 2, [2, 1], "2 x 1"),
        "optimizer/z": ([3, 4], "float32", "optimizer", 48, 4, [3, 2], "4 boxes"),
    }


def test_inspect_tensors_text_and_glob_filter(checkpoint: Path) -> None:
    plain = CliRunner().invoke(cli, ["inspect", str(checkpoint)])
    assert not any(line.startswith("  model/") for line in plain.stdout.splitlines())  # the summary alone without --tensors
    result = CliRunner().invoke(cli, ["inspect", str(checkpoint), "--match", "model/*"])
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("  model/")]
    assert rows == [["model/b", "bfloat16", "[4]", "param", "8", "B", "whole"],
                    ["model/w", "float32", "[6,", "4]", "param", "96", "B", "2", "x", "1"]]


def test_inspect_json_always_lists_the_tensors_and_matches_its_schema(checkpoint: Path) -> None:
    result = CliRunner().invoke(cli, ["inspect", "--json", str(checkpoint), "--match", "optimizer/*"])
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    assert [t["name"] for t in doc["tensor_list"]] == ["optimizer/z"]
    assert doc["model"]["layers"] == 4
    full = json.loads(CliRunner().invoke(cli, ["inspect", "--json", str(checkpoint)]).stdout)
    assert len(full["tensor_list"]) == full["tensors"] == 3
    assert doc["shards"] == full["shards"] == 1 + 2 + 4  # every tensor's shards, listed or not


@pytest.mark.parametrize(("config", "want"), [
    ({"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}, (2, 32, 4, 2, 100)),
    ({"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257}, (12, 768, 12, None, 50257)),
    ({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 2, "padded_vocab_size": 256}, (2, 64, 8, 2, 256)),
])
def test_model_summary_reads_each_tools_config_keys(config: dict, want: tuple) -> None:
    m = model_summary(CheckpointInfo(model=ModelInfo(family="x", config=config)), None)
    assert m is not None and (m.layers, m.hidden_size, m.heads, m.kv_heads, m.vocab_size) == want


def test_model_summary_falls_back_to_the_layout(tmp_path: Path) -> None:
    m = model_summary(CheckpointInfo(), {"name": "megatron-gpt", "num_layers": 6, "config": {"hidden_size": 48}})
    assert m is not None and (m.family, m.layers, m.hidden_size) == ("megatron-gpt", 6, 48)
    assert model_summary(CheckpointInfo(), None) is None
