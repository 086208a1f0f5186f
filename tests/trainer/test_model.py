"""Single-process pieces of the reference trainer: model, loss, data, sampler, learning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ckptkit.trainer.config import model_config
from ckptkit.trainer.data import Sampler, Tokenizer, generate_corpus
from ckptkit.trainer.model import Stage
from ckptkit.trainer.tp import TPContext, parallel_cross_entropy
from ckptkit.trainer.train import config_from, launch, prepare


def test_parallel_cross_entropy_matches_torch_at_tp_1() -> None:
    cfg = model_config("tiny", vocab_size=Tokenizer().vocab_size)
    stage = Stage(cfg, TPContext(1, 0), pp_rank=0, pp=1, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = stage(ids[:, :-1]).reshape(-1, cfg.vocab_size)
    ours = parallel_cross_entropy(logits, ids[:, 1:].reshape(-1), stage.output_head())
    theirs = F.cross_entropy(logits, ids[:, 1:].reshape(-1), reduction="none")
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_stage_parameters_cover_every_logical_name_once() -> None:
    from ckptkit.trainer.engine import module_params

    cfg = model_config("tiny", vocab_size=98)
    names = []
    for pp_rank in range(2):
        stage = Stage(cfg, TPContext(1, 0), pp_rank=pp_rank, pp=2, seed=1)
        for module in {id(m): m for m in stage.units()}.values():
            names += [part.name for _, _, parts in module_params(module) for part in parts]
    assert sorted(names) == sorted(cfg.layout().tensors())


def test_tokenizer_round_trips_text_and_saves_its_vocabulary(tmp_path: Path) -> None:
    tok = Tokenizer()
    text = generate_corpus(seed=1, sentences=5)
    assert tok.decode(tok.encode(text).tolist()) == text
    doc = json.loads(Path(tok.save(str(tmp_path))).read_text())
    assert doc["model"]["vocab"] == tok.vocab and len(tok.vocab) == 98


def test_sampler_order_does_not_depend_on_how_the_batches_are_split() -> None:
    whole = Sampler(num_samples=10, seed=5)
    ids = []
    for _ in range(3):  # 3 steps of 8 samples cross two epoch boundaries
        ids += whole.next_ids(8)
        whole.advance(8, 8 * 4)
    stepwise = Sampler(num_samples=10, seed=5)
    again = []
    for _ in range(6):
        again += stepwise.next_ids(4)
        stepwise.advance(4, 4 * 4)
    assert ids == again
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:20]) == list(range(10))
    assert whole.epoch == 2 and whole.consumed_tokens == 96


def test_the_model_learns(tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    cfg = config_from(steps=60, out=str(tmp_path / "run"), log_jsonl=str(log), lr=3e-3, total_steps=60)
    prepare(cfg)
    launch(cfg)
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_a_failing_rank_becomes_one_clear_error(tmp_path: Path) -> None:
    from ckptkit.errors import CkptkitError

    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = config_from(dp=2, steps=1, out=str(tmp_path / "run"), log_jsonl=str(blocker / "log.jsonl"))
    prepare(cfg)
    with pytest.raises(CkptkitError, match=r"rank 0 failed: .*(Not a directory|File exists)"):
        launch(cfg)
