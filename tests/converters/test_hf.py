"""``ckptkit convert`` of Hugging Face model directories: tiny models saved by transformers itself
(sharded, fp32 and bf16, a tied GPT-2) come across bitwise against the model's own state_dict,
with their family's layout; damaged or pickled weights are refused in one line and leave no
destination."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit_adapters.hf.reader import CONVERTER, fqn_of, hf_key

from .checks import assert_nothing_written

transformers = pytest.importorskip("transformers")

# The CLI and ckptkit.convert find converters through installed metadata: the hf entry point
# resolves once the package is (re)installed from this tree.
REGISTERED = "hf" in ckptkit.list_converters()
needs_entry_point = pytest.mark.skipif(not REGISTERED, reason="the hf entry point is not installed (pip install -e .)")


def _tiny(family: str, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=16)
        model = transformers.GPT2LMHeadModel(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def _saved(family: str, tmp_path: Path, dtype: torch.dtype = torch.float32) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny model saved by transformers (sharded at 20 KB) and its state_dict."""
    model = _tiny(family, dtype)
    path = tmp_path / f"hf-{family}"
    model.save_pretrained(path, max_shard_size="20KB")
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}



CASES = [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.float32), ("gpt2", torch.float32)]


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_every_tensor_equals_the_models_state_dict_and_verifies(family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    src, want = _saved(family, tmp_path, dtype)
    assert (src / "model.safetensors.index.json").exists()  # sharded
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(src), str(dst))
    assert ckptkit.verify(dst).ok
    got = ckptkit.load(dst)["model"]
    tied = {"lm_head.weight"} if family == "gpt2" else set()
    assert sorted(got) == sorted(set(want) - tied)
    for key, tensor in got.items():
        assert tensor.dtype == want[key].dtype == dtype, key
        assert torch.equal(tensor, want[key]), key
    assert all(t.name == fqn_of(t.source) and hf_key(t.name) == t.source and t.kind == "param" for t in report.tensor_list)


@pytest.mark.parametrize(("family", "layout"), [("llama", "hf-llama"), ("qwen2", "hf-qwen2"), ("gpt2", "hf-gpt2")])
def test_the_familys_layout_is_recorded_and_reshards_without_one(family: str, layout: str, tmp_path: Path) -> None:
    src, want = _saved(family, tmp_path)
    dst = tmp_path / "out"
    CONVERTER.convert(str(src), str(dst))
    manifest = ckptkit.read_manifest(dst)
    assert manifest.layout is not None and manifest.layout["name"] == layout
    assert manifest.info.model is not None and manifest.info.model.family == layout
    resharded = tmp_path / "tp2"
    ckptkit.reshard(dst, resharded, ckptkit.Topology(world_size=2, tp=2))
    assert ckptkit.verify(resharded).ok
    got = ckptkit.load(resharded)["model"]
    assert all(torch.equal(got[key], want[key]) for key in got)


@pytest.mark.parametrize(("family", "dtype"), [("llama", torch.float32), ("llama", torch.bfloat16), ("qwen2", torch.float32),
                                            ("gpt2", torch.float32)])
def test_export_hf_gives_back_the_original_model(family: str, dtype: torch.dtype, tmp_path: Path) -> None:
    src, want = _saved(family, tmp_path, dtype)
    dst, out = tmp_path / "out", tmp_path / "exported"
    CONVERTER.convert(str(src), str(dst))
    ckptkit.export(dst, out, format="hf", dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype])
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == dtype and torch.equal(got[k], want[k]) for k in want)


def test_configs_and_tokenizer_files_are_carried(tmp_path: Path) -> None:
    src, _ = _saved("llama", tmp_path)
    (src / "tokenizer.json").write_text('{"model": {"vocab": {}}}', encoding="utf-8")
    dst = tmp_path / "out"
    CONVERTER.convert(str(src), str(dst))
    manifest = ckptkit.read_manifest(dst)
    assert manifest.info.config is not None
    assert manifest.info.config["config.json"] == json.loads((src / "config.json").read_text(encoding="utf-8"))
    assert manifest.info.config["generation_config.json"] == json.loads((src / "generation_config.json").read_text(encoding="utf-8"))
    assert manifest.tokenizer is not None and [os.path.basename(f) for f in manifest.tokenizer.files] == ["tokenizer.json"]
    assert (dst / manifest.tokenizer.files[0]).read_text(encoding="utf-8") == '{"model": {"vocab": {}}}'


def test_a_tied_head_is_recorded_not_invented(tmp_path: Path) -> None:
    src, _ = _saved("gpt2", tmp_path)
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(src), str(dst))
    manifest = ckptkit.read_manifest(dst)
    assert "model/lm_head.weight" not in manifest.tensors
    assert manifest.objects["hf/tied_weights"] == {"lm_head.weight": "transformer.wte.weight"}
    assert [(o.name, o.source) for o in report.objects] == [("hf/tied_weights", "config.json:tie_word_embeddings")]


def test_detect_wants_a_config_and_weights(tmp_path: Path) -> None:
    src, _ = _saved("llama", tmp_path)
    assert CONVERTER.detect(str(src))
    (src / "config.json").unlink()
    assert not CONVERTER.detect(str(src))
    assert not CONVERTER.detect(str(tmp_path / "absent"))


def test_a_truncated_shard_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    src, _ = _saved("llama", tmp_path)
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    dst = tmp_path / "out"
    with pytest.raises(ckptkit.IntegrityError) as err:
        CONVERTER.convert(str(src), str(dst))
    assert shard.name in str(err.value) and "\n" not in str(err.value)
    assert_nothing_written(tmp_path, dst)


def _pickled(family: str, tmp_path: Path, shard: str | None) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny model's config and pickled weights: one ``pytorch_model.bin`` (``torch.save`` of the
    state dict, as transformers 4 wrote it) or shards and their index (``huggingface_hub``)."""
    from huggingface_hub import save_torch_state_dict

    model = _tiny(family)
    path = tmp_path / f"bin-{family}"
    model.config.save_pretrained(path)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if shard is None:
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_torch_state_dict(state, path, safe_serialization=False, max_shard_size=shard)
    return path, state


@pytest.mark.parametrize(("family", "shard"), [("llama", None), ("qwen2", "20KB"), ("gpt2", "20KB")])
def test_pickled_weights_come_across_bitwise(family: str, shard: str | None, tmp_path: Path) -> None:
    src, want = _pickled(family, tmp_path, shard)
    assert (src / "pytorch_model.bin.index.json").exists() == (shard is not None)
    assert CONVERTER.detect(str(src))
    dst = tmp_path / "out"
    CONVERTER.convert(str(src), str(dst))
    assert ckptkit.verify(dst).ok
    got = ckptkit.load(dst)["model"]
    assert "hf/tied_weights" not in ckptkit.read_manifest(dst).objects  # pickles keep GPT-2's tied head as its own key
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in got)


def test_a_crafted_pickle_in_pytorch_model_bin_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    src, _ = _pickled("llama", tmp_path, None)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return os.system, (f"touch {marker}",)

    torch.save({"model.embed_tokens.weight": torch.ones(2), "evil": Payload()}, src / "pytorch_model.bin")
    dst = tmp_path / "out"
    with pytest.raises(ckptkit.ManifestError, match="refused to unpickle posix.system") as err:
        CONVERTER.convert(str(src), str(dst))
    assert "\n" not in str(err.value) and not marker.exists()
    assert_nothing_written(tmp_path, dst)


@needs_entry_point
def test_convert_finds_the_hf_converter(tmp_path: Path) -> None:
    src, _ = _saved("llama", tmp_path)
    assert ckptkit.detect_format(src) == "hf"
    assert ckptkit.convert(src, tmp_path / "out").format == "hf"


@needs_entry_point
def test_the_cli_refuses_a_truncated_shard_in_one_line(tmp_path: Path, run_ckptkit: Any) -> None:
    src, _ = _saved("llama", tmp_path)
    shard = sorted(src.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    dst = tmp_path / "out"
    proc = run_ckptkit("convert", "--from", "hf", str(src), str(dst))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptkit: error: ") and "Traceback" not in proc.stderr
    assert_nothing_written(tmp_path, dst)


@pytest.mark.parametrize(("family", "dtype", "tp", "pp"), [
    ("llama", torch.float32, 2, 2), ("qwen2", torch.float32, 2, 2), ("gpt2", torch.float32, 2, 1), ("llama", torch.bfloat16, 2, 1),
])
def test_resharded_and_exported_back_gives_the_same_tensors_and_logits(
    family: str, dtype: torch.dtype, tp: int, pp: int, tmp_path: Path, run_ckptkit: Any,
) -> None:
    src, want = _saved(family, tmp_path, dtype)
    dst, resharded, out = tmp_path / "out", tmp_path / "resharded", tmp_path / "exported"
    CONVERTER.convert(str(src), str(dst))
    proc = run_ckptkit("reshard", str(dst), str(resharded), "--tp", str(tp), "--pp", str(pp), "--no-latest")
    assert proc.returncode == 0, proc.stderr
    manifest = ckptkit.read_manifest(resharded)
    assert (manifest.topology.tp, manifest.topology.pp, manifest.topology.world_size) == (tp, pp, tp * pp)
    assert len({f.path.split("-")[0] for f in manifest.files if f.path.endswith(".safetensors")}) == tp * pp  # every rank's files
    proc = run_ckptkit("export", str(resharded), str(out), "--format", "hf", "--dtype", {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype])
    assert proc.returncode == 0, proc.stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    got = exported.state_dict()
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == dtype and torch.equal(got[k], want[k]) for k in want)
    original = _tiny(family, dtype)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(ids).logits, original(ids).logits)


@pytest.mark.parametrize(("edit", "message"), [
    (dict(intermediate_size=48), r"the layout 'hf-llama' does not fit the converted tensors: .*model\.layers\.0\.mlp\.down_proj\.weight: "
                                 r"the layout says shape \[32, 48\], the tensor is \[32, 64\]"),
    (dict(num_attention_heads="four"), r"config\.json \(llama\): num_attention_heads must be a non-negative integer, not 'four'"),
    (dict(hidden_size=None), r"config\.json \(llama\) lacks hidden_size, an integer the model needs"),
])
def test_a_config_unlike_its_weights_is_refused_naming_the_tensor_or_value(
    edit: dict[str, Any], message: str, tmp_path: Path, run_ckptkit: Any
) -> None:
    src, _ = _saved("llama", tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **edit}))
    dst = tmp_path / "out"
    with pytest.raises(ckptkit.LayoutError, match=message):
        CONVERTER.convert(str(src), str(dst))
    assert_nothing_written(tmp_path, dst)
    if REGISTERED:
        proc = run_ckptkit("convert", "--from", "hf", str(src), str(dst))
        lines = proc.stderr.splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert_nothing_written(tmp_path, dst)
