"""torchtitan in and out: real saves by torchtitan 0.3.0's own ``CheckpointManager`` of its
Llama 3 (``fixtures/make_torchtitan.py``: model-only, and mid-run with its AdamW, schedule and
train state) come in under torchtitan's names, laid out by its view of the canonical model (q
and k rows in the original Llama's rotary order; the optimizer's state keyed by the modules'
fused ``wqkv``, split as torchtitan itself splits it), reshard to tp 2 x pp 2 and export to
Hugging Face with logits equal to torchtitan's own forward, to Megatron-Core and back bitwise,
and back to torchtitan, whose job resumes from the export with the original's next step; a
Hugging Face Llama exported to torchtitan runs there with transformers' logits. What torchtitan
does not record is asked for in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import LayoutError
from ckptkit.models import Run, compose, placed, spec_from_config
from ckptkit.manifest import Topology
from ckptkit_adapters.hf.view import hf_view
from ckptkit_adapters.torchtitan.view import config_of, torchtitan_view

from .checks import assert_nothing_written, one_line_error

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "torchtitan"
SAVE, ORACLE = FIXTURES / "llama3" / "checkpoint" / "step-3", FIXTURES / "llama3.oracle"
FULL = FIXTURES / "full" / "checkpoint" / "step-2"  # mid-run: model, optimizer, schedule, train state
JOB = Path(__file__).resolve().parents[1] / "torchtitan_job.py"
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                                      reason="torchtitan is not installed (make test installs it)")
# what a torchtitan save does not record of the fixture's model (its rotary base is not Llama 3's 500000)
GIVEN = {"num_attention_heads": 4, "rope_theta": 10000.0, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}

Cli = Callable[..., CompletedProcess[str]]


def _converted(tmp_path: Path) -> Path:
    dst = tmp_path / "converted"
    report = ckptkit.convert(SAVE, dst, config=GIVEN)
    assert (report.format, report.step, report.warnings) == ("torchtitan", 3, [])
    return dst


def test_the_torchtitan_save_is_detected_and_read_as_its_llama(tmp_path: Path) -> None:
    assert ckptkit.detect_format(SAVE) == "torchtitan"  # not the dcp converter it reads through
    manifest = ckptkit.read_manifest(_converted(tmp_path))
    assert manifest.layout is not None and manifest.layout["name"] == "torchtitan-llama"
    assert {e.kind for e in manifest.tensors.values()} == {"param"} and len(manifest.tensors) == 21
    assert "model/layers.1.attention.qkv_linear.wk.weight" in manifest.tensors
    config = json.loads((ORACLE / "config.json").read_text())
    assert {k: manifest.layout["config"][k] for k in config} == config  # every size read from the shapes, bar the heads given


def test_resharded_and_exported_to_hf_its_logits_are_torchtitans(tmp_path: Path) -> None:
    converted, resharded, out = _converted(tmp_path), tmp_path / "tp2pp2", tmp_path / "hf"
    ckptkit.reshard(converted, resharded, Topology(world_size=4, tp=2, pp=2, dp=1), update_latest=False)
    ckptkit.export(resharded, out, format="hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    oracle = load_file(str(ORACLE / "logits.safetensors"))
    with torch.no_grad():
        logits = model(oracle["ids"]).logits
    assert (logits - oracle["logits"]).abs().max().item() <= 1e-5
    # the q and k rows were reordered, each head's pairs into halves; the others are torchtitan's own bytes
    wq, wv = (f"layers.0.attention.qkv_linear.w{x}.weight" for x in "qv")
    saved = {wq: torch.empty(32, 32), wv: torch.empty(16, 32)}
    dcp.load(saved, checkpoint_id=str(SAVE), no_dist=True)
    hf = load_file(str(next(out.glob("*.safetensors"))))
    assert torch.equal(hf["model.layers.0.self_attn.v_proj.weight"], saved[wv])
    q = hf["model.layers.0.self_attn.q_proj.weight"].view(4, 2, 4, 32)
    assert torch.equal(q.transpose(1, 2).reshape(32, 32), saved[wq])


def test_a_qwen3_save_needs_nothing_said_and_exports_with_torchtitans_logits(tmp_path: Path) -> None:
    # its q/k norms give the heads' size, so the heads: only what a forward needs beyond weights is said
    report = ckptkit.convert(FIXTURES / "qwen3" / "checkpoint" / "step-1", tmp_path / "converted",
                             config={"rope_theta": 10000.0, "max_position_embeddings": 64})
    assert report.warnings == ["the model's rms_norm_eps 1e-06 assumed, torchtitan's Qwen3 defaults (a torchtitan checkpoint "
                               "records no config): give --model-config KEY=VALUE where the job's differ"]
    manifest = ckptkit.read_manifest(tmp_path / "converted")
    assert manifest.layout is not None and manifest.layout["name"] == "torchtitan-qwen3"
    oracle = FIXTURES / "qwen3.oracle"
    config = json.loads((oracle / "config.json").read_text())
    assert {k: manifest.layout["config"][k] for k in config} == config
    ckptkit.reshard(tmp_path / "converted", tmp_path / "tp2pp2", Topology(world_size=4, tp=2, pp=2, dp=1), update_latest=False)
    ckptkit.export(tmp_path / "tp2pp2", tmp_path / "hf", format="hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    want = load_file(str(oracle / "logits.safetensors"))
    with torch.no_grad():
        assert (model(want["ids"]).logits - want["logits"]).abs().max().item() <= 1e-5


def test_exported_to_megatron_and_back_the_tensors_are_bitwise_the_same(tmp_path: Path) -> None:
    converted = _converted(tmp_path)
    ckptkit.export(converted, tmp_path / "hf", format="hf")
    report = ckptkit.export(converted, tmp_path / "mcore", format="megatron", tp=2)
    qkv = [t.source for t in report.tensor_list if "linear_qkv.weight" in t.name]  # a group's q, k, v: runs of rotary rows, said short
    assert qkv and all("runs of rows]" in s and len(s) < 400 for s in qkv), qkv[:1]
    ckptkit.convert(tmp_path / "mcore", tmp_path / "back")
    ckptkit.export(tmp_path / "back", tmp_path / "hf2", format="hf")
    a, b = (load_file(str(next((tmp_path / d).glob("*.safetensors")))) for d in ("hf", "hf2"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _rows(runs: list[Run]) -> list[int]:
    rows = [r.src_row + i for r in runs for i in range(r.count)]
    assert [r.row for r in runs] == [sum(x.count for x in runs[:i]) for i in range(len(runs))]  # in order, no gap
    return rows


def test_the_rotary_order_is_a_permutation_of_each_heads_rows() -> None:
    spec = spec_from_config(json.loads((ORACLE / "config.json").read_text()))
    runs = compose(spec, torchtitan_view(spec), hf_view(spec))
    q = _rows(runs["model.layers.0.self_attn.q_proj.weight"])  # the source row of each row, in order
    assert q[:8] == [0, 2, 4, 6, 1, 3, 5, 7] and q[8:12] == [8, 10, 12, 14] and sorted(q) == list(range(32))
    there = _rows(compose(spec, hf_view(spec), torchtitan_view(spec))["layers.1.attention.qkv_linear.wk.weight"])
    assert there[:8] == [0, 4, 1, 5, 2, 6, 3, 7] and sorted(there) == list(range(16))
    assert compose(spec, hf_view(spec), torchtitan_view(spec))["layers.0.feed_forward.w3.weight"][0].count == 56  # whole
    assert placed(spec, torchtitan_view(spec)).shapes["layers.0.attention.qkv_linear.wk.weight"] == (16, 32)


@pytest.mark.parametrize(("given", "message"), [
    ([], "a torchtitan checkpoint does not record its attention heads: give --model-config num_attention_heads=N"),
    (["--model-config", "num_attention_heads=5"], "num_attention_heads 5 does not divide the 32 rows of "
                                                   "layers.0.attention.qkv_linear.wq.weight"),
    (["--model-config", "num_attention_heads=4", "--model-config", "tie_word_embeddings=true"],
     "--model-config tie_word_embeddings=true: the save holds lm_head.weight"),
    (["--model-config", "num_attention_heads=4", "--model-config", "intermediate_size=96"],
     "--model-config intermediate_size=96: the save's layers.0.feed_forward.w1.weight says 56"),
])
def test_what_the_save_cannot_say_is_asked_for_in_one_line(given: list[str], message: str, tmp_path: Path, run_ckptkit: Cli) -> None:
    dst = tmp_path / "out"
    result = run_ckptkit("convert", "--from", "torchtitan", str(SAVE), str(dst), *given)
    assert result.returncode == 1 and message in one_line_error(result.stderr)
    assert_nothing_written(tmp_path, dst)


def test_the_defaults_assumed_are_said(tmp_path: Path, run_ckptkit: Cli) -> None:
    result = run_ckptkit("convert", str(SAVE), str(tmp_path / "out"), "--model-config", "num_attention_heads=4")
    assert result.returncode == 0, result.stderr
    assert ("ckptkit: warning: the model's rope_theta 500000.0, rms_norm_eps 1e-05, max_position_embeddings 8192 assumed, "
            "torchtitan's Llama 3 defaults") in result.stderr


def test_older_names_are_refused_naming_what_they_lack() -> None:
    with pytest.raises(LayoutError, match=r"not torchtitan's Llama 3 or Qwen3 \(0\.3\): no layers\.0\.attention\.qkv_linear\.wq\.weight.*"
                                          r"attention\.wq without qkv_linear: torchtitan before 0\.3"):
        config_of({"tok_embeddings.weight": (101, 48), "layers.0.attention.wq.weight": (48, 48)}, GIVEN)


def _job(*args: str) -> None:
    done = subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_mid_run_save_brings_its_optimizer_in_under_the_parameters_names(tmp_path: Path) -> None:
    dst = tmp_path / "converted"
    report = ckptkit.convert(FULL, dst, config=GIVEN)
    manifest = ckptkit.read_manifest(dst)
    assert report.step == manifest.step == 2 and report.skipped == []
    optimizer = manifest.info.optimizer
    assert optimizer is not None and (optimizer.type, optimizer.step) == ("adamw", 2)
    assert optimizer.hyperparameters == {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert len(optimizer.param_groups) == 1 and len(optimizer.param_groups[0].params) == 17  # the modules': wqkv fused
    assert manifest.info.data_progress is not None and manifest.info.data_progress.consumed_tokens == 32
    state = ckptkit.load(dst)
    assert sorted(state["optimizer"]) == ["exp_avg", "exp_avg_sq", "param_groups", "state"]
    assert sorted(state["optimizer"]["exp_avg"]) == sorted(state["model"])  # each parameter's, cut as it is
    saved = {f"optimizer.state.layers.{i}.attention.qkv_linear.wqkv.weight.{m}": torch.empty(64, 32)
             for i in (0, 1) for m in ("exp_avg", "exp_avg_sq")}
    dcp.load(saved, checkpoint_id=str(FULL), no_dist=True)
    split = _torchtitans_split(saved)
    for key, want in split.items():
        moment, name = key.rpartition(".")[2], key.removeprefix("optimizer.state.").rpartition(".")[0]
        assert torch.equal(state["optimizer"][moment][name], want), key


def _torchtitans_split(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torchtitan's own split of its fused wqkv (``FusedQKVLinear``'s save hook) of each moment:
    wq, wk, wv as torchtitan saves the parameter; without torchtitan, the same reshape written out."""
    out = {}
    for key, tensor in saved.items():
        prefix, moment = key.removesuffix(".weight." + key.rpartition(".")[2]).removesuffix("wqkv"), key.rpartition(".")[2]
        sd = {"wqkv.weight": tensor}
        if importlib.util.find_spec("torchtitan") is not None:
            from torchtitan.models.common.attention import FusedQKVLinear

            FusedQKVLinear._split_qkv_on_save(SimpleNamespace(head_dim=8, heads_per_kv=2, r_dim=4), sd, "", None)
        else:
            w = tensor.reshape(2, 4, 8, 32)
            sd = {"wq.weight": w[:, :2].reshape(-1, 32), "wk.weight": w[:, 2].reshape(-1, 32), "wv.weight": w[:, 3].reshape(-1, 32)}
        out |= {f"{prefix}{name.removesuffix('.weight')}.weight.{moment}": value for name, value in sd.items()}
    return out


@needs_torchtitan
def test_torchtitan_resumes_from_the_resharded_export_with_the_originals_next_step(tmp_path: Path) -> None:
    converted, resharded, root = tmp_path / "converted", tmp_path / "tp2pp2", tmp_path / "job"
    ckptkit.convert(FULL, converted, config=GIVEN)
    ckptkit.reshard(converted, resharded, Topology(world_size=4, tp=2, pp=2, dp=1), update_latest=False)
    report = ckptkit.export(resharded, root / "checkpoint" / "step-2", format="torchtitan", include_optimizer=True)
    assert report.skipped == [] and report.warnings == []
    _job("resume", str(FIXTURES / "full"), str(tmp_path / "original.pt"))
    _job("resume", str(root), str(tmp_path / "exported.pt"))
    want, got = (torch.load(tmp_path / f, weights_only=True) for f in ("original.pt", "exported.pt"))
    assert _differences(want, got) == []
    assert got["train_state"] == {"step": 3, "ntokens_seen": 48} and got["lr_scheduler"] == {"last_epoch": 3}


def _differences(want: Any, got: Any, at: str = "") -> list[str]:
    if isinstance(want, dict):
        if not isinstance(got, dict) or sorted(want) != sorted(got):
            return [f"{at}: keys"]
        return [d for k in want for d in _differences(want[k], got[k], f"{at}.{k}")]
    if isinstance(want, torch.Tensor):
        return [] if isinstance(got, torch.Tensor) and want.dtype == got.dtype and torch.equal(want, got) else [at]
    return [] if want == got else [f"{at}: {want!r} != {got!r}"]


@needs_torchtitan
@pytest.mark.parametrize(("model", "tied"), [("llama3", False), ("llama3", True), ("qwen3", False)],
                         ids=["llama", "llama-tied", "qwen3"])
def test_a_hugging_face_model_exported_to_torchtitan_runs_there_with_its_logits(model: str, tied: bool, tmp_path: Path) -> None:
    sizes = json.loads((FIXTURES / f"{model}.oracle" / "config.json").read_text()) | {"tie_word_embeddings": tied}  # non-square
    torch.manual_seed(3)
    original = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**sizes)).eval()
    original.save_pretrained(tmp_path / "hf")
    ckptkit.convert(tmp_path / "hf", tmp_path / "converted")
    ckptkit.reshard(tmp_path / "converted", tmp_path / "tp2", Topology(world_size=2, tp=2, pp=1, dp=1), update_latest=False)
    ckptkit.export(tmp_path / "tp2", tmp_path / "titan", format="torchtitan")
    (tmp_path / "config.json").write_text(json.dumps(sizes))
    ids = load_file(str(ORACLE / "logits.safetensors"))["ids"]
    _job("logits", str(tmp_path / "titan"), str(tmp_path / "config.json"), str(ORACLE / "logits.safetensors"), str(tmp_path / "l.st"))
    with torch.no_grad():
        want = original(ids).logits
    assert (load_file(str(tmp_path / "l.st"))["logits"] - want).abs().max().item() <= 1e-5


@needs_torchtitan
def test_the_fixtures_script_writes_the_committed_saves(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(FIXTURES.parent / "make_torchtitan.py"), "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    made = tmp_path / "torchtitan"
    files = sorted(p.relative_to(FIXTURES) for p in FIXTURES.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(made) for p in made.rglob("*") if p.is_file())
    for path in files:  # a .metadata differs in DCP's own random save id only
        if path.name == ".metadata":
            from torch.distributed.checkpoint import FileSystemReader

            assert (FileSystemReader(str(made / path.parent)).read_metadata().state_dict_metadata
                    == FileSystemReader(str(FIXTURES / path.parent)).read_metadata().state_dict_metadata), path
        else:
            assert (made / path).read_bytes() == (FIXTURES / path).read_bytes(), path
