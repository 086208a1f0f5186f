"""``ckptkit export --format dcp`` in its fsdp2 form: exactly the keys torch's ``get_state_dict``
gives for the reference trainer's model, its values fused as the model fuses them, an FSDP2 job
of 2 ranks resuming it with the trainer's losses; the plain form on request; the refusals."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptkit
from ckptkit.errors import LayoutError
from ckptkit.exports.adamw import next_lr
from ckptkit.exports.run import export
from ckptkit_adapters.common.dcp_read import dcp_key
from ckptkit.trainer.config import TrainConfig, model_config
from ckptkit.trainer.data import Tokenizer
from ckptkit.trainer.engine import learning_rate
from ckptkit.trainer.model import Stage
from ckptkit.trainer.tp import TPContext

from .fsdp2_job import optimizer
from .trainer.runs import train

STEPS = 7  # saves at 4 and 7: the job resumes at 4 and trains 5, 6, 7
RESUMED = 4
LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "llama-v1.1"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A reference-trainer run of one process (its checkpoints and log records)."""
    out = tmp_path_factory.mktemp("fsdp2") / "run"
    return out, train(out, (1, 1, 1, 0), STEPS)


@pytest.fixture(scope="module")
def exported(run: tuple[Path, list[dict[str, Any]]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("fsdp2-export") / "dcp"
    report = export(run[0] / f"step_{RESUMED:08d}", dst, format="dcp", include_optimizer=True)
    assert report.form == "fsdp2" and report.format == "dcp"
    return dst


def _model() -> tuple[Stage, torch.optim.AdamW]:
    """The trainer's model as one plain module, torch's AdamW in the trainer's groups, a scheduler attached."""
    cfg = TrainConfig()
    model = Stage(model_config("tiny", vocab_size=Tokenizer().vocab_size), TPContext(1, 0), pp_rank=0, pp=1, seed=99)
    opt = optimizer(model, cfg)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0)
    return model, opt


def test_the_keys_shapes_and_dtypes_are_those_of_torchs_get_state_dict(exported: Path) -> None:
    model, opt = _model()
    model_sd, optim_sd = get_state_dict(model, opt)
    want, _ = flatten_state_dict({"model": model_sd, "optim": optim_sd})
    got = FileSystemReader(str(exported)).read_metadata().state_dict_metadata
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert (tuple(got[key].size), got[key].properties.dtype) == (tuple(value.shape), value.dtype), key  # type: ignore[union-attr]
        else:
            assert isinstance(got[key], BytesStorageMetadata), key


def test_loaded_with_set_state_dict_the_model_and_optimizer_hold_the_checkpoint(
    run: tuple[Path, list[dict[str, Any]]], exported: Path
) -> None:
    saved = ckptkit.load(str(run[0] / f"step_{RESUMED:08d}"))
    model, opt = _model()
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(exported), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    m, exp_avg = saved["model"], saved["optimizer"]["exp_avg"]
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.1.attn.qkv.weight"],
                       torch.cat([m[f"layers.1.attn.{n}.weight"] for n in ("q", "k", "v")]))
    assert torch.equal(params["layers.3.mlp.gate_up.weight"], torch.cat([m["layers.3.mlp.gate.weight"], m["layers.3.mlp.up.weight"]]))
    assert torch.equal(params["head.weight"], m["lm_head.weight"]) and torch.equal(params["norm.weight"], m["norm.weight"])
    qkv = opt.state[params["layers.2.attn.qkv.weight"]]
    assert torch.equal(qkv["exp_avg"], torch.cat([exp_avg[f"layers.2.attn.{n}.weight"] for n in ("q", "k", "v")]))
    assert torch.equal(opt.state[params["embed.weight"]]["exp_avg_sq"], saved["optimizer"]["exp_avg_sq"]["embed.weight"])
    assert {float(s["step"]) for s in opt.state.values()} == {float(RESUMED)} and len(opt.state) == len(params)
    next_step = run[1][RESUMED]  # the log record of step RESUMED + 1
    assert [g["lr"] for g in opt.param_groups] == [next_step["lr"]] * 2
    assert [(g["weight_decay"], g["initial_lr"], g["betas"], g["eps"]) for g in opt.param_groups] == [
        (0.1, 3e-3, (0.9, 0.95), 1e-8), (0.0, 3e-3, (0.9, 0.95), 1e-8)]
    assert [len(g["params"]) for g in opt.param_groups] == [2 + 4 * 4, 1 + 2 * 4]


def test_without_the_optimizer_only_the_model_and_with_a_dtype_converted(run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    report = export(run[0], tmp_path / "bf16", format="dcp", dtype="bf16")
    metadata = FileSystemReader(str(tmp_path / "bf16")).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in metadata} == {"model"} and len(metadata) == 3 + 6 * 4
    assert {m.properties.dtype for m in metadata.values()} == {torch.bfloat16}  # type: ignore[union-attr]
    assert report.tensor_list[0].source == "model/embed.weight" and "optimizer/exp_avg/embed.weight" in {e.name for e in report.skipped}


def test_the_plain_form_keeps_the_checkpoints_names(run: tuple[Path, list[dict[str, Any]]], tmp_path: Path, run_ckptkit: Any) -> None:
    done = run_ckptkit("export", str(run[0]), str(tmp_path / "plain"), "--format", "dcp", "--dcp-form", "plain", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["form"] == "plain"
    keys = set(FileSystemReader(str(tmp_path / "plain")).read_metadata().state_dict_metadata)
    manifest = ckptkit.read_manifest(str(run[0]))
    kept = {fqn for fqn, t in manifest.tensors.items() if t.kind != "optimizer"} | set(manifest.objects)  # all but the optimizer's
    assert keys == {dcp_key(name) for name in kept}
    assert "model.layers.0.attn.q.weight" in keys and "model.lm_head.weight" in keys
    assert len([k for k in keys if k.startswith("model.")]) == 3 + 9 * 4


def test_a_checkpoint_of_another_model_is_refused_naming_the_plain_form(tmp_path: Path, run_ckptkit: Any) -> None:
    ckptkit.save({"model": {"w": torch.ones(3, 2)}}, tmp_path / "src", step=1)
    with pytest.raises(LayoutError, match="--dcp-form plain"):
        export(tmp_path / "src", tmp_path / "out", format="dcp", dcp_form="fsdp2")
    done = run_ckptkit("export", str(tmp_path / "src"), str(tmp_path / "out"), "--format", "dcp", "--dcp-form", "fsdp2")
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "--dcp-form plain" in done.stderr
    bad = run_ckptkit("export", str(tmp_path / "src"), str(tmp_path / "out"), "--format", "hf", "--dcp-form", "plain")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--dcp-form" in bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "src"]


def test_the_default_form_is_fsdp2_for_the_trainers_model_and_plain_for_any_other(tmp_path: Path) -> None:
    ckptkit.save({"model": {"w": torch.ones(3, 2)}}, tmp_path / "src", step=1)
    other = export(tmp_path / "src", tmp_path / "out", format="dcp")
    assert other.form == "plain" and [t.name for t in other.tensor_list] == ["model.w"]
    trainer = export(LLAMA, tmp_path / "llama", format="dcp")
    assert trainer.form == "fsdp2" and "model.layers.0.attn.qkv.weight" in {t.name for t in trainer.tensor_list}


def test_the_next_learning_rate_follows_the_trainers_schedule() -> None:
    cfg = TrainConfig()
    schedule = {"type": "warmup-cosine", "lr": cfg.lr, "min_lr": cfg.min_lr, "warmup_steps": cfg.warmup_steps,
                "total_steps": cfg.total_steps}
    assert [next_lr(schedule, s, 1.0) for s in (1, 5, 6, 150, 300, 400)] == [learning_rate(cfg, s) for s in (1, 5, 6, 150, 300, 400)]
    assert next_lr(None, 7, 0.5) == next_lr({"type": "other"}, 7, 0.5) == 0.5


@pytest.mark.multiprocess
def test_an_fsdp2_job_of_2_ranks_resumes_with_the_trainers_losses(
    run: tuple[Path, list[dict[str, Any]]], exported: Path, tmp_path: Path
) -> None:
    from ckptkit.trainer.launch import run_ranks

    from .fsdp2_job import job

    records = {r["step"]: r for r in run[1]}
    cfg = TrainConfig()
    steps = [(s, records[s]["sample_ids"]) for s in range(RESUMED + 1, STEPS + 1)]
    out = tmp_path / "job.json"
    run_ranks(job, 2, str(exported), cfg, model_config("tiny", vocab_size=Tokenizer().vocab_size), steps, str(out))
    result = json.loads(out.read_text())
    assert result["asked"] == sorted(FileSystemReader(str(exported)).read_metadata().state_dict_metadata)
    assert result["loaded"] == {"lr": [records[RESUMED + 1]["lr"]] * 2, "weight_decay": [0.1, 0.0], "steps": [float(RESUMED)]}
    want = [records[s]["loss"] for s, _ in steps]
    relative = [abs(a - b) / abs(b) for a, b in zip(result["losses"], want)]
    print(f"fsdp2 resume at 2 ranks, steps {RESUMED + 1}-{STEPS}: losses {result['losses']}, trainer {want}, relative {relative}")
    assert len(relative) == 3 and max(relative) <= 1e-5
