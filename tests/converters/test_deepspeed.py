"""``ckptkit convert`` of DeepSpeed checkpoints: real ``engine.save_checkpoint`` directories
(ZeRO 0-3; fp32, bf16, fp16; 2 and 3 ranks; ``fixtures/make_deepspeed.py``) come across bitwise
against DeepSpeed's own view gathered at save time and its ``zero_to_fp32``; the result
reshards to another ZeRO stage and data-parallel size with every moment kept; damaged or
hostile input fails in one line and leaves no destination."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.schemas import cli_schema_path
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit_adapters.deepspeed.reader import CONVERTER, cast_float32, tag_directory

from .checks import assert_nothing_written, one_line_error

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "deepspeed"
SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / cli_schema_path("convert")
# the model-parallel save (which needs its layout) has tests of its own: test_deepspeed_tp.py
SAVES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and not p.name.endswith((".oracle", "-tp2")))
STATES = ("fp32", "exp_avg", "exp_avg_sq")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
needs_entry_point = pytest.mark.skipif("deepspeed" not in ckptkit.list_converters(),
                                       reason="the deepspeed entry point is not installed (pip install -e .)")


def _oracle(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / f"{name}.oracle" / "gathered.safetensors"))


def _order(name: str) -> list[list[str]]:
    """The optimizer's parameters, group by group, in its order (stage 0 names them by index)."""
    return json.loads((FIXTURES / f"{name}.oracle" / "param_order.json").read_text())  # type: ignore[no-any-return]


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))




def _stage_dtype(name: str) -> tuple[int, torch.dtype]:
    """The ZeRO stage and parameter dtype a fixture's name gives (``zero3-bf16-dp3``)."""
    stage, dtype = name.split("-")[:2]
    return int(stage[len("zero"):]), DTYPES[dtype]


def _moments_by_name(name: str, optimizer: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The converted fp32 masters and moments by parameter name. Stage 0 saves the optimizer's own
    state dict (by index; a 16-bit run wraps it and keeps its fp32 copies in ``fp32_groups``); the
    index is mapped to a name with the order the fixture recorded."""
    stage, dtype = _stage_dtype(name)
    if stage:
        return {key: optimizer[key] for key in STATES}
    order = _order(name)
    flat = [n for group in order for n in group]
    state = optimizer["state"] if dtype == torch.float32 else optimizer["optimizer_state_dict"]["state"]
    out = {key: {n: state[str(i)][key] for i, n in enumerate(flat)} for key in ("exp_avg", "exp_avg_sq")}
    if dtype != torch.float32:
        out["fp32"] = {n: optimizer["fp32_groups"][str(g)][str(j)] for g, group in enumerate(order) for j, n in enumerate(group)}
    return out


# --- every fixture, bitwise -------------------------------------------------------------------


@pytest.mark.parametrize("name", SAVES)
def test_every_tensor_equals_deepspeeds_own_view_and_verifies(name: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / name), str(dst))
    assert report.skipped == [] and report.step == 3
    assert ckptkit.verify(dst).ok
    state = ckptkit.load(dst)
    oracle = _oracle(name)
    stage, dtype = _stage_dtype(name)
    params = sorted(k.split("/", 1)[1] for k in oracle if k.startswith("model/"))
    assert sorted(state["model"]) == sorted([*params, "scale"])  # the parameters and the buffer
    moments = _moments_by_name(name, state["optimizer"])
    for pname in params:
        got = state["model"][pname]
        assert got.dtype == dtype and torch.equal(got, oracle[f"model/{pname}"]), pname
        if f"exp_avg/{pname}" not in oracle:  # frozen: DeepSpeed keeps no master and no moments
            assert name.endswith("-frozen") and all(pname not in moments.get(key, {}) for key in STATES)
            continue
        for key in STATES:
            want = oracle[f"{key}/{pname}"] if key != "fp32" or dtype != torch.float32 or stage else oracle[f"model/{pname}"]
            if key == "fp32" and not stage and dtype == torch.float32:
                continue  # no separate master: the client optimizer steps the module's parameters
            got = moments[key][pname]
            assert got.dtype == torch.float32 and got.shape == want.shape, (key, pname)
            assert torch.equal(got, want), (key, pname)
    assert any(bool((oracle[f"exp_avg/{p}"] != 0).any()) for p in params if f"exp_avg/{p}" in oracle)  # not all zero


@pytest.mark.parametrize("name", [n for n in SAVES if not n.startswith("zero0")])
def test_fp32_masters_equal_deepspeeds_zero_to_fp32(name: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    CONVERTER.convert(str(FIXTURES / name), str(dst))
    state = ckptkit.load(dst)
    want = load_file(str(FIXTURES / f"{name}.oracle" / "zero_to_fp32" / "model.safetensors"))
    assert sorted(want) == sorted(state["model"])
    frozen = ckptkit.read_manifest(dst).objects["deepspeed/frozen_param_shapes"] or {}
    assert sorted(frozen) == (["embed.weight"] if name.endswith("-frozen") else [])  # type: ignore[arg-type]
    for key, tensor in want.items():
        # zero_to_fp32 gives buffers and frozen parameters as the module holds them, in fp32
        got = state["optimizer"]["fp32"][key] if key != "scale" and key not in frozen else state["model"][key].float()
        assert torch.equal(got, tensor), key


def test_values_come_across_as_json_and_info(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / "zero2-fp16"), str(dst))
    manifest = ckptkit.read_manifest(dst)
    objects = manifest.objects
    assert (objects["client/epoch"], objects["client/note"], objects["client/seen"]) == (2, "fixture", [3, 5])
    assert objects["deepspeed/global_steps"] == 3 and objects["deepspeed/dp_world_size"] == 2
    assert objects["deepspeed/optimizer/step"] == [3.0, 3.0]
    assert [g["weight_decay"] for g in objects["deepspeed/optimizer/param_groups"]] == [0.1, 0.0]  # type: ignore[index]
    assert objects["deepspeed/optimizer/group_paddings"] == [[0, 0], [0, 2]]  # per rank: they differ
    info = manifest.info
    assert info.scheduler == {"last_batch_iteration": 2}
    assert info.loss_scaler is not None and info.loss_scaler["dynamic"] is True and info.loss_scaler["cur_scale"] == 256
    assert info.data_progress is not None and info.data_progress.consumed_samples == 12
    assert info.optimizer is not None and info.optimizer.step == 3
    assert [len(g.params) for g in info.optimizer.param_groups] == [6, 6]
    assert info.config is not None and info.config["ds_config"]["zero_optimization"] == {"stage": 2}  # type: ignore[index]
    assert manifest.step == 3 and manifest.layout is not None
    names = {t.name for t in report.tensor_list}
    assert {"model/blocks.0.fc1.weight", "optimizer/fp32/blocks.0.fc1.weight", "optimizer/exp_avg/blocks.0.fc1.weight",
            "optimizer/exp_avg_sq/blocks.0.fc1.weight"} <= names
    pieces = {t.name: t.chunks for t in report.tensor_list}
    assert pieces["optimizer/exp_avg/blocks.0.fc2.weight"] == 2  # split between the two ranks' partitions


@needs_entry_point
@pytest.mark.parametrize("where", ["save", "tag"])
def test_the_cli_recognises_a_save_directory_or_a_tag_directory(where: str, tmp_path: Path, run_ckptkit: Any) -> None:
    import jsonschema

    src = FIXTURES / "zero3-bf16" if where == "save" else FIXTURES / "zero3-bf16" / "global_step3"
    proc = run_ckptkit("convert", "--json", str(src), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"ckptkit: {src}: converting from deepspeed ({ckptkit.list_converters()['deepspeed']})"]
    report = json.loads(proc.stdout)
    jsonschema.validate(report, json.loads(SCHEMA.read_text(encoding="utf-8")))
    assert report["format"] == "deepspeed" and report["skipped"] == []
    model = [t for t in report["tensor_list"] if t["name"].startswith("model/") and t["name"] != "model/scale"]
    assert model and all("fp32 master, cast to bfloat16" in t["source"] for t in model)  # ZeRO-3 saves no bf16 copy


def test_stage3_reshards_to_zero1_at_another_dp_size_keeping_every_moment(tmp_path: Path, run_ckptkit: Any) -> None:
    converted, resharded = tmp_path / "converted", tmp_path / "zero1-dp3"
    CONVERTER.convert(str(FIXTURES / "zero3-bf16"), str(converted))
    proc = run_ckptkit("reshard", str(converted), str(resharded), "--dp", "3", "--zero", "1", "--no-latest")
    assert proc.returncode == 0, proc.stderr
    manifest = ckptkit.read_manifest(resharded)
    assert (manifest.topology.dp, manifest.topology.zero_stage) == (3, 1)
    files = {f.path for f in manifest.files}
    assert len(files) == 3  # each rank its share
    state, oracle = ckptkit.load(resharded), _oracle("zero3-bf16")
    for key, want in oracle.items():
        group, pname = key.split("/", 1)
        got = state["model"][pname] if group == "model" else state["optimizer"][group][pname]
        assert torch.equal(got, want), key
    assert run_ckptkit("diff", str(converted), str(resharded)).returncode == 0
    refused = run_ckptkit("reshard", str(converted), str(tmp_path / "tp2"), "--tp", "2", "--no-latest")
    assert refused.returncode == 1 and "tensor-parallel" in refused.stderr
    assert_nothing_written(tmp_path, tmp_path / "tp2")


# --- damaged input ----------------------------------------------------------------------------


@needs_entry_point
def test_a_truncated_rank_file_fails_in_one_line_and_leaves_no_destination(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("zero2-bf16", tmp_path)
    part = src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(part, part.stat().st_size - 200)
    proc = run_ckptkit("convert", "--from", "deepspeed", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


@needs_entry_point
@pytest.mark.parametrize(("name", "remove", "says"), [
    ("zero1-fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "rank(s) [1] are missing"),
    ("zero3-bf16-dp3", "zero_pp_rank_2_mp_rank_00_model_states.pt", "no model-states file of data-parallel rank(s) [2]"),
    ("zero1-fp32", "mp_rank_00_model_states.pt", "no model-states file of model-parallel rank 0"),
])
def test_a_missing_rank_file_fails_in_one_line(name: str, remove: str, says: str, tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy(name, tmp_path)
    (src / "global_step3" / remove).unlink()
    proc = run_ckptkit("convert", "--from", "deepspeed", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert says in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_partitions_of_another_save_are_inconsistent(tmp_path: Path) -> None:
    src = _copy("zero2-fp32", tmp_path)
    other = FIXTURES / "zero2-fp32-dp3" / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(other, src / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")  # rank 1 of 3, not of 2
    with pytest.raises(IntegrityError, match="partition"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_latest_naming_a_missing_tag_is_refused(tmp_path: Path) -> None:
    src = _copy("zero1-bf16", tmp_path)
    (src / "latest").write_text("global_step9")
    with pytest.raises(IntegrityError, match="global_step9"):
        tag_directory(str(src))
    assert not CONVERTER.detect(str(src))


# --- hostile input: no code runs --------------------------------------------------------------


class _Payload:
    """Pickles as a call of `target` with `args` (what a hostile file would hold)."""

    def __init__(self, target: Any, *args: Any) -> None:
        self.target, self.args = target, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.target, self.args


@needs_entry_point
def test_a_crafted_model_states_pickle_is_refused_and_runs_nothing(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("zero1-fp32", tmp_path)
    marker = tmp_path / "pwned"
    # torch.save writes the archive; its pickle holds a call that would create a file
    torch.save({"module": {"w": torch.ones(2)}, "buffer_names": [], "evil": _Payload(os.system, f"touch {marker}")},
               src / "global_step3" / "mp_rank_00_model_states.pt")
    proc = run_ckptkit("convert", "--from", "deepspeed", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "refused to unpickle posix.system" in one_line_error(proc.stderr)
    assert not marker.exists()
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_pipeline_parallel_save_is_refused_by_name(tmp_path: Path) -> None:
    src = _copy("zero1-fp32", tmp_path)
    shutil.copy(src / "global_step3" / "mp_rank_00_model_states.pt", src / "global_step3" / "layer_01-model_states.pt")
    with pytest.raises(ManifestError, match="pipeline-parallel"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))


# --- the 16-bit cast of ZeRO-3 parameters ------------------------------------------------------


@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_the_cast_from_fp32_rounds_as_torch_does(dtype: torch.dtype, name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=gen, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)  # every kind of float32: subnormals, ties, inf, NaN
    values = torch.cat([values, torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1 + 2**-8, 1 + 3 * 2**-8, 65520.0])])
    if dtype == torch.float16:
        values = values[~values.isnan()]  # torch and numpy agree on NaN's class, not its payload bits
    got = cast_float32(values.numpy(), name)
    want = values.to(dtype).view(torch.int16).numpy()
    finite = ~np.isnan(values.numpy())
    assert np.array_equal(got.view(np.int16)[finite], want[finite])
    if dtype == torch.bfloat16:
        assert np.isnan(torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float().numpy()[~finite]).all()


def test_more_rank_files_than_may_be_open_at_once_convert_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptkit_adapters.deepspeed import reader as deepspeed

    monkeypatch.setattr(deepspeed._Files, "MAX_OPEN", 2)  # 6 files: each reopened as its turn comes
    dst = tmp_path / "out"
    CONVERTER.convert(str(FIXTURES / "zero3-bf16-dp3"), str(dst))
    state, oracle = ckptkit.load(dst), _oracle("zero3-bf16-dp3")
    for key, want in oracle.items():
        group, pname = key.split("/", 1)
        got = state["model"][pname] if group == "model" else state["optimizer"][group][pname]
        assert torch.equal(got, want), key
