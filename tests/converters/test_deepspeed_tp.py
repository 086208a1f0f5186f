"""``ckptkit convert`` of a DeepSpeed save with model (tensor) parallelism: 2 model-parallel x
2 data-parallel ranks at ZeRO-2 in bf16 (``fixtures/make_deepspeed.py``, DeepSpeed given the
groups through an ``mpu``), each rank's TP-local tensors joined through the model's layout,
bitwise against DeepSpeed's own per-rank view joined over TP at save time; without a layout, or
with one that does not fit, the conversion is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.layouts import Layout
from ckptkit.layouts.model import LAYER, Constraint, Param, StateGroup, TensorPart, TPCut, Unit, Zero
from ckptkit_adapters.deepspeed.reader import CONVERTER

from .checks import assert_nothing_written, one_line_error

SAVE = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed" / "zero2-bf16-tp2"
ORACLE = SAVE.parent / "zero2-bf16-tp2.oracle"


def _layout(fc1_dim: int = 0) -> Layout:
    """The fixture model's layout, as its user would write it: each block's fc1 column-parallel
    (rows and bias cut), fc2 row-parallel (columns cut, bias whole), the rest whole."""
    def cut(dim: int) -> TPCut:
        return TPCut(dim=dim)

    block = (
        Param(name="fc1.weight", parts=(TensorPart(tensor=f"blocks.{LAYER}.fc1.weight", shape=(12, 7)),), tp=cut(fc1_dim)),
        Param(name="fc1.bias", parts=(TensorPart(tensor=f"blocks.{LAYER}.fc1.bias", shape=(12,)),), tp=cut(0)),
        Param(name="fc2.weight", parts=(TensorPart(tensor=f"blocks.{LAYER}.fc2.weight", shape=(7, 12)),), tp=cut(1)),
        Param(name="fc2.bias", parts=(TensorPart(tensor=f"blocks.{LAYER}.fc2.bias", shape=(7,)),)),
    )
    whole = [("embed.weight", (13, 7)), ("norm.weight", (7,)), ("norm.bias", (7,)), ("head.weight", (3, 7))]
    return Layout(
        name="tiny-tp", num_layers=2, zero=Zero(flatten="stage"),
        units=(Unit(name="embed", place="first", params=(Param(name="embed.weight", parts=(TensorPart(tensor="embed.weight", shape=(13, 7)),)),)),
               Unit(name=f"blocks.{LAYER}", place="layers", params=block),
               Unit(name="tail", place="last", params=tuple(Param(name=n, parts=(TensorPart(tensor=n, shape=s),)) for n, s in whole[1:]))),
        states=(StateGroup(prefix="model", role="param"), StateGroup(prefix="optimizer/fp32", role="optimizer"),
                StateGroup(prefix="optimizer/exp_avg", role="optimizer"), StateGroup(prefix="optimizer/exp_avg_sq", role="optimizer")),
        constraints=(Constraint(axis="pp", at_most=1, what="one stage"),),
    )


def test_every_tensor_is_joined_over_tp_bitwise_against_deepspeeds_own_view(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(SAVE), str(dst), layout=_layout())
    assert report.skipped == [] and report.step == 3
    assert ckptkit.verify(dst).ok
    state = ckptkit.load(dst)
    want = load_file(str(ORACLE / "gathered.safetensors"))
    assert len(want) == 4 * 12
    for key, value in want.items():
        group, name = key.split("/", 1)
        got = state["model"][name] if group == "model" else state["optimizer"][group][name]
        assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), key
    assert state["model"]["blocks.1.fc1.weight"].shape == (12, 7)  # 6 rows on each of 2 ranks
    assert bool((state["optimizer"]["exp_avg_sq"]["blocks.0.fc2.weight"] != 0).all())
    sources = {t.name: t for t in report.tensor_list}
    assert sources["optimizer/fp32/blocks.0.fc2.weight"].chunks == 2 * 2  # 2 TP ranks x 2 DP partitions
    manifest = ckptkit.read_manifest(dst)
    assert manifest.layout is not None and manifest.layout["name"] == "tiny-tp"


def test_the_joined_checkpoint_reshards_to_another_tp_and_back(tmp_path: Path, run_ckptkit: Any) -> None:
    converted, there, back = tmp_path / "converted", tmp_path / "tp1", tmp_path / "back"
    CONVERTER.convert(str(SAVE), str(converted), layout=_layout())
    assert run_ckptkit("reshard", str(converted), str(there), "--tp", "1", "--dp", "3", "--zero", "1", "--no-latest").returncode == 0
    assert run_ckptkit("reshard", str(there), str(back), "--tp", "2", "--dp", "1", "--zero", "0", "--no-latest").returncode == 0
    for a, b in ((converted, there), (converted, back)):
        proc = run_ckptkit("diff", str(a), str(b))
        assert proc.returncode == 0 and "equal" in proc.stdout, proc.stdout + proc.stderr


def test_without_a_layout_it_is_refused_in_one_line(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("convert", "--from", "deepspeed", str(SAVE), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "2 model-parallel ranks" in one_line_error(proc.stderr) and "--layout" in proc.stderr
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_layout_that_cuts_another_dim_is_refused_naming_the_shapes(tmp_path: Path, run_ckptkit: Any) -> None:
    (tmp_path / "layout.json").write_text(json.dumps(_layout(fc1_dim=1).to_json()))
    proc = run_ckptkit("convert", "--from", "deepspeed", str(SAVE), str(tmp_path / "out"), "--layout", str(tmp_path / "layout.json"))
    assert proc.returncode == 1
    line = one_line_error(proc.stderr)
    assert "blocks.0.fc1.weight: the ranks hold shapes [[6, 7], [6, 7]], the layout says [[12, 3], [12, 3]]" in line
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_replicated_tensor_that_differs_between_ranks_is_refused(tmp_path: Path) -> None:
    # The layout claims fc1's bias whole on every rank; each rank holds its own half: not replicas.
    layout = _layout()
    units = list(layout.units)
    block = tuple(p.model_copy(update={"tp": None, "parts": (TensorPart(tensor=f"blocks.{LAYER}.fc1.bias", shape=(6,)),)})
                  if p.name == "fc1.bias" else p for p in units[1].params)
    units[1] = units[1].model_copy(update={"params": block})
    with pytest.raises(IntegrityError, match="another value than rank 0 of a part the layout replicates"):
        CONVERTER.convert(str(SAVE), str(tmp_path / "out"), layout=layout.model_copy(update={"units": tuple(units)}))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_missing_model_parallel_rank_is_refused(tmp_path: Path) -> None:
    src = Path(shutil.copytree(SAVE, tmp_path / "src"))
    for f in (src / "global_step3").glob("*mp_rank_01*"):
        f.unlink()
    (src / "global_step3" / "mp_rank_02_model_states.pt").write_bytes((SAVE / "global_step3" / "mp_rank_01_model_states.pt").read_bytes())
    with pytest.raises(IntegrityError, match=r"no files of model-parallel rank\(s\) \[1\]"):
        CONVERTER.convert(str(src), str(tmp_path / "out"), layout=_layout())
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_missing_optimizer_partition_of_one_model_parallel_rank_is_refused(tmp_path: Path) -> None:
    src = Path(shutil.copytree(SAVE, tmp_path / "src"))
    (src / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(IntegrityError, match=r"rank\(s\) \[1\] are missing"):
        CONVERTER.convert(str(src), str(tmp_path / "out"), layout=_layout())
    with pytest.raises(ManifestError, match="2 model-parallel ranks"):
        CONVERTER.convert(str(SAVE), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")
