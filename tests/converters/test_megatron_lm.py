"""``ckptkit convert`` of legacy Megatron-LM checkpoints (``--ckpt-format torch``): real saves by
Megatron-LM's own ``save_checkpoint`` (``fixtures/make_megatron_lm.py``) of a GPT at TP 2 x PP 2
(fp32, the plain optimizer) and TP 2 x DP 2 (bf16, the plain optimizer's fp32 copies; bf16, the
distributed optimizer's ``distrib_optim.pt`` in buckets) come across bitwise against the live model gathered at save time
and megatron-core's own view of the optimizer, under the ``torch_dist`` converter's names;
damaged, hostile or unsupported input fails in one line and leaves no destination."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import IntegrityError, ManifestError
from ckptkit_adapters.megatron.reader import CONVERTER
from ckptkit_adapters.megatron.legacy_files import parse
from ckptkit_adapters.megatron.legacy_optim import Local, buffer_ranges, plain_ids
from ckptkit_adapters.megatron.legacy_plan import KEYS_MAP, local_params
from ckptkit_adapters.megatron.legacy_values import refuse_unsupported

from .checks import assert_nothing_written, one_line_error

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "megatron-lm"
PIPELINE, HALF, DISTRIBUTED = "gpt-tp2-pp2", "gpt-tp2-dp2-bf16", "gpt-tp2-dp2-distopt-bf16"
needs_entry_point = pytest.mark.skipif("megatron" not in ckptkit.list_converters(),
                                       reason="the megatron entry point is not installed (pip install -e .)")


def _sharded_name(name: str) -> str:
    """A module name under Megatron-Core's sharded name (the local spec's keys map for its norms)."""
    for old, new in KEYS_MAP.items():
        name = name.replace(f".{old}", f".{new}")
    return name


def _stacked(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A load_plain_tensors entry per layer (stacked layers split, the layer put back)."""
    if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
        rest = key[len("decoder.layers."):]
        return {f"decoder.layers.{i}.{rest}": value[i] for i in range(value.shape[0])}
    return {key: value}


def _oracle(name: str) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor as the oracles hold it, under ckptkit's names."""
    where = FIXTURES / f"{name}.oracle"
    want = {}
    for key, value in load_file(str(where / "gathered.safetensors")).items():
        group, module = key.split("/", 1)
        want[f"{'model' if group == 'model' else 'optimizer/' + group}/{_sharded_name(module)}"] = value
    if (where / "plain.safetensors").exists():  # the distributed optimizer: megatron-core's own view of its state
        for key, value in load_file(str(where / "plain.safetensors")).items():
            if key.startswith("optimizer.state."):
                kind, param = key[len("optimizer.state."):].split(".", 1)
                want.update({f"optimizer/{'fp32' if kind == 'param' else kind}/{k}": v for k, v in _stacked(param, value).items()})
    return want


def _tensors(dst: Path) -> dict[str, torch.Tensor]:
    state = ckptkit.load(dst)
    trees = [("model", state["model"]), *((f"optimizer/{s}", t) for s, t in state["optimizer"].items())]
    return {f"{group}/{k}": v for group, tree in trees for k, v in tree.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("name", [PIPELINE, HALF, DISTRIBUTED])
def test_every_tensor_equals_the_live_model_and_megatrons_optimizer_state_bitwise(name: str, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / name), str(dst))
    assert report.skipped == [] and report.step == 3
    assert ckptkit.verify(dst).ok
    got, want = _tensors(dst), _oracle(name)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert bool((got["optimizer/exp_avg/decoder.layers.1.self_attention.linear_qkv.weight"] != 0).any())
    assert got["model/decoder.layers.1.mlp.linear_fc1.weight"].shape == (48, 16)  # gate and up of both TP ranks
    masters = [k for k in got if k.startswith("optimizer/fp32/")]
    assert len(masters) == (0 if name == PIPELINE else 15) and all(got[k].dtype == torch.float32 for k in masters)


def test_the_pipeline_stages_give_global_layer_numbers_and_the_plain_optimizer_no_master(tmp_path: Path) -> None:
    report = CONVERTER.convert(str(FIXTURES / PIPELINE), str(tmp_path / "out"))
    sources = {t.name: t.source for t in report.tensor_list}
    assert sources["model/decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"] == \
        "mp_rank_00_001/model_optim_rng.pt:model/decoder.layers.0.input_layernorm.weight"  # stage 1's local layer 0
    assert sources["optimizer/exp_avg/output_layer.weight"] == "mp_rank_00_001/model_optim_rng.pt:optimizer/state/4/exp_avg"
    assert not [n for n in sources if n.startswith("optimizer/fp32/")]  # FP32Optimizer updates the parameters themselves
    assert {t.name: t.chunks for t in report.tensor_list}["model/decoder.layers.0.mlp.linear_fc1.weight"] == 4  # gate, up x TP 2


def test_values_rng_states_and_info_come_from_every_rank_file(tmp_path: Path) -> None:
    dst = tmp_path / "out"
    report = CONVERTER.convert(str(FIXTURES / PIPELINE), str(dst))
    manifest = ckptkit.read_manifest(dst)
    ranks = ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"]
    for rank in ranks:
        torch_rng = manifest.tensors[f"rng/{rank}/0/torch_rng_state"]
        assert torch_rng.kind == "rng" and torch_rng.dtype == "uint8" and list(torch_rng.shape) == [5056]
        np_rng = manifest.objects[f"rng/{rank}/0/np_rng_state"]
        assert isinstance(np_rng, list) and np_rng[0] == "MT19937" and len(np_rng[1]) == 624  # type: ignore[arg-type]
        assert isinstance(manifest.objects[f"megatron/{rank}/optimizer/param_groups"], list)
    args = manifest.objects["megatron/args"]
    assert isinstance(args, dict) and args["ckpt_format"] == "torch" and args["tensor_model_parallel_size"] == 2
    assert manifest.info.config == {"args": args}
    assert manifest.info.scheduler is not None and manifest.info.scheduler["num_steps"] == 6
    assert manifest.info.optimizer is not None and manifest.info.optimizer.step == 3
    assert [g.options["wd_mult"] for g in manifest.info.optimizer.param_groups] == [1.0, 0.0]
    assert manifest.objects["model/decoder.layers.1.mlp.linear_fc2._extra_state"] is None
    assert manifest.layout is not None and manifest.layout["name"] == "megatron-gpt"
    listed = {o.name for o in report.objects} | {t.name for t in report.tensor_list}
    assert listed == set(manifest.objects) | set(manifest.tensors)  # nothing written that the report does not list


def test_the_distributed_optimizers_buckets_are_laid_out_as_megatron_does() -> None:
    """The fixture's buckets (--ddp-bucket-size 330) end off the 64-element grid: the padding
    stripped after each bucket moves later parameters, which one bucket would not."""
    where = FIXTURES / DISTRIBUTED / "iter_0000003" / "mp_rank_00"
    params = local_params(parse(str(where / "model_optim_rng.pt")).tree["model"])
    saved = parse(str(where / "distrib_optim.pt")).tree[0]
    numel = next(iter(saved.values()))["numel_unpadded"]
    bucketed = buffer_ranges(params, grad_fp32=True, size=330)
    assert [b.numel_unpadded for b in bucketed] == [numel] == [2832]
    single = buffer_ranges(params, grad_fp32=True, size=None)[0]
    assert single.numel_unpadded != numel
    assert bucketed[0].ranges["output_layer.weight"] == (0, 320) and bucketed[0].ranges["embedding.word_embeddings.weight"][1] == 320


def test_masters_that_do_not_round_to_the_model_are_refused(tmp_path: Path) -> None:
    """Two parameters' fp32 masters exchanged in distrib_optim.pt (as a wrong range would read
    them): the check of every master against the model's own tensor refuses the file."""
    src = Path(shutil.copytree(FIXTURES / DISTRIBUTED, tmp_path / "src"))
    where = src / "iter_0000003" / "mp_rank_01"
    params = local_params(parse(str(where / "model_optim_rng.pt")).tree["model"])
    ranges = buffer_ranges(params, grad_fp32=True, size=330)[0].ranges
    optim = parse(str(where / "distrib_optim.pt"))
    master = next(iter(optim.tree[0].values()))["param"]
    fd = os.open(where / "distrib_optim.pt", os.O_RDWR)
    try:
        begin, _ = dataclasses.replace(optim.archive, fd=fd).locate(f"data/{master.key}")
        (a, n), (b, _) = ranges["embedding.word_embeddings.weight"], ranges["output_layer.weight"]
        first, second = os.pread(fd, 4 * n, begin + 4 * a), os.pread(fd, 4 * n, begin + 4 * b)
        os.pwrite(fd, second, begin + 4 * a)
        os.pwrite(fd, first, begin + 4 * b)
    finally:
        os.close(fd)
    with pytest.raises(IntegrityError, match="does not round to the model's tensor"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_plain_optimizer_ids_follow_megatrons_parameter_groups_and_other_groups_are_refused() -> None:
    params = [Local("a.weight", (4, 4), "float32"), Local("a.norm.weight", (4,), "float32"), Local("b.bias", (4,), "float32"),
              Local("b.weight", (2, 4), "float32")]
    groups = [{"wd_mult": 1.0, "params": [0, 1]}, {"wd_mult": 0.0, "params": [2, 3]}]
    assert {i: p.key for i, p in plain_ids(params, groups, {}, "f").items()} == {
        0: "a.weight", 1: "b.weight", 2: "a.norm.weight", 3: "b.bias"}
    with pytest.raises(ManifestError, match="lr_mult"):
        plain_ids(params, [{**groups[0], "lr_mult": 0.5}, groups[1]], {}, "f")
    with pytest.raises(ManifestError, match="decoupled"):
        plain_ids(params, groups, {"decoupled_lr": 1e-3}, "f")
    with pytest.raises(IntegrityError, match="2 ids"):
        plain_ids(params[:3], groups, {}, "f")


@pytest.mark.parametrize(("args", "tree", "match"), [
    ({"virtual_pipeline_model_parallel_size": 2}, {"model0": {}}, "virtual pipeline stages"),
    ({"num_experts": 4}, {}, "experts"),
    ({"mtp_num_layers": 1}, {}, "multi-token prediction"),
    ({"pipeline_model_parallel_size": 2, "tensor_model_parallel_size": 1}, {}, "tied to the output layer"),
])
def test_forms_the_converter_cannot_place_are_refused_by_name(args: dict[str, Any], tree: dict[str, Any], match: str) -> None:
    with pytest.raises(ManifestError, match=match):
        refuse_unsupported(args, tree, "ckpt", tp=1, pp=2 if "pipeline_model_parallel_size" in args else 1)


@needs_entry_point
def test_the_cli_recognises_a_megatron_lm_save_directory(tmp_path: Path, run_ckptkit: Any) -> None:
    src = FIXTURES / DISTRIBUTED  # latest_checkpointed_iteration.txt naming iter_0000003
    proc = run_ckptkit("convert", "--json", str(src), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["format"] == "megatron" and report["skipped"] == [] and report["step"] == 3


@needs_entry_point
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_rank_file_fails_in_one_line_and_leaves_no_destination(damage: str, tmp_path: Path, run_ckptkit: Any) -> None:
    src = Path(shutil.copytree(FIXTURES / PIPELINE, tmp_path / "src"))
    victim = src / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt"
    if damage == "truncated":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        victim.unlink()
    proc = run_ckptkit("convert", "--from", "megatron", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    line = one_line_error(proc.stderr)
    assert "mp_rank_01_001/model_optim_rng.pt" in line and ("missing" in line if damage == "missing" else "archive" in line), line
    assert_nothing_written(tmp_path, tmp_path / "out")


class _Touch:
    """What a hostile pickle would run: a shell command creating a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.path}",)


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    src = Path(shutil.copytree(FIXTURES / PIPELINE, tmp_path / "src"))
    victim = src / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    created = tmp_path / "pwned"
    with zipfile.ZipFile(victim, "w", zipfile.ZIP_STORED) as z:  # the archive shape torch.save writes
        z.writestr("archive/data.pkl", pickle.dumps({"model": _Touch(created)}, protocol=2))
        z.writestr("archive/byteorder", "little")
    with pytest.raises(ManifestError, match=r"refused to unpickle (posix|os)\.system"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))
    assert not created.exists()
    assert_nothing_written(tmp_path, tmp_path / "out")


@needs_entry_point
def test_exported_to_hugging_face_the_logits_match_megatron_lms_forward(tmp_path: Path, run_ckptkit: Any) -> None:
    """The stages' norms, QKV groups and gate/up rows end up where they belong: a Llama built
    from the export computes Megatron-LM's own (pipelined, TP-gathered) logits."""
    transformers = pytest.importorskip("transformers")
    converted, out = tmp_path / "converted", tmp_path / "hf"
    CONVERTER.convert(str(FIXTURES / PIPELINE), str(converted))
    proc = run_ckptkit("export", str(converted), str(out), "--format", "hf", "--dtype", "fp32")  # the recorded layout
    assert proc.returncode == 0, proc.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    oracle = load_file(str(FIXTURES / f"{PIPELINE}.oracle" / "logits.safetensors"))
    with torch.no_grad():
        logits = model(oracle["ids"]).logits
    assert type(model).__name__ == "LlamaForCausalLM" and logits.shape == oracle["logits"].shape
    assert (logits - oracle["logits"]).abs().max().item() < 1e-4


@needs_entry_point
def test_reshard_to_one_rank_with_the_recorded_layout_keeps_every_tensor(tmp_path: Path, run_ckptkit: Any) -> None:
    converted, single = tmp_path / "converted", tmp_path / "tp1"
    CONVERTER.convert(str(FIXTURES / PIPELINE), str(converted))
    proc = run_ckptkit("reshard", str(converted), str(single), "--tp", "1", "--pp", "1", "--dp", "1", "--zero", "0", "--no-latest")
    assert proc.returncode == 0, proc.stderr
    assert ckptkit.read_manifest(single).topology.world_size == 1
    proc = run_ckptkit("diff", str(converted), str(single))
    assert proc.returncode == 0 and "equal" in proc.stdout, proc.stdout + proc.stderr


def test_a_missing_rank_directory_is_named(tmp_path: Path) -> None:
    src = Path(shutil.copytree(FIXTURES / PIPELINE, tmp_path / "src"))
    shutil.rmtree(src / "iter_0000003" / "mp_rank_00_001")
    with pytest.raises(IntegrityError, match="rank directories missing: mp_rank_00_001"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_file_the_converter_does_not_read_is_listed_not_dropped(tmp_path: Path) -> None:
    src = Path(shutil.copytree(FIXTURES / DISTRIBUTED, tmp_path / "src"))
    (src / "iter_0000003" / "mp_rank_01" / "layer_wise_optimizer_0.pt").write_bytes(b"\0")
    with pytest.raises(ManifestError, match="mp_rank_01/layer_wise_optimizer_0.pt: a file this converter does not read"):
        CONVERTER.convert(str(src), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")
    report = CONVERTER.convert(str(src), str(tmp_path / "out"), allow_skip=True)
    assert [s.name for s in report.skipped] == ["mp_rank_01/layer_wise_optimizer_0.pt"]
