"""``ckptkit convert`` of a torchtitan checkpoint: a real save by torchtitan 0.3.0's own
``CheckpointManager`` of its Llama 3 (``fixtures/make_torchtitan.py``) comes in under
torchtitan's names, laid out by its view of the canonical model (q and k rows in the original
Llama's rotary order), reshards to tp 2 x pp 2 and exports to Hugging Face with logits equal to
torchtitan's own forward, and to Megatron-Core and back bitwise; what torchtitan does not
record is asked for in one line."""

from __future__ import annotations

import json
from collections.abc import Callable
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
    saved = {wq: torch.empty(48, 48), wv: torch.empty(24, 48)}
    dcp.load(saved, checkpoint_id=str(SAVE), no_dist=True)
    hf = load_file(str(next(out.glob("*.safetensors"))))
    assert torch.equal(hf["model.layers.0.self_attn.v_proj.weight"], saved[wv])
    q = hf["model.layers.0.self_attn.q_proj.weight"].view(4, 2, 6, 48)
    assert torch.equal(q.transpose(1, 2).reshape(48, 48), saved[wq])


def test_exported_to_megatron_and_back_the_tensors_are_bitwise_the_same(tmp_path: Path) -> None:
    converted = _converted(tmp_path)
    ckptkit.export(converted, tmp_path / "hf", format="hf")
    ckptkit.export(converted, tmp_path / "mcore", format="megatron", tp=2)
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
    assert q[:12] == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11] and q[12:18] == [12, 14, 16, 18, 20, 22] and sorted(q) == list(range(48))
    there = _rows(compose(spec, hf_view(spec), torchtitan_view(spec))["layers.1.attention.qkv_linear.wk.weight"])
    assert there[:12] == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11] and sorted(there) == list(range(24))
    assert compose(spec, hf_view(spec), torchtitan_view(spec))["layers.0.feed_forward.w3.weight"][0].count == 80  # whole
    assert placed(spec, torchtitan_view(spec)).shapes["layers.0.attention.qkv_linear.wk.weight"] == (24, 48)


@pytest.mark.parametrize(("given", "message"), [
    ([], "a torchtitan checkpoint does not record its attention heads: give --model-config num_attention_heads=N"),
    (["--model-config", "num_attention_heads=5"], "num_attention_heads 5 does not divide the 48 rows of "
                                                   "layers.0.attention.qkv_linear.wq.weight"),
    (["--model-config", "num_attention_heads=4", "--model-config", "intermediate_size=96"],
     "--model-config intermediate_size=96: the save's layers.0.feed_forward.w1.weight says 80"),
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
            "torchtitan Llama 3's defaults") in result.stderr


def test_older_names_are_refused_naming_what_they_lack() -> None:
    with pytest.raises(LayoutError, match=r"not torchtitan's Llama 3 \(0\.3\): no layers\.0\.attention\.qkv_linear\.wq\.weight.*"
                                          r"attention\.wq without qkv_linear: torchtitan before 0\.3"):
        config_of({"tok_embeddings.weight": (101, 48), "layers.0.attention.wq.weight": (48, 48)}, GIVEN)
