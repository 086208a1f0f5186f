"""``ckptkit export --format deepspeed``: a DeepSpeed save converted with ``ckptkit convert`` and
written back as a universal checkpoint, which DeepSpeed itself loads (``"checkpoint":
{"load_universal": true}``, CPU, gloo) at another data-parallel size and ZeRO stage with every
master and moment bitwise the source's, and trains on as the original engine does; its files
hold what DeepSpeed's own ``ds_to_universal`` writes of the same save; what it cannot write is
refused in one line, writing nothing."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit

from .conftest import _run
from .converters.checks import assert_nothing_written, one_line_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SOURCE = FIXTURES / "deepspeed" / "zero2-fp32"  # ZeRO-2, 2 data-parallel ranks, fp32
STATES = ("fp32", "exp_avg", "exp_avg_sq")
TAG = "global_step3_universal"


@pytest.fixture(scope="module")
def deepspeed_env(monkeypatch_module: pytest.MonkeyPatch) -> None:
    """DeepSpeed importable, on its CPU accelerator (the jobs it spawns inherit the setting).
    Missing, it fails the test under CI (``CI`` set: ``make test`` installs it) and skips it elsewhere."""
    if importlib.util.find_spec("deepspeed") is None:
        message = "DeepSpeed is not installed (make test installs it: DS_BUILD_OPS=0 pip install -c constraints.txt deepspeed)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    monkeypatch_module.setenv("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The fixture converted with ``ckptkit convert`` and exported with ``--format deepspeed``."""
    root = tmp_path_factory.mktemp("deepspeed-export")
    converted, out = root / "converted", root / "universal"
    proc = _run("convert", str(SOURCE), str(converted))
    assert proc.returncode == 0, proc.stderr
    proc = _run("export", str(converted), str(out), "--format", "deepspeed")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{out}: 50 tensors (deepspeed, saved)"), proc.stdout
    return converted, out


def _port(k: int) -> int:
    return 31000 + os.getpid() % 1000 + 10 * k


@pytest.fixture(scope="module")
def original(deepspeed_env: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The original save loaded by DeepSpeed as it saved it (ZeRO-2, dp 2) and trained one more step."""
    from .deepspeed_job import run

    return run(2, str(SOURCE), 2, False, str(tmp_path_factory.mktemp("original")), _port(0))


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_loads_the_export_at_dp1_with_the_sources_state_and_trains_on_alike(
    stage: int, deepspeed_env: None, exported: tuple[Path, Path], original: dict[str, Any], tmp_path: Path
) -> None:
    from .deepspeed_job import run

    converted, out = exported
    got = run(1, str(out), stage, True, str(tmp_path / "job"), _port(stage))
    assert got["loaded_from"] == str(out / TAG / "mp_rank_00_model_states.pt")
    source = ckptkit.load(converted)
    names = [n for n, t in source["optimizer"]["fp32"].items()]
    assert len(names) == 12
    for name in names:
        for state in STATES:
            want = source["optimizer"][state][name]
            loaded = got["loaded"][f"{state}/{name}"]
            assert loaded.dtype == want.dtype and torch.equal(loaded, want), (state, name)  # bitwise the source
            assert torch.equal(loaded, original["loaded"][f"{state}/{name}"]), (state, name)  # and the original engine's
        assert torch.equal(got["loaded"][f"model/{name}"], source["model"][name]), name  # the module refreshed from the masters
    assert any(bool((source["optimizer"]["exp_avg"][n] != 0).any()) for n in names)
    # one more step: the original at dp 2 (each rank 2 rows), the export at dp 1 (all 4 rows)
    assert _relative(got["loss"], original["loss"]) < 1e-6
    assert _relative(got["loss_after"], original["loss_after"]) < 1e-6
    assert got["loss_after"] != got["loss"]  # the step changed the weights
    assert (got["global_steps"], got["global_samples"]) == (original["global_steps"], original["global_samples"]) == (4, 16)
    assert got["lr"] == original["lr"]  # WarmupLR's next learning rate: the scheduler came along
    assert {k: got["client"][k] for k in ("epoch", "note", "seen")} == {"epoch": 2, "note": "fixture", "seen": [3, 5]}


def _load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_same(ours: Any, theirs: Any, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, dict):
        assert type(ours) is type(theirs) and sorted(map(str, ours)) == sorted(map(str, theirs)), where
        for key in theirs:
            _assert_same(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, f"{where}[{i}]")
    elif type(theirs).__module__.startswith("deepspeed.") and hasattr(theirs, "__dict__"):  # its loss scaler: by class and state
        assert type(ours) is type(theirs) and vars(ours) == vars(theirs), where
    else:
        assert type(ours) is type(theirs) and ours == theirs, where


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["zero2-fp32", "zero2-fp32-frozen", "zero1-bf16", "zero2-fp32-dp3"])
def test_the_files_hold_what_deepspeeds_ds_to_universal_writes(name: str, deepspeed_env: None, tmp_path: Path) -> None:
    converted, out = tmp_path / "converted", tmp_path / "universal"
    assert _run("convert", str(FIXTURES / "deepspeed" / name), str(converted)).returncode == 0
    proc = _run("export", str(converted), str(out), "--format", "deepspeed")
    assert proc.returncode == 0, proc.stderr
    save = Path(shutil.copytree(FIXTURES / "deepspeed" / name, tmp_path / "save"))
    theirs = save / TAG
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(save / "global_step3"),
                           "--output_folder", str(theirs), "--num_extract_workers", "1", "--num_merge_workers", "1",
                           "--inject_missing_state"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*") if p.is_file())
    zero3 = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ours only: what a ZeRO-3 engine loads a universal checkpoint from
    assert sorted(files + [zero3]) == sorted(str(p.relative_to(out / TAG)) for p in (out / TAG).rglob("*") if p.is_file())
    assert (out / "latest_universal").read_text() == (save / "latest_universal").read_text() == TAG
    for path in files:
        ours, want = _load(out / TAG / path), _load(theirs / path)
        if path == "zero/optimizer_state.pt":
            # what DeepSpeed's universal loader reads of it; the loss scaler (a DeepSpeed object) and
            # the source's own partitioning (paddings, partition counts, ZeRO stage) are left out
            assert sorted(ours) == ["clip_grad", "ds_version", "optimizer_state_dict", "overflow", "param_groups"]
            assert ours["optimizer_state_dict"]["param_groups"] == ours["param_groups"]
            assert torch.equal(ours["optimizer_state_dict"]["state"][0]["step"], torch.tensor(3.0))
            want = {k: want[k] for k in ours if k != "optimizer_state_dict"}
            ours = {k: ours[k] for k in want}
        _assert_same(ours, want, path)
    # the ZeRO-3 engine's file: the same, each parameter an empty placeholder of its dtype, the buffers whole
    placeheld, states = _load(out / TAG / zero3), _load(out / TAG / "mp_rank_00_model_states.pt")
    buffers = set(states["buffer_names"])
    assert buffers and sorted(placeheld) == sorted(states)
    _assert_same({k: v for k, v in placeheld.items() if k != "module"}, {k: v for k, v in states.items() if k != "module"}, zero3)
    assert list(placeheld["module"]) == list(states["module"])
    for key, tensor in states["module"].items():
        _assert_same(placeheld["module"][key], tensor if key in buffers else tensor.new_empty(0), f"{zero3}/module/{key}")


# --- a model DeepSpeed did not save: the reference trainer's, resumed by a DeepSpeed job of it ---------------

STEPS, RESUMED = 7, 4


@pytest.fixture(scope="module")
def trainer_export(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[int, dict[str, Any]]]:
    """A reference-trainer run of one process, its step-4 checkpoint exported with ``--format deepspeed``."""
    from .trainer.runs import train

    root = tmp_path_factory.mktemp("trainer-deepspeed")
    records = {r["step"]: r for r in train(root / "run", (1, 1, 1, 0), STEPS)}
    checkpoint, out = root / "run" / f"step_{RESUMED:08d}", root / "universal"
    proc = _run("export", str(checkpoint), str(out), "--format", "deepspeed")
    assert proc.returncode == 0, proc.stderr
    return checkpoint, out, records


@pytest.mark.multiprocess
def test_a_deepspeed_job_of_the_trainers_model_resumes_its_checkpoint_with_the_trainers_losses(
    deepspeed_env: None, trainer_export: tuple[Path, Path, dict[int, dict[str, Any]]], tmp_path: Path
) -> None:
    from ckptkit.trainer.config import TrainConfig, model_config
    from ckptkit.trainer.data import Tokenizer

    from .deepspeed_trainer_job import run

    checkpoint, out, records = trainer_export
    steps = [(s, records[s]["sample_ids"]) for s in range(RESUMED + 1, STEPS + 1)]
    got = run(2, str(out), 2, TrainConfig(), model_config("tiny", vocab_size=Tokenizer().vocab_size), steps, str(tmp_path / "job"),
              _port(3))
    assert got["loaded_from"] == str(out / f"global_step{RESUMED}_universal" / "mp_rank_00_model_states.pt")
    # every master and moment bitwise the checkpoint's, fused as the module fuses them (q, k, v; gate, up)
    source = ckptkit.load(checkpoint)
    states = {"fp32": source["model"], "exp_avg": source["optimizer"]["exp_avg"], "exp_avg_sq": source["optimizer"]["exp_avg_sq"]}
    fused = {"attn.qkv.weight": ("attn.q.weight", "attn.k.weight", "attn.v.weight"), "mlp.gate_up.weight": ("mlp.gate.weight", "mlp.up.weight")}
    names = sorted(k[len("fp32/"):] for k in got["loaded"] if k.startswith("fp32/"))
    assert len(names) == 2 + 1 + 4 * 6  # embed, norm, head; per layer two norms, qkv, o, gate_up, down
    for name in names:
        layer, _, local = name.partition(".attn.") if ".attn." in name else name.partition(".mlp.")
        key = next((k for k in fused if name.endswith(k)), None)
        for state, tensors in states.items():
            want = (torch.cat([tensors[name[: -len(key)] + part] for part in fused[key]]) if key
                    else tensors["lm_head.weight" if name == "head.weight" else name])
            assert torch.equal(got["loaded"][f"{state}/{name}"], want), (state, name)
        assert torch.equal(got["loaded"][f"model/{name}"], got["loaded"][f"fp32/{name}"]), name
    assert got["groups"] == {"lr": [records[RESUMED + 1]["lr"]] * 2, "weight_decay": [0.1, 0.0]}
    assert got["counters"]["global_steps"] == RESUMED
    want = [records[s]["loss"] for s, _ in steps]
    relative = [abs(a - b) / abs(b) for a, b in zip(got["losses"], want)]
    print(f"DeepSpeed ZeRO-2 resume at 2 ranks, steps {RESUMED + 1}-{STEPS}: losses {got['losses']}, trainer {want}, relative {relative}")
    assert len(relative) == 3 and max(relative) <= 1e-5


# --- refusals: one line, exit 1, nothing written ------------------------------------------------


def _refused(src: Path, tmp_path: Path, *args: str) -> str:
    dst = tmp_path / "out"
    proc = _run("export", str(src), str(dst), "--format", "deepspeed", *args)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert_nothing_written(tmp_path, dst)
    return one_line_error(proc.stderr)


def test_a_checkpoint_that_names_no_model_is_refused(tmp_path: Path) -> None:
    converted = tmp_path / "dcp"
    assert _run("convert", str(FIXTURES / "dcp-nodist"), str(converted)).returncode == 0  # DCP records no model
    # its layout is the FSDP2 view of its own tensors, which names no model DeepSpeed's modules could be
    assert "the layout 'fsdp2' is no tool's view of a canonical model" in _refused(converted, tmp_path)


def test_a_model_without_optimizer_state_is_refused(tmp_path: Path) -> None:
    from .converters.test_hf import _saved

    src, _ = _saved("llama", tmp_path)
    converted = tmp_path / "hf"
    assert _run("convert", str(src), str(converted)).returncode == 0
    line = _refused(converted, tmp_path)
    assert "a DeepSpeed universal checkpoint (the masters and moments DeepSpeed resumes from) needs an AdamW" in line


def test_a_model_whose_modules_are_not_known_is_refused(tmp_path: Path) -> None:
    converted = tmp_path / "megatron"
    assert _run("convert", str(FIXTURES / "megatron-lm" / "gpt-tp2-pp2"), str(converted)).returncode == 0
    assert "the megatron-gpt layout's modules are not known" in _refused(converted, tmp_path)


def test_a_stage_0_save_without_optimizer_state_by_name_is_refused(tmp_path: Path) -> None:
    converted = tmp_path / "zero0"
    assert _run("convert", str(FIXTURES / "deepspeed" / "zero0-fp32"), str(converted)).returncode == 0  # stage 0: moments by index
    line = _refused(converted, tmp_path)
    assert "a ZeRO stage 0 save names its optimizer state by index only" in line


@pytest.mark.multiprocess
def test_a_zero3_save_resumes_at_zero2_and_zero3_with_the_original_engines_state(deepspeed_env: None, tmp_path: Path) -> None:
    # DeepSpeed's own ZeRO-3 save (dp 2) -> ckptkit -> a universal checkpoint a ZeRO-2 and a ZeRO-3
    # engine at dp 1 load: every master and moment bitwise what the original engine holds after loading its save
    from .deepspeed_job import run

    save, converted, resharded, out = (FIXTURES / "deepspeed" / "zero3-fp32", tmp_path / "converted", tmp_path / "dp3",
                                       tmp_path / "universal")
    assert _run("convert", str(save), str(converted)).returncode == 0
    proc = _run("reshard", str(converted), str(resharded), "--dp", "3", "--zero", "3")  # on the way: another DP size
    assert proc.returncode == 0, proc.stderr
    proc = _run("export", str(resharded), str(out), "--format", "deepspeed")
    assert proc.returncode == 0, proc.stderr
    original = run(2, str(save), 3, False, str(tmp_path / "original"), _port(4))
    assert original["weight_decay"] == [0.1, 0.0]  # the fixture's two groups differ
    for stage in (2, 3):
        got = run(1, str(out), stage, True, str(tmp_path / f"job{stage}"), _port(5 + stage))
        states = [k for k in original["loaded"] if not k.startswith("model/")]  # a ZeRO-3 module holds placeholders
        assert len(states) == 3 * 12 and [k for k in states if not torch.equal(got["loaded"][k], original["loaded"][k])] == []
        assert _relative(got["loss"], original["loss"]) < 1e-6, stage
        assert (got["global_steps"], got["global_samples"], got["lr"]) == \
            (original["global_steps"], original["global_samples"], original["lr"]), stage
        if stage == 2:
            assert got["weight_decay"] == original["weight_decay"]
            assert _relative(got["loss_after"], original["loss_after"]) < 1e-6
        else:  # DeepSpeed's ZeRO-3 universal loader gives every group the first one's hyper-parameters
            assert got["weight_decay"] == [0.1, 0.1]


def test_dtype_is_bad_usage(tmp_path: Path) -> None:
    converted = tmp_path / "converted"
    assert _run("convert", str(SOURCE), str(converted)).returncode == 0
    proc = _run("export", str(converted), str(tmp_path / "out"), "--format", "deepspeed", "--dtype", "bf16")
    assert proc.returncode == 2 and "--dtype" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_every_missing_or_odd_state_is_listed_before_anything_is_written(tmp_path: Path) -> None:
    from ckptkit.errors import LayoutError
    from ckptkit_adapters.deepspeed.writer import plan_universal

    converted = tmp_path / "converted"
    assert _run("convert", str(SOURCE), str(converted)).returncode == 0
    manifest = ckptkit.read_manifest(converted)
    tensors = dict(manifest.tensors)
    del tensors["optimizer/exp_avg/head.weight"]
    tensors["optimizer/fp32/norm.bias"] = tensors["optimizer/fp32/norm.bias"].model_copy(update={"dtype": "bfloat16"})
    with pytest.raises(LayoutError) as err:
        plan_universal(manifest.model_copy(update={"tensors": tensors}), "src")
    assert "optimizer/exp_avg/head.weight is missing" in str(err.value)
    assert "optimizer/fp32/norm.bias is bfloat16 [7], DeepSpeed's [7] in float32" in str(err.value)
    with pytest.raises(LayoutError, match="a model-parallel save .mp_world_size 2."):
        plan_universal(manifest.model_copy(update={"objects": {**manifest.objects, "deepspeed/mp_world_size": 2}}), "src")


def _partitioned(names: list[str], shapes: dict[str, tuple[int, ...]], dp: int) -> list[tuple[int, int]]:
    """The (start, length) of each parameter's own elements in a ZeRO-3 rank's flat group (the
    rest is padding), for rank dp - 1, whose partitions hold the padding."""
    out, at = [], 0
    for name in names:
        numel = int(torch.tensor(shapes[name]).prod()) if shapes[name] else 1
        part = -(-numel // dp)
        out.append((at, numel - (dp - 1) * part))
        at += part
    return out


@pytest.mark.parametrize(("name", "dp"), [("zero3-bf16-dp3", 3), ("zero3-fp16", 2)])
def test_the_zero3_files_are_what_deepspeed_saved_of_the_same_state(name: str, dp: int, deepspeed_env: None, tmp_path: Path) -> None:
    # a ZeRO-3 save converted and written back at its own size: every file DeepSpeed wrote, every
    # value and tensor equal (DeepSpeed's loss scaler and ZeRO stage objects too), but the padding
    # of the last rank's partitions, which DeepSpeed leaves uninitialised and ckptkit writes as zeros
    save, converted, out = FIXTURES / "deepspeed" / name, tmp_path / "converted", tmp_path / "zero3"
    assert _run("convert", str(save), str(converted)).returncode == 0
    proc = _run("export", str(converted), str(out), "--format", "deepspeed", "--dp", str(dp), "--json")
    assert proc.returncode == 0, proc.stderr
    theirs = save / "global_step3"
    files = sorted(p.name for p in theirs.iterdir())
    assert files == sorted(p.name for p in (out / "global_step3").iterdir()) and len(files) == 2 * dp
    assert (out / "latest").read_text() == (save / "latest").read_text() == "global_step3"
    manifest = ckptkit.read_manifest(converted)
    shapes = {n: tuple(s) for g in manifest.objects["deepspeed/param_shapes"] for n, s in g.items()}
    groups = [list(g) for g in manifest.objects["deepspeed/param_shapes"]]
    for path in files:
        ours, want = _load(out / "global_step3" / path), _load(theirs / path)
        if "optim_states" in path and path.split("zero_pp_rank_")[1].startswith(f"{dp - 1}_"):
            flats = [ours["optimizer_state_dict"]["fp32_flat_groups"], want["optimizer_state_dict"]["fp32_flat_groups"]]
            for g, names in enumerate(groups):
                kept = torch.zeros(flats[1][g].numel(), dtype=torch.bool)
                for start, length in _partitioned(names, shapes, dp):
                    kept[start:start + length] = True
                assert torch.equal(flats[0][g][kept], flats[1][g][kept]) and not flats[0][g][~kept].any(), (path, g)
                assert bool((~kept).any())
            del ours["optimizer_state_dict"]["fp32_flat_groups"], want["optimizer_state_dict"]["fp32_flat_groups"]  # compared
        _assert_same(ours, want, path)


@pytest.mark.multiprocess
def test_a_zero3_engine_at_a_new_dp_size_resumes_the_zero3_files_with_each_groups_hyperparameters(
    deepspeed_env: None, tmp_path: Path
) -> None:
    # DeepSpeed's ZeRO-3 save at dp 2 -> ckptkit -> ZeRO-3's own files for 4 ranks, which a ZeRO-3
    # engine of 4 ranks loads as its own save (no load_universal): every master and moment bitwise
    # what the original engine holds, each group its own weight decay, and the next step alike
    from .deepspeed_job import run

    save, converted, out = FIXTURES / "deepspeed" / "zero3-fp32", tmp_path / "converted", tmp_path / "zero3"
    assert _run("convert", str(save), str(converted)).returncode == 0
    proc = _run("export", str(converted), str(out), "--format", "deepspeed", "--dp", "4")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{out}: ") and "(deepspeed zero3, saved)" in proc.stdout
    original = run(2, str(save), 3, False, str(tmp_path / "original"), _port(8))
    got = run(4, str(out), 3, False, str(tmp_path / "job"), _port(9))
    assert got["loaded_from"].startswith(str(out / "global_step3"))
    states = [k for k in original["loaded"] if not k.startswith("model/")]  # a ZeRO-3 module holds placeholders
    assert len(states) == 3 * 12 and [k for k in states if not torch.equal(got["loaded"][k], original["loaded"][k])] == []
    assert got["weight_decay"] == original["weight_decay"] == [0.1, 0.0]  # the universal loader gives [0.1, 0.1]
    assert (got["global_steps"], got["global_samples"], got["lr"]) == (original["global_steps"], original["global_samples"], original["lr"])
    assert _relative(got["loss"], original["loss"]) < 1e-6
    assert _relative(got["loss_after"], original["loss_after"]) < 1e-6 and got["loss_after"] != got["loss"]
    assert {k: got["client"][k] for k in ("epoch", "note", "seen")} == {"epoch": 2, "note": "fixture", "seen": [3, 5]}


def test_zero3_files_of_a_model_deepspeed_did_not_save_are_refused(tmp_path: Path) -> None:
    proc = _run("export", str(FIXTURES / "llama-v1.1"), str(tmp_path / "out"), "--format", "deepspeed", "--dp", "2")
    assert proc.returncode == 1
    assert "--dp writes a ZeRO-3 save's own files, from a checkpoint converted from DeepSpeed" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(("name", "says"), [("zero2-fp32", "this one is of ZeRO stage 2"),
                                            ("zero3-bf16-frozen", "does not write the per-rank fragments of frozen parameters")])
def test_zero3_files_of_another_stage_or_with_frozen_parameters_are_refused(name: str, says: str, tmp_path: Path) -> None:
    converted = tmp_path / "converted"
    assert _run("convert", str(FIXTURES / "deepspeed" / name), str(converted)).returncode == 0
    proc = _run("export", str(converted), str(tmp_path / "out"), "--format", "deepspeed", "--dp", "2")
    assert proc.returncode == 1 and says in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")
