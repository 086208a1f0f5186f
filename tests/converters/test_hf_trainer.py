"""A Hugging Face ``Trainer`` checkpoint folder (written at test time by transformers' own Trainer,
a few steps of a tiny Llama on CPU) converts whole: the weights, the AdamW moments under the
parameters' names as Trainer grouped them, the step, the scheduler, the RNG states and the trainer
state, the training arguments; a class their pickle names that is not allowed is listed and fails
the conversion unless --allow-skip."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit

from .checks import assert_nothing_written

if importlib.util.find_spec("accelerate") is None:  # Trainer needs it; make test installs it
    if os.environ.get("CI"):
        raise RuntimeError("accelerate is not installed (make test installs it with the dev extras)")
    pytest.skip("accelerate is not installed", allow_module_level=True)

STEPS = 4


def _trainer(out: Path, steps: int = STEPS) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=12, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(0, 101, (16,), generator=gen)), "labels": ids.clone()} for _ in range(24)]
    args = TrainingArguments(output_dir=str(out), max_steps=steps, save_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=1e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=1, report_to=[],
                             use_cpu=True, seed=3, disable_tqdm=True, logging_strategy="no")
    return Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint-4/`` as Trainer saves it."""
    out = tmp_path_factory.mktemp("trainer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(out).train()
    return out / f"checkpoint-{STEPS}"


def test_a_class_the_arguments_name_that_is_not_allowed_is_listed_and_fails_the_conversion(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.errors import ManifestError
    from ckptkit_adapters.hf import trainer
    from ckptkit_adapters.hf.reader import CONVERTER

    allowed = {k: v for k, v in trainer.ARGS_ALLOWED.items() if k != ("transformers.trainer_utils", "SchedulerType")}
    monkeypatch.setattr(trainer, "ARGS_ALLOWED", allowed)  # as a transformers that pickles a class ckptkit does not know
    with pytest.raises(ManifestError, match=r"1 entry cannot be converted \(training_args.bin: refused to unpickle "
                                            r"transformers.trainer_utils.SchedulerType.*pass --allow-skip"):
        CONVERTER.convert(str(folder), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")
    report = CONVERTER.convert(str(folder), str(tmp_path / "out"), allow_skip=True)
    assert [s.name for s in report.skipped] == ["training_args.bin"]


def test_the_optimizer_scheduler_step_and_state_come_in_as_trainer_keeps_them(folder: Path, tmp_path: Path,
                                                                             run_ckptkit: Any) -> None:
    proc = run_ckptkit("convert", "--json", str(folder), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["skipped"] == []  # every file of the folder came in
    manifest, state = ckptkit.read_manifest(tmp_path / "out"), ckptkit.load(tmp_path / "out")
    assert manifest.step == STEPS
    assert manifest.objects["trainer/state"] == json.loads((folder / "trainer_state.json").read_text())
    scheduler = torch.load(folder / "scheduler.pt", weights_only=True)
    assert manifest.info.scheduler == json.loads(json.dumps(scheduler))  # as JSON: tuples as lists
    # the oracle: Trainer's own optimizer over the model, its groups' parameters named by the model
    trainer = _trainer(tmp_path / "unused")
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    grouped = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    index = [name for group in grouped for name in group]
    assert len(index) == len(saved["state"]) == 21
    for i, name in enumerate(index):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optimizer"][moment][name], saved["state"][i][moment]), (moment, name)
    info = manifest.info.optimizer
    assert info is not None and info.type == "adamw" and info.step == STEPS
    assert [list(g.params) for g in info.param_groups] == grouped
    assert [g.options["weight_decay"] for g in info.param_groups] == [0.1, 0.0]
    assert info.hyperparameters == {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    weights = {k: v for k, v in state["model"].items()}
    for name, parameter in trainer.model.named_parameters():  # the weights are the saved model's (fresh init differs)
        assert weights[name].shape == parameter.shape
    # the RNG states: torch's bitwise, Python's and numpy's as values
    rng = torch.load(folder / "rng_state.pth", weights_only=False)  # the oracle: torch's own unpickling of the file
    assert torch.equal(state["rng"]["rng_state"]["cpu"], rng["cpu"])
    assert manifest.objects["trainer/rng_state/python"] == [rng["python"][0], list(rng["python"][1]), rng["python"][2]]
    name, key, *rest = manifest.objects["trainer/rng_state/numpy"]
    assert (name, key, rest) == (rng["numpy"][0], rng["numpy"][1].tolist(), list(rng["numpy"][2:]))
    # the training arguments: their fields, enums as their values
    args = torch.load(folder / "training_args.bin", weights_only=False)  # the oracle: transformers' own class
    got = manifest.objects["trainer/training_args"]
    for field in ("learning_rate", "weight_decay", "max_steps", "seed", "warmup_steps", "per_device_train_batch_size"):
        assert got[field] == getattr(args, field), field
    assert (got["lr_scheduler_type"], got["save_strategy"]) == (args.lr_scheduler_type.value, args.save_strategy.value)


def _resumed(checkpoint: Path, out: Path) -> tuple[float, int, list[torch.Tensor]]:
    """Trainer resumed from `checkpoint` to step 6: its training loss, step and parameters."""
    trainer = _trainer(out, steps=STEPS + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainer.train(resume_from_checkpoint=str(checkpoint))
    return result.training_loss, result.global_step, [p.detach().clone() for p in trainer.model.parameters()]


def test_trainer_resumes_from_the_export_as_from_the_original(folder: Path, tmp_path: Path, run_ckptkit: Any) -> None:
    # in, resharded to tp 2 x pp 2 (weights and moments cut as the layout says), and back out
    converted, resharded, out = tmp_path / "run" / "converted", tmp_path / "run" / "resharded", tmp_path / "trainer"
    assert run_ckptkit("convert", str(folder), str(converted)).returncode == 0
    proc = run_ckptkit("reshard", str(converted), str(resharded), "--tp", "2", "--pp", "2")
    assert proc.returncode == 0, proc.stderr
    topology = ckptkit.read_manifest(resharded).topology
    assert (topology.tp, topology.pp) == (2, 2)
    proc = run_ckptkit("export", str(resharded), str(out), "--format", "hf-trainer")
    assert proc.returncode == 0, proc.stderr
    # the files Trainer reads on resume hold what the original's hold
    ours, theirs = (torch.load(p / "optimizer.pt", weights_only=True) for p in (out, folder))
    assert ours["param_groups"] == theirs["param_groups"] and sorted(ours["state"]) == sorted(theirs["state"])
    for i, moments in theirs["state"].items():
        assert all(torch.equal(ours["state"][i][k], v) for k, v in moments.items()), i
    assert torch.load(out / "scheduler.pt", weights_only=True) == torch.load(folder / "scheduler.pt", weights_only=True)
    assert json.loads((out / "trainer_state.json").read_text()) == json.loads((folder / "trainer_state.json").read_text())
    ours_rng, theirs_rng = (torch.load(p / "rng_state.pth", weights_only=False) for p in (out, folder))
    assert ours_rng["python"] == theirs_rng["python"] and torch.equal(ours_rng["cpu"], theirs_rng["cpu"])
    assert ours_rng["numpy"][0] == theirs_rng["numpy"][0] and (ours_rng["numpy"][1] == theirs_rng["numpy"][1]).all()
    # and Trainer, resumed from each and trained two more steps, ends in the same place
    loss, step, params = _resumed(folder, tmp_path / "from-original")
    loss_back, step_back, params_back = _resumed(out, tmp_path / "from-export")
    assert (step, step_back) == (STEPS + 2, STEPS + 2) and abs(loss_back - loss) <= 1e-6 * abs(loss)
    assert all(torch.equal(a, b) for a, b in zip(params_back, params))


def test_a_checkpoint_not_converted_from_a_trainer_folder_is_refused(tmp_path: Path, run_ckptkit: Any) -> None:
    from .checks import one_line_error

    src = Path(__file__).resolve().parents[2] / "fixtures" / "llama-v1.1" / "step_00000005"
    proc = run_ckptkit("export", str(src), str(tmp_path / "out"), "--format", "hf-trainer")
    assert proc.returncode == 1
    line = one_line_error(proc.stderr)
    assert "a Trainer folder is written from a checkpoint converted from one, and this one has" in line
    assert "no Trainer state (trainer/state" in line
    assert_nothing_written(tmp_path, tmp_path / "out")
