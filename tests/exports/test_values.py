"""Every value of a checkpoint is carried by an export or listed in its report as skipped, with
why: on real conversions of a DeepSpeed, a Megatron-LM and a Hugging Face Trainer save."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.exports.run import export
from ckptkit.ops.convert import convert

from ..converters.checks import megatron_common

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("values")
    sources = {"deepspeed": "deepspeed/zero2-fp32", "megatron-lm": "megatron-lm/gpt-tp2-dp2-bf16", "trainer": "hf/trainer/checkpoint-4"}
    for name, fixture in sources.items():
        convert(FIXTURES / fixture, root / name)
    return {name: root / name for name in sources}


def _left_values(report: Any, objects: dict[str, Any]) -> dict[str, str]:
    return {e.name: e.reason for e in report.skipped if e.name in objects}


def test_the_deepspeed_export_carries_the_saves_records_and_client_state_and_lists_the_rest(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    objects = ckptkit.read_manifest(converted["deepspeed"]).objects
    report = export(converted["deepspeed"], tmp_path / "ds", format="deepspeed")
    # what a universal checkpoint does not hold: the source's per-partition bookkeeping
    per_partition = ("dynamic_loss_scale", "group_paddings", "param_alignment_paddings", "param_slice_mappings",
                     "partition_count", "zero_stage")
    assert _left_values(report, objects) == {f"deepspeed/optimizer/{k}": "a value the deepspeed export does not write"
                                             for k in per_partition}
    states = torch.load(tmp_path / "ds" / "global_step3_universal" / "mp_rank_00_model_states.pt", weights_only=False)
    client = {k.removeprefix("client/"): v for k, v in objects.items() if k.startswith("client/")}
    assert client and {k: states[k] for k in client} == client
    assert (states["global_steps"], states["ds_version"]) == (objects["deepspeed/global_steps"], objects["deepspeed/ds_version"])


def test_an_hf_model_lists_every_trainer_value_and_the_trainer_folder_only_its_training_args(
    converted: dict[str, Path], tmp_path: Path
) -> None:
    objects = ckptkit.read_manifest(converted["trainer"]).objects
    model = export(converted["trainer"], tmp_path / "hf", format="hf")
    assert _left_values(model, objects) == dict.fromkeys(objects, "a value the hf export does not write") and len(objects) == 4
    folder = export(converted["trainer"], tmp_path / "trainer", format="hf-trainer")
    # Trainer resumes without training_args.bin (a pickled TrainingArguments), which is not written
    assert _left_values(folder, objects) == {"trainer/training_args": "a value the hf-trainer export does not write"}
    assert json.loads((tmp_path / "trainer" / "trainer_state.json").read_text()) == objects["trainer/state"]


def test_the_megatron_export_writes_what_megatron_lm_loads_and_lists_the_rest(converted: dict[str, Path], tmp_path: Path) -> None:
    manifest = ckptkit.read_manifest(converted["megatron-lm"])
    objects = manifest.objects
    report = export(converted["megatron-lm"], tmp_path / "mcore", format="megatron", tp=1, include_optimizer=True)
    common = megatron_common(tmp_path / "mcore" / "common.pt")
    # Megatron-LM's load_checkpoint stops without an iteration (unless --finetune), and loads the scheduler with the optimizer
    assert (common["iteration"], common["checkpoint_version"]) == (manifest.step, 3.0) and manifest.step == objects["megatron/iteration"]
    assert common["opt_param_scheduler"] == objects["megatron/opt_param_scheduler"]
    assert common["num_floating_point_operations_so_far"] == objects["megatron/num_floating_point_operations_so_far"]
    assert vars(common["args"])["num_layers"] == objects["megatron/args"]["num_layers"]
    left = _left_values(report, objects)
    rng = {k for k in objects if k.startswith("rng/")}
    assert set(left) == rng | {"megatron/mp_rank_00/optimizer/optimizer", "megatron/mp_rank_01/optimizer/optimizer",
                               "model/output_layer._extra_state"} and len(rng) == 6
    ranks = "a rank's optimizer record; the megatron export writes the parameter groups again from the checkpoint's optimizer info"
    assert {left.pop(f"megatron/mp_rank_0{r}/optimizer/optimizer") for r in (0, 1)} == {ranks}
    assert set(left.values()) == {"a value the megatron export does not write"}
    # without the optimizer, its scheduler is the optimizer's: listed as such
    plain = export(converted["megatron-lm"], tmp_path / "weights", format="megatron", tp=1)
    assert "opt_param_scheduler" not in megatron_common(tmp_path / "weights" / "common.pt")
    why = "the optimizer's scheduler state, which the megatron export writes only with --include-optimizer"
    assert _left_values(plain, objects)["megatron/opt_param_scheduler"] == why
    # and the step comes back with a conversion of the export
    assert ckptkit.read_manifest(convert(tmp_path / "weights", tmp_path / "back").destination).step == manifest.step
