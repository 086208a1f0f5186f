"""A weights-only start (train --init-from): the parameters of any checkpoint, a converted Hugging
Face Llama included, at any topology; optimizer, schedule, sampler and RNG new at step 0."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.trainer.data import Tokenizer, load_dataset
from ckptkit.trainer.train import config_from, launch, prepare

from .runs import train

transformers = pytest.importorskip("transformers")

SMALL_HF = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, rope_theta=50000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                initializer_range=0.2)  # far from uniform logits, so that a wrong weight shows in the loss


def _hf_model(directory: Path, **config: Any) -> Any:
    """A small LlamaForCausalLM (no download), saved with save_pretrained into `directory`."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL_HF, **config})).eval()
    model.save_pretrained(str(directory))
    return model


def _converted(root: Path, **config: Any) -> tuple[Any, Path]:
    model = _hf_model(root / "hf", **config)
    ckptkit.convert(str(root / "hf"), str(root / "converted"))
    return model, root / "converted"


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The Hugging Face model and its conversion (layout hf-llama)."""
    return _converted(tmp_path_factory.mktemp("init-hf"))


def _hf_loss(model: Any, sample_ids: list[int]) -> float:
    """The Hugging Face model's mean next-token loss on exactly the samples a trainer step took."""
    dataset, _ = load_dataset(None, Tokenizer(), 32, seed=1234)
    batch = torch.stack([dataset.sample(i) for i in sample_ids])
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))


@pytest.mark.multiprocess
@pytest.mark.parametrize("combo", [(1, 1, 1, 0), (2, 2, 1, 0), (1, 1, 2, 3)], ids=["tp1", "tp2-pp2", "dp2-zero3"])
def test_step_one_loss_is_the_hf_models_loss_on_the_same_batch(
    hf: tuple[Any, Path], tmp_path: Path, combo: tuple[int, int, int, int], run_ckptkit: Any
) -> None:
    model, converted = hf
    tp, pp, dp, zero = combo
    proc = run_ckptkit("train", "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--zero", str(zero), "--steps", "1",
                       "--out", str(tmp_path / "run"), "--init-from", str(converted), "--log-jsonl", str(tmp_path / "log.jsonl"),
                       "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        f"ckptkit: train: starting from the weights of {converted} (step 0, hf-llama: hidden 64, 4 layers, 8 heads (4 kv), "
        f"vocabulary 128) at tp={tp} pp={pp} dp={dp} zero={zero}; new optimizer, schedule, sampler and RNG; training steps 1-1"]
    first = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["consumed_samples"] == 8
    expected = _hf_loss(model, first["sample_ids"])
    assert abs(first["loss"] - expected) <= 1e-5
    assert abs(expected - 4.852) > 0.1  # not the loss of uniform logits (ln 128): the weights carry it


@pytest.mark.multiprocess
def test_a_tied_hf_model_starts_at_tp2_with_its_loss(tmp_path: Path) -> None:
    model, converted = _converted(tmp_path, tie_word_embeddings=True)
    assert "model/lm_head.weight" not in ckptkit.read_manifest(str(converted)).tensors
    first = train(tmp_path / "run", (2, 1, 1, 0), 1, init_from=str(converted))[0]
    assert abs(first["loss"] - _hf_loss(model, first["sample_ids"])) <= 1e-5


@pytest.fixture(scope="module")
def started(hf: tuple[Any, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank run from the converted model, 2 steps, saved at step 2."""
    root = tmp_path_factory.mktemp("init-run") / "run"
    cfg = config_from(steps=2, save_every=2, out=str(root), init_from=str(hf[1]))
    launch(cfg, prepare(cfg))
    return root


def test_the_run_records_its_parent_and_starts_everything_else_new(hf: tuple[Any, Path], started: Path) -> None:
    source = ckptkit.read_manifest(str(hf[1]))
    manifest = ckptkit.read_manifest(str(started / "step_00000002"))
    assert manifest.step == 2
    assert manifest.info.config is not None and manifest.info.config["parent"] == {
        "path": str(hf[1]), "checkpoint_id": source.checkpoint_id, "step": 0, "family": "hf-llama"}
    assert manifest.info.config["init_from"] == str(hf[1]) and manifest.info.config["model"] is None
    assert manifest.info.optimizer is not None and manifest.info.optimizer.step == 2
    assert manifest.info.data_progress is not None and manifest.info.data_progress.consumed_samples == 16
    assert manifest.info.model is not None and manifest.info.model.family == "llama"
    assert {k: manifest.info.model.config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "rope_theta")} == {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_layers": 4, "rope_theta": 50000.0}
    run = json.loads((started / "run.json").read_text())
    assert run["parent"] == str(hf[1]) and run["model"] == "llama from hf-llama"


@pytest.mark.multiprocess
def test_a_resume_of_the_run_keeps_its_model_and_parent(hf: tuple[Any, Path], started: Path, tmp_path: Path) -> None:
    records = train(tmp_path / "more", (2, 1, 1, 0), 3, resume=str(started / "step_00000002"))
    assert [r["step"] for r in records] == [3]
    manifest = ckptkit.read_manifest(str(tmp_path / "more" / "step_00000003"))
    lineage = (manifest.info.config or {}).get("parent")
    assert isinstance(lineage, dict) and lineage["checkpoint_id"] == ckptkit.read_manifest(str(hf[1])).checkpoint_id
    assert manifest.info.model is not None and manifest.info.model.config["intermediate_size"] == 96


def test_the_parameters_are_the_sources_before_the_first_update(hf: tuple[Any, Path], tmp_path: Path) -> None:
    """With lr 0 the first save holds exactly the source's weights, under the trainer's names."""
    cfg = config_from(steps=1, save_every=1, out=str(tmp_path / "run"), init_from=str(hf[1]), lr=0.0)
    launch(cfg, prepare(cfg))
    saved = ckptkit.load(str(tmp_path / "run" / "step_00000001"))["model"]
    source = hf[0].state_dict()
    assert torch.equal(saved["layers.3.attn.k.weight"], source["model.layers.3.self_attn.k_proj.weight"])
    assert torch.equal(saved["embed.weight"], source["model.embed_tokens.weight"])
    assert torch.equal(saved["lm_head.weight"], source["lm_head.weight"])


@pytest.mark.multiprocess
def test_a_trainer_checkpoint_starts_another_run_at_another_topology(tmp_path: Path) -> None:
    """The trainer's own checkpoint (saved at tp 2) as the source of a run at step 0 with lr 0: the
    saved parameters are the source's."""
    train(tmp_path / "src", (2, 1, 1, 0), 2)
    cfg = config_from(steps=1, save_every=1, out=str(tmp_path / "run"), init_from=str(tmp_path / "src" / "step_00000002"), lr=0.0)
    start = prepare(cfg)
    assert start.step == 0 and start.resume is None and start.model is not None and start.model.hidden_size == 64
    launch(cfg, start)
    before = ckptkit.load(str(tmp_path / "src" / "step_00000002"))["model"]
    after = ckptkit.load(str(tmp_path / "run" / "step_00000001"))["model"]
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)


def _refused(run_ckptkit: Any, out: Path, *args: str) -> str:
    proc = run_ckptkit("train", "--out", str(out), "--steps", "1", "--save-every", "1", "--quiet", *args)
    assert proc.returncode == 1, proc.stderr
    assert not out.exists()
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptkit: error: ")
    return str(lines[0])


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path: Path, run_ckptkit: Any) -> None:
    _, converted = _converted(tmp_path, vocab_size=64)
    line = _refused(run_ckptkit, tmp_path / "run", "--init-from", str(converted))
    assert "its vocabulary (64 tokens) is smaller than the trainer's tokenizer (98)" in line


def test_attention_biases_the_trainer_does_not_build_are_refused(tmp_path: Path, run_ckptkit: Any) -> None:
    _, converted = _converted(tmp_path, attention_bias=True)
    line = _refused(run_ckptkit, tmp_path / "run", "--init-from", str(converted))
    assert "attention_bias True (the trainer builds False)" in line


def test_a_model_of_another_size_than_asked_is_refused(hf: tuple[Any, Path], tmp_path: Path, run_ckptkit: Any) -> None:
    line = _refused(run_ckptkit, tmp_path / "run", "--init-from", str(hf[1]), "--model", "small")
    assert "its model is not --model small: hidden_size 64 (--model small: 256)" in line
    line = _refused(run_ckptkit, tmp_path / "run", "--init-from", str(hf[1]), "--tie-embeddings")
    assert "--tie-embeddings, but its embedding and output head are separate" in line


def test_a_checkpoint_of_no_llama_is_refused(tmp_path: Path, run_ckptkit: Any) -> None:
    ckptkit.save({"model": {"w": torch.ones(4)}}, tmp_path / "plain", step=3)
    line = _refused(run_ckptkit, tmp_path / "run", "--init-from", str(tmp_path / "plain"))
    assert line == (f"ckptkit: error: {tmp_path / 'plain'}: --init-from needs a Llama checkpoint (the trainer's own, or a "
                    "Hugging Face Llama converted by ckptkit convert); its model family is none (no info.model)")


def test_init_from_with_resume_needs_resume_if_present(hf: tuple[Any, Path], tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("train", "--out", str(tmp_path / "run"), "--init-from", str(hf[1]), "--resume", "latest", "--quiet")
    assert proc.returncode == 2 and "--resume-if-present" in proc.stderr and not (tmp_path / "run").exists()
    proc = run_ckptkit("train", "--out", str(tmp_path / "run"), "--init-from", str(tmp_path / "nothing"), "--quiet")
    assert proc.returncode == 2 and not (tmp_path / "run").exists()


def test_resume_if_present_starts_from_init_from_then_resumes(hf: tuple[Any, Path], tmp_path: Path) -> None:
    options = dict(save_every=1, out=str(tmp_path / "run"), init_from=str(hf[1]), resume="latest", resume_if_present=True)
    first = prepare(config_from(steps=1, **options))
    assert first.init_from == str(hf[1]) and first.resume is None
    launch(config_from(steps=1, **options), first)
    again = prepare(config_from(steps=2, **options))
    assert again.resume == str(tmp_path / "run" / "step_00000001") and again.init_from is None and again.step == 1
    assert again.parent is not None and again.parent["family"] == "hf-llama"
