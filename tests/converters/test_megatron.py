"""``ckptkit convert`` of Megatron-Core ``torch_dist`` checkpoints: real ``dist_checkpointing``
saves of a GPTModel at TP 2 x DP 2 with the distributed optimizer (fp32 and bf16;
``fixtures/make_megatron.py``) come across bitwise against megatron-core's own
``load_plain_tensors``, layer-stacked tensors split per layer under Megatron's names; damaged or
unsupported input fails in one line and leaves no destination."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit_adapters.megatron.reader import CONVERTER, checkpoint_directory, layer_key

from .checks import assert_nothing_written, one_line_error

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "megatron"
SAVES = ["gpt-tp2-dp2", "gpt-tp2-dp2-bf16"]
needs_entry_point = pytest.mark.skipif("megatron" not in ckptkit.list_converters(),
                                       reason="the megatron entry point is not installed (pip install -e .)")


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))




def _per_layer(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """An oracle entry under the converter's names: stacked layers split, the layer put back."""
    if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
        return {layer_key(key, i): value[i] for i in range(value.shape[0])}
    return {key: value}


@pytest.mark.parametrize("name", SAVES)
def test_every_tensor_equals_megatrons_load_plain_tensors_and_verifies(name: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / name), str(dst))
    assert report.skipped == [] and report.step == 3
    assert ckptkit.verify(dst).ok
    state = ckptkit.load(dst)
    want: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(FIXTURES / f"{name}.oracle" / "plain.safetensors")).items():
        if key.startswith("optimizer.state."):
            kind, param = key[len("optimizer.state."):].split(".", 1)
            want.update({f"optimizer/{'fp32' if kind == 'param' else kind}/{k}": v for k, v in _per_layer(param, value).items()})
        else:
            want.update({f"model/{k}": v for k, v in _per_layer(key, value).items()})
    got = {f"{group}/{k}": v for group, tree in (("model", state["model"]),
                                                  *((f"optimizer/{s}", t) for s, t in state["optimizer"].items()))
           for k, v in tree.items() if isinstance(v, torch.Tensor)}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert len([k for k in got if k.startswith("model/decoder.layers.1.")]) == 6  # both layers of every stacked tensor
    assert bool((got["optimizer/exp_avg/decoder.layers.0.self_attention.linear_qkv.weight"] != 0).any())
    assert state["optimizer"]["fp32"]["output_layer.weight"].dtype == torch.float32  # the master, also for bf16


def test_values_and_info_come_from_common_pt(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / "gpt-tp2-dp2"), str(dst))
    manifest = ckptkit.read_manifest(dst)
    assert manifest.step == 3
    assert manifest.objects["megatron/optimizer"]["param_state_sharding_type"] == "fully_reshardable"  # type: ignore[index,call-overload]
    assert manifest.objects["model/decoder.layers.1.mlp.linear_fc2._extra_state"] == [None]
    info = manifest.info.optimizer
    assert info is not None and info.step == 3 and [g.options["wd_mult"] for g in info.param_groups] == [1.0, 0.0]
    sources = {t.name: t.source for t in report.tensor_list}
    assert sources["model/decoder.layers.1.self_attention.linear_qkv.weight"] == "decoder.layers.self_attention.linear_qkv.weight[1:2, 0:32, 0:16]"
    assert sources["optimizer/fp32/embedding.word_embeddings.weight"] == "optimizer.state.param.embedding.word_embeddings.weight"
    chunks = {t.name: t.chunks for t in report.tensor_list}
    assert chunks["model/decoder.layers.0.mlp.linear_fc1.weight"] == 4  # gate and up rows of each TP rank


@needs_entry_point
@pytest.mark.parametrize("where", ["checkpoint", "save"])
def test_the_cli_recognises_a_checkpoint_or_a_megatron_lm_save_directory(where: str, tmp_path: Path, run_ckptkit: Any) -> None:
    if where == "checkpoint":
        src = FIXTURES / "gpt-tp2-dp2"
    else:  # a Megatron-LM save directory: latest_checkpointed_iteration.txt naming iter_0000003
        src = tmp_path / "run"
        shutil.copytree(FIXTURES / "gpt-tp2-dp2", src / "iter_0000003")
        (src / "latest_checkpointed_iteration.txt").write_text("3")
    proc = run_ckptkit("convert", "--json", str(src), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == f"ckptkit: {src}: converting from megatron ({ckptkit.list_converters()['megatron']})"
    assert len(lines) == 2 and lines[1].startswith("ckptkit: warning: ") and "no Megatron-LM arguments" in lines[1]
    report = json.loads(proc.stdout)
    assert report["warnings"] == [lines[1].removeprefix("ckptkit: warning: ")]
    assert report["format"] == "megatron" and report["skipped"] == [] and report["tensors"] == len(report["tensor_list"]) == 60


@needs_entry_point
def test_a_missing_rank_file_fails_in_one_line_and_leaves_no_destination(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("gpt-tp2-dp2", tmp_path)
    (src / "__1_0.distcp").unlink()
    proc = run_ckptkit("convert", "--from", "megatron", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "__1_0.distcp: missing" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_truncated_rank_file_is_refused(tmp_path: Path) -> None:
    src = _copy("gpt-tp2-dp2-bf16", tmp_path)
    os.truncate(src / "__0_1.distcp", (src / "__0_1.distcp").stat().st_size // 2)
    with pytest.raises(IntegrityError, match="truncated"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_another_backend_and_a_legacy_checkpoint_are_refused_by_name(tmp_path: Path) -> None:
    src = _copy("gpt-tp2-dp2", tmp_path)
    (src / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(ManifestError, match="sharded backend 'zarr'"):
        checkpoint_directory(str(src))
    legacy = tmp_path / "legacy" / "iter_0000001"
    (legacy / "mp_rank_00").mkdir(parents=True)
    (legacy / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    assert CONVERTER.detect(str(legacy))
    with pytest.raises(IntegrityError, match="model_optim_rng.pt: not a torch.save archive"):  # read, as legacy (megatron_legacy)
        CONVERTER.convert(str(legacy), str(tmp_path / "out"))


def test_a_dcp_directory_without_megatrons_files_is_not_megatron() -> None:
    assert not CONVERTER.detect(str(REPO / "fixtures" / "dcp-nodist"))
    assert ckptkit.detect_format(FIXTURES / "gpt-tp2-dp2") == "megatron"


# --- the megatron-gpt layout: reshard and export to Hugging Face ------------------------------


def _layout_file(tmp_path: Path, run_ckptkit: Any) -> Path:
    """The built-in megatron-gpt layout of the fixtures' model, as `ckptkit layout builtin` writes it."""
    config = json.loads((FIXTURES / "gpt-tp2-dp2.oracle" / "config.json").read_text())
    model = {k: config[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size")}
    (tmp_path / "model.json").write_text(json.dumps({**model, "vocab_size": config["vocab_size"]}))
    proc = run_ckptkit("layout", "builtin", "megatron-gpt", str(tmp_path / "model.json"))
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "layout.json").write_text(proc.stdout)
    return tmp_path / "layout.json"


def test_reshard_with_the_megatron_layout_and_back_keeps_every_tensor(tmp_path: Path, run_ckptkit: Any) -> None:
    layout = _layout_file(tmp_path, run_ckptkit)
    converted, there, back = tmp_path / "converted", tmp_path / "tp2pp2dp2", tmp_path / "back"
    CONVERTER.convert(str(FIXTURES / "gpt-tp2-dp2"), str(converted))
    proc = run_ckptkit("reshard", str(converted), str(there), "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "1",
                       "--layout", str(layout), "--no-latest")
    assert proc.returncode == 0, proc.stderr
    manifest = ckptkit.read_manifest(there)
    assert manifest.layout is not None and manifest.layout["name"] == "megatron-gpt" and manifest.topology.world_size == 8
    assert run_ckptkit("reshard", str(there), str(back), "--no-latest").returncode == 0
    for a, b in ((converted, there), (converted, back)):
        proc = run_ckptkit("diff", str(a), str(b))
        assert proc.returncode == 0 and "equal" in proc.stdout, proc.stdout + proc.stderr
    odd = run_ckptkit("reshard", str(converted), str(tmp_path / "tp4"), "--tp", "4", "--layout", str(layout), "--no-latest")
    assert odd.returncode == 1 and "query groups" in odd.stderr  # 2 groups cannot be cut 4 ways
    assert_nothing_written(tmp_path, tmp_path / "tp4")


def test_exported_to_hugging_face_the_logits_match_megatrons_forward(tmp_path: Path, run_ckptkit: Any) -> None:
    transformers = pytest.importorskip("transformers")
    layout = _layout_file(tmp_path, run_ckptkit)
    converted, out = tmp_path / "converted", tmp_path / "hf"
    CONVERTER.convert(str(FIXTURES / "gpt-tp2-dp2"), str(converted))
    proc = run_ckptkit("export", str(converted), str(out), "--format", "hf", "--dtype", "fp32", "--layout", str(layout))
    assert proc.returncode == 0, proc.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    oracle = load_file(str(FIXTURES / "gpt-tp2-dp2.oracle" / "logits.safetensors"))
    with torch.no_grad():
        logits = model(oracle["ids"]).logits
    assert logits.shape == oracle["logits"].shape
    assert (logits - oracle["logits"]).abs().max().item() < 1e-4
    # q, k, v cut out of the fused QKV group by group: q of group 1 is rows 16..24 of Megatron's tensor
    qkv = ckptkit.load(converted)["model"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    q = model.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(q, torch.cat([qkv[0:8], qkv[16:24]])) and torch.equal(model.state_dict()["model.layers.1.self_attn.v_proj.weight"],
                                                                             torch.cat([qkv[12:16], qkv[28:32]]))


def test_a_bf16_checkpoint_exports_its_bf16_weights(tmp_path: Path, run_ckptkit: Any) -> None:
    layout = _layout_file(tmp_path, run_ckptkit)
    converted, out = tmp_path / "converted", tmp_path / "hf"
    CONVERTER.convert(str(FIXTURES / "gpt-tp2-dp2-bf16"), str(converted))
    proc = run_ckptkit("export", str(converted), str(out), "--format", "hf", "--dtype", "bf16", "--layout", str(layout))
    assert proc.returncode == 0, proc.stderr
    weights = load_file(str(next(out.glob("model-*.safetensors"))))
    params = ckptkit.load(converted)["model"]
    assert torch.equal(weights["model.layers.0.mlp.up_proj.weight"], params["decoder.layers.0.mlp.linear_fc1.weight"][24:])
    assert torch.equal(weights["lm_head.weight"], params["output_layer.weight"])


def test_megatron_lm_arguments_give_the_layout() -> None:
    from ckptkit_adapters.megatron.reader import model_config

    args = {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "ffn_hidden_size": 24, "padded_vocab_size": 40,
            "group_query_attention": True, "num_query_groups": 2, "swiglu": True, "untie_embeddings_and_output_weights": True,
            "position_embedding_type": "rope", "add_bias_linear": False, "norm_epsilon": 1e-5, "kv_channels": 4}
    assert model_config(args) == {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "ffn_hidden_size": 24,
                                  "vocab_size": 40, "kv_channels": 4, "layernorm_epsilon": 1e-5, "num_query_groups": 2,
                                  "gated_linear_unit": True, "share_embeddings_and_output_weights": False}
    assert model_config({**args, "add_bias_linear": True}) is None  # biases: not this layout
    assert model_config({"num_layers": 2}) is None


def test_a_pipeline_parallel_save_comes_across_with_global_layer_numbers(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / "gpt-tp2-pp2"), str(dst))
    assert report.skipped == [] and report.step == 0  # the model alone: no optimizer, no iteration
    got = {k: v for k, v in ckptkit.load(dst)["model"].items() if isinstance(v, torch.Tensor)}
    want: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(FIXTURES / "gpt-tp2-pp2.oracle" / "plain.safetensors")).items():
        want.update(_per_layer(key, value))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    # layer 1 lives on the second pipeline stage, saved there at its global offset
    assert "model/decoder.layers.1.mlp.linear_fc2.weight" in {t.name for t in report.tensor_list}


@needs_entry_point
def test_a_layout_given_at_convert_time_is_recorded_for_reshard_and_export(tmp_path: Path, run_ckptkit: Any) -> None:
    layout = _layout_file(tmp_path, run_ckptkit)
    dst = tmp_path / "converted"
    proc = run_ckptkit("convert", str(FIXTURES / "gpt-tp2-dp2"), str(dst), "--layout", str(layout))
    assert proc.returncode == 0, proc.stderr
    manifest = ckptkit.read_manifest(dst)
    assert manifest.layout is not None and manifest.layout["name"] == "megatron-gpt"
    resharded = run_ckptkit("reshard", str(dst), str(tmp_path / "tp2"), "--tp", "2", "--no-latest")
    assert resharded.returncode == 0, resharded.stderr
    exported = run_ckptkit("export", str(tmp_path / "tp2"), str(tmp_path / "hf"), "--format", "hf", "--dtype", "fp32")
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "config.json").exists()


@needs_entry_point
def test_a_layout_that_does_not_fit_fails_in_one_line_and_writes_nothing(tmp_path: Path, run_ckptkit: Any) -> None:
    (tmp_path / "model.json").write_text(json.dumps({"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                                                     "ffn_hidden_size": 24, "vocab_size": 40}))
    layout = run_ckptkit("layout", "builtin", "megatron-gpt", str(tmp_path / "model.json"))
    (tmp_path / "layout.json").write_text(layout.stdout)
    proc = run_ckptkit("convert", "--from", "megatron", str(FIXTURES / "gpt-tp2-dp2"), str(tmp_path / "out"),
                       "--layout", str(tmp_path / "layout.json"))
    assert proc.returncode == 1
    assert "does not fit" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_the_export_reads_each_fused_tensor_once(tmp_path: Path, run_ckptkit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkit.exports.source import Source
    from ckptkit.layouts import load_layout

    layout = load_layout(_layout_file(tmp_path, run_ckptkit))
    converted = tmp_path / "converted"
    CONVERTER.convert(str(FIXTURES / "gpt-tp2-dp2"), str(converted))
    reads: list[str] = []
    plain_read = Source.read

    def counted(self: Source, fqn: str, dtype: str | None = None) -> Any:
        reads.append(fqn)
        return plain_read(self, fqn, dtype)

    monkeypatch.setattr(Source, "read", counted)
    report = ckptkit.export(converted, tmp_path / "hf", format="hf", dtype="fp32", layout=layout)
    assert report.tensors == 21 and len(reads) == len(set(reads)) == 15  # q, k, v from one read; gate, up too


def test_a_save_of_megatron_core_017_and_later_keeps_its_common_state_among_the_entries(tmp_path: Path) -> None:
    # No common.pt: the common state is the sharded object common_state (fixtures/make_megatron_current.py).
    src = REPO / "fixtures" / "megatron-current" / "gpt-tp2"
    assert not (src / "common.pt").exists()
    assert ckptkit.detect_format(src) == "megatron"  # not a plain DCP directory
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(src), str(dst))
    assert report.skipped == [] and ckptkit.verify(dst).ok
    assert not [o for o in report.objects if "common_state" in o.name]
    got = {k: v for k, v in ckptkit.load(dst)["model"].items() if isinstance(v, torch.Tensor)}
    want: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(src.parent / "gpt-tp2.oracle" / "plain.safetensors")).items():
        want.update(_per_layer(key, value))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@needs_entry_point
def test_a_save_without_megatron_lm_arguments_says_what_its_shapes_determine_and_what_is_left(tmp_path: Path,
                                                                                             run_ckptkit: Any) -> None:
    src = FIXTURES / "gpt-tp2-dp2"  # megatron-core's own save: no Megatron-LM arguments
    proc = run_ckptkit("convert", str(src), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    warning = proc.stderr.splitlines()[-1]
    truth = json.loads((FIXTURES / "gpt-tp2-dp2.oracle" / "config.json").read_text())
    said = ", ".join(f"{k} {json.dumps(truth[k])}" for k in ("num_layers", "vocab_size", "hidden_size", "ffn_hidden_size"))
    assert f"the shapes say {said}, gated_linear_unit true, and not num_attention_heads or num_query_groups" in warning
    kv = truth["hidden_size"] // truth["num_attention_heads"]
    assert (f"(num_attention_heads x kv_channels = {truth['num_attention_heads'] * kv}, "
            f"num_query_groups x kv_channels = {truth['num_query_groups'] * kv})") in warning
    assert ckptkit.read_manifest(tmp_path / "out").layout is None
    # what it says, completed with the two it cannot, is the layout: given, the conversion records it and says nothing
    config = {k: truth[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                                    "vocab_size")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    layout = run_ckptkit("layout", "builtin", "megatron-gpt", str(tmp_path / "config.json"))
    assert layout.returncode == 0, layout.stderr
    (tmp_path / "layout.json").write_text(layout.stdout)
    proc = run_ckptkit("convert", str(src), str(tmp_path / "again"), "--layout", str(tmp_path / "layout.json"))
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    assert ckptkit.read_manifest(tmp_path / "again").layout is not None
    # ... or the two it asks for, as the options it names: the same layout, found by the converter
    assert "convert again with --model-config num_attention_heads=N --model-config num_query_groups=G" in warning
    asked = [f"--model-config={k}={truth[k]}" for k in ("num_attention_heads", "num_query_groups")]
    proc = run_ckptkit("convert", str(src), str(tmp_path / "said"), *asked)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    said_layout = ckptkit.read_manifest(tmp_path / "said").layout
    assert said_layout is not None
    from ckptkit.layouts import load_layout, parse_layout

    assert parse_layout(dict(said_layout)).units == load_layout(tmp_path / "layout.json").units
    wrong = run_ckptkit("convert", "--from", "megatron", str(src), str(tmp_path / "wrong"), "--model-config", "num_attention_heads=3")
    assert wrong.returncode == 1 and "num_attention_heads=3 does not divide" in one_line_error(wrong.stderr)
    assert_nothing_written(tmp_path, tmp_path / "wrong")
    # --layout by name, built for what --model-config says (all of it: the converter adds nothing to a layout given)
    full = [f"--model-config={k}={v}" for k, v in config.items()]
    proc = run_ckptkit("convert", "--from", "megatron", str(src), str(tmp_path / "named"), "--layout", "megatron-gpt", *full)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
    named = ckptkit.read_manifest(tmp_path / "named").layout
    assert named is not None and parse_layout(dict(named)).units == load_layout(tmp_path / "layout.json").units
