"""``ckptkit convert`` of a Megatron-Core ``torch_dist`` save of a mixture of experts (a MoE
GPTModel, local spec, ``SequentialMLP`` experts, saved by megatron-core itself at EP 2 on CPU:
``fixtures/make_megatron_moe.py``): every tensor, each expert's per (layer, expert), bitwise
against megatron-core's own ``load_plain_tensors``, under Megatron's per-expert names and counted
per expert by the ``megatron-gpt`` layout with ``num_moe_experts``, so that the converted
checkpoint reshards across EP sizes and back byte for byte; a layout that does not fit fails in
one line and leaves no destination."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.layouts import builtin, layout_for
from ckptkit.manifest import Topology
from ckptkit.manifest.shards import iter_shards
from ckptkit.ops.diff import diff
from ckptkit.ops.reshard import reshard
from ckptkit_adapters.megatron.reader import CONVERTER, expert_key, layer_key, model_config

from .checks import assert_nothing_written, one_line_error

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron-moe"
SAVE = FIXTURES / "gpt-moe-tp1-ep2"
ORACLE = FIXTURES / "gpt-moe-tp1-ep2.oracle"
EXPERTS = "decoder.layers.mlp.experts.experts."
KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size",
        "num_moe_experts", "moe_ffn_hidden_size")


def _layout(**override: int) -> Any:
    config = json.loads((ORACLE / "config.json").read_text())
    return builtin("megatron-gpt", {**{k: config[k] for k in KEYS}, **override})


def _per_expert(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """An oracle entry under the converter's names: experts split per (layer, expert), stacked layers per layer."""
    if key.startswith(EXPERTS):
        return {expert_key(key, i, e): value[i, e] for i in range(value.shape[0]) for e in range(value.shape[1])}
    if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
        return {layer_key(key, i): value[i] for i in range(value.shape[0])}
    return {key: value}


def _payloads(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    dst = tmp_path / "converted"
    report = CONVERTER.convert(str(SAVE), str(dst), layout=_layout())
    assert report.skipped == []
    return dst


def test_every_expert_tensor_equals_megatrons_load_plain_tensors(converted: Path) -> None:
    assert ckptkit.verify(converted).ok
    got = {k: v for k, v in ckptkit.load(converted)["model"].items() if isinstance(v, torch.Tensor)}
    want = {k: v for key, value in load_file(str(ORACLE / "plain.safetensors")).items() for k, v in _per_expert(key, value).items()}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    experts = [k for k in got if ".mlp.experts.local_experts." in k]
    assert len(experts) == 2 * 4 * 2  # layers x experts x (linear_fc1, linear_fc2), each its own tensor
    assert got["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (16, 16)  # [gate; up] of 8 each
    assert not torch.equal(got["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                           got["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"])  # EP rank 1's first expert
    manifest = ckptkit.read_manifest(converted)
    assert layout_for(manifest).experts == 4
    assert manifest.objects["model/decoder.layers.1.mlp.experts.local_experts.3.linear_fc2._extra_state"] == [None]


def test_the_converted_moe_reshards_across_ep_sizes_and_back_byte_for_byte(converted: Path, tmp_path: Path) -> None:
    ep2, ep4, back = tmp_path / "ep2", tmp_path / "ep4", tmp_path / "back"
    at_ep2 = Topology(world_size=2, dp=2, ep=2)
    reshard(converted, ep2, at_ep2)
    reshard(ep2, ep4, Topology(world_size=8, tp=2, dp=4, ep=4))
    reshard(ep4, back, at_ep2)
    assert ckptkit.read_manifest(str(ep4)).topology.ep == 4
    assert diff(converted, ep4).ok  # every expert, every element
    assert _payloads(back) == _payloads(ep2) and len(_payloads(ep2)) == 2
    # an EP rank's file holds its own experts only: EP rank 1 of ep 2 holds experts 2 and 3
    manifest = ckptkit.read_manifest(str(ep2))
    holders = {manifest.files[s.file].path for fqn, t in manifest.tensors.items() if ".local_experts.3." in fqn for s in iter_shards(t)}
    assert holders == {"rank00001.safetensors"}


def test_the_converted_moe_exports_back_to_megatron_and_converts_again_to_the_same_tensors(converted: Path, tmp_path: Path) -> None:
    from ckptkit.exports.run import export

    out = tmp_path / "megatron"
    export(converted, out, format="megatron", tp=1, ep=2)
    # megatron-core's stacked keys again: experts on a (layer, expert) axis pair, as the fixture holds them
    from torch.distributed.checkpoint import FileSystemReader

    written = FileSystemReader(str(out)).read_metadata().state_dict_metadata
    saved = FileSystemReader(str(SAVE)).read_metadata().state_dict_metadata
    stacked = [k for k in saved if k.startswith(EXPERTS) and "_extra_state" not in k]
    assert stacked and all(list(written[k].size) == list(saved[k].size) for k in stacked)
    again = tmp_path / "again"
    CONVERTER.convert(str(out), str(again), layout=_layout())
    report = diff(converted, again, kinds=("param",))
    assert report.tensors == 29 and report.differences_total == 0
    # the export says its model (Megatron-LM's arguments), which the first conversion had to be told
    args = (ckptkit.read_manifest(again).info.config or {})["args"]
    assert (args["num_experts"], args["expert_model_parallel_size"], args["tensor_model_parallel_size"]) == (4, 2, 1)
    first, second = ckptkit.load(converted)["model"], ckptkit.load(again)["model"]
    experts = [k for k in first if ".mlp.experts.local_experts." in k and isinstance(first[k], torch.Tensor)]
    assert len(experts) == 16 and all(torch.equal(first[k], second[k]) for k in experts)


def test_a_layout_that_does_not_fit_the_experts_fails_in_one_line(tmp_path: Path, run_ckptkit: Any) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps(_layout(num_moe_experts=8).to_json()))
    proc = run_ckptkit("convert", "--from", "megatron", str(SAVE), str(tmp_path / "out"), "--layout", str(layout))
    assert proc.returncode == 1 and "experts" in one_line_error(proc.stderr), proc.stderr
    assert_nothing_written(tmp_path, tmp_path / "out")
    good = tmp_path / "good"
    layout.write_text(json.dumps(_layout().to_json()))
    assert run_ckptkit("convert", "--from", "megatron", str(SAVE), str(good), "--layout", str(layout)).returncode == 0
    proc = run_ckptkit("export", str(good), str(tmp_path / "meg"), "--format", "megatron", "--ep", "3")
    assert proc.returncode == 1 and "4 experts are not divisible by ep 3" in one_line_error(proc.stderr), proc.stderr
    assert not (tmp_path / "meg").exists()


def test_megatron_lm_args_of_a_mixture_of_experts_describe_its_experts() -> None:
    args = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "ffn_hidden_size": 24, "padded_vocab_size": 40,
            "swiglu": True, "num_experts": 4, "moe_ffn_hidden_size": 8, "moe_router_topk": 2}
    config = model_config(args)
    assert config is not None and (config["num_moe_experts"], config["moe_ffn_hidden_size"], config["moe_router_topk"]) == (4, 8, 2)
    assert builtin("megatron-gpt", config).experts == 4
    assert model_config({**args, "moe_grouped_gemm": True}) is None  # grouped experts are saved in another form


def test_a_save_without_arguments_says_its_experts(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("convert", "--from", "megatron", str(SAVE), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    config = json.loads((ORACLE / "config.json").read_text())
    said = ", ".join(f"{k} {json.dumps(config[k])}" for k in ("num_layers", "vocab_size", "hidden_size", "num_moe_experts",
                                                                "moe_ffn_hidden_size"))
    assert f"the shapes say {said}, gated_linear_unit true, and not num_attention_heads" in proc.stderr.splitlines()[-1]
