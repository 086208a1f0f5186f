"""``ckptkit convert`` of torch DCP directories: every fixture (real FSDP2 and no_dist saves)
comes across bitwise against torch's own consolidation, and damaged or hostile input is refused
in one line, runs no code and leaves no destination."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptkit
from ckptkit.schemas import cli_schema_path
from ckptkit.errors import IntegrityError
from ckptkit.manifest.shards import iter_shards
from ckptkit.state.tree import split
from ckptkit_adapters.dcp.reader import CONVERTER as DCP
from ckptkit_adapters.common.dcp_read import dcp_key, fqn_of, kind_of, optimizer_prefixes

from .checks import assert_nothing_written, one_line_error

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
DCP_FIXTURES = ["dcp-fsdp2-fp32", "dcp-fsdp2-bf16", "dcp-nodist"]
SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / cli_schema_path("convert")



def _oracle(src: Path, tmp_path: Path) -> dict[str, Any]:
    """torch's own consolidation of `src`, flattened to DCP keys."""
    out = tmp_path / "oracle.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(src, out)
    flat, _ = flatten_state_dict(torch.load(out, weights_only=True))
    return flat


def _converted(dst: Path) -> dict[str, Any]:
    """Every tensor and value of the checkpoint at `dst`, keyed by its DCP key."""
    nested = ckptkit.load(dst)
    manifest = ckptkit.read_manifest(dst)
    out = {}
    for fqn in [*manifest.tensors, *manifest.objects]:
        node = nested
        for part in split(fqn):
            node = node[part]
        out[dcp_key(fqn)] = node
    return out


def _save_dcp(state: dict[str, Any], path: Path) -> Path:
    """Save `state` with torch DCP in this process (no_dist)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)
    return path


def _copy(name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))



# --- every fixture, bitwise -------------------------------------------------------------------


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_convert_exits_0_and_the_result_verifies(name: str, tmp_path: Path, run_ckptkit: Any) -> None:
    dst = tmp_path / "out"
    proc = run_ckptkit("convert", str(FIXTURES / name), str(dst))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [f"ckptkit: {FIXTURES / name}: converting from dcp "
                                        f"({ckptkit.list_converters()['dcp']})"]
    verified = run_ckptkit("verify", str(dst))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "sound" in verified.stdout


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_every_tensor_and_value_equals_torchs_consolidation(name: str, tmp_path: Path, run_ckptkit: Any) -> None:
    dst = tmp_path / "out"
    assert run_ckptkit("convert", "--from", "dcp", str(FIXTURES / name), str(dst)).returncode == 0
    want, got = _oracle(FIXTURES / name, tmp_path), _converted(dst)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == (list(value) if isinstance(value, tuple) else value), key


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_the_report_accounts_for_every_entry_and_matches_its_schema(name: str, tmp_path: Path, run_ckptkit: Any) -> None:
    import jsonschema

    proc = run_ckptkit("convert", "--json", str(FIXTURES / name), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    jsonschema.validate(report, json.loads(SCHEMA.read_text(encoding="utf-8")))
    assert report["skipped"] == []
    sources = [t["source"] for t in report["tensor_list"]] + [o["source"] for o in report["objects"]]
    assert sorted(sources) == sorted(_oracle(FIXTURES / name, tmp_path))
    assert all(t["name"] == fqn_of(t["source"]) for t in report["tensor_list"])


def test_fsdp2_fixtures_hold_uneven_and_empty_chunks_and_nonzero_moments(tmp_path: Path, run_ckptkit: Any) -> None:
    dst = tmp_path / "out"
    proc = run_ckptkit("convert", "--json", str(FIXTURES / "dcp-fsdp2-bf16"), str(dst))
    chunks = {t["source"]: t["chunks"] for t in json.loads(proc.stdout)["tensor_list"]}
    assert chunks["model.embed.weight"] == 2 and chunks["model.head.weight"] == 1  # 6 + 5 rows; 1 + 0 rows
    assert chunks["dtensor.cols"] == 2 and chunks["dtensor.replicated"] == 1  # 4 + 3 columns; saved once
    moment = ckptkit.load(dst)["optim"]["state"]["embed"]["weight"]["exp_avg"]
    assert moment.dtype == torch.bfloat16 and moment.abs().sum() > 0


def test_kinds_and_step_come_from_the_saved_structure(tmp_path: Path, run_ckptkit: Any) -> None:
    dst = tmp_path / "out"
    assert run_ckptkit("convert", str(FIXTURES / "dcp-nodist"), str(dst)).returncode == 0
    manifest = ckptkit.read_manifest(dst)
    assert manifest.step == 2  # every parameter's AdamW step
    assert manifest.tensors["model/layers/0/weight"].kind == "param"
    assert manifest.tensors["optim/state/layers/0/weight/exp_avg_sq"].kind == "optimizer"
    assert manifest.tensors["counters/tokens"].kind == "other"
    assert manifest.objects["extra/betas"] == [0.9, 0.95]


def test_names_split_at_dots_and_map_back_exactly() -> None:
    assert fqn_of("model.layers.0.weight") == "model/layers/0/weight"
    for key in ["model.layers.0.weight", "a/b.c~d", "x..y", "plain"]:
        assert dcp_key(fqn_of(key)) == key
    assert fqn_of("a/b.c~d") == "a~1b/c~0d"


def test_optimizer_state_is_recognised_under_any_prefix() -> None:
    keys = ["app.opt.state.w.exp_avg", "app.opt.param_groups.0.lr", "state.v.step", "param_groups.0.lr", "app.model.w"]
    prefixes = optimizer_prefixes(keys)
    assert prefixes == {"app.opt", ""}
    assert [kind_of(k, prefixes) for k in keys] == ["optimizer", "other", "optimizer", "other", "other"]


def test_exported_to_dcp_and_converted_back_keeps_names_and_bytes(tmp_path: Path, run_ckptkit: Any) -> None:
    first, exported, back = tmp_path / "first", tmp_path / "exported", tmp_path / "back"
    assert run_ckptkit("convert", str(FIXTURES / "dcp-fsdp2-fp32"), str(first)).returncode == 0
    assert run_ckptkit("export", "--format", "dcp", "--dcp-form", "plain", "--include-optimizer", str(first), str(exported)).returncode == 0
    assert run_ckptkit("convert", str(exported), str(back)).returncode == 0
    a, b = _converted(first), _converted(back)
    one = ckptkit.read_manifest(first)
    assert sorted(b) == sorted(a) == sorted(dcp_key(name) for name in [*one.tensors, *one.objects])  # every tensor and value
    for key, value in b.items():
        assert torch.equal(value, a[key]) if isinstance(value, torch.Tensor) else value == a[key], key
    two = ckptkit.read_manifest(back)  # the identity: the values and the step too
    assert two.objects == one.objects and len(one.objects) == 12 and two.step == one.step == 3


# --- usage ------------------------------------------------------------------------------------


def test_auto_on_a_directory_that_is_no_checkpoint_fails_in_one_line(tmp_path: Path, run_ckptkit: Any) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hello")
    proc = run_ckptkit("convert", str(tmp_path / "src"), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "not a checkpoint any converter recognises (tried: dcp, deepspeed, hf, megatron, peft, torchtitan)" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_unknown_source_format_is_bad_usage(tmp_path: Path, run_ckptkit: Any) -> None:
    proc = run_ckptkit("convert", "--from", "nope", str(FIXTURES / "dcp-nodist"), str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "choose auto or one of: dcp" in one_line_error(proc.stderr)


def test_an_existing_destination_is_refused(tmp_path: Path, run_ckptkit: Any) -> None:
    (tmp_path / "out").mkdir()
    proc = run_ckptkit("convert", str(FIXTURES / "dcp-nodist"), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "already exists" in proc.stderr.splitlines()[-1]
    assert list((tmp_path / "out").iterdir()) == []


# --- damaged input ----------------------------------------------------------------------------


def test_a_truncated_distcp_file_fails_in_one_line_and_leaves_no_destination(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("dcp-fsdp2-fp32", tmp_path)
    part = src / "__1_0.distcp"
    os.truncate(part, part.stat().st_size // 2)
    proc = run_ckptkit("convert", "--from", "dcp", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "__1_0.distcp" in one_line_error(proc.stderr) and "truncated" in proc.stderr
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_missing_distcp_file_fails_in_one_line_and_leaves_no_destination(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("dcp-fsdp2-bf16", tmp_path)
    (src / "__0_0.distcp").unlink()
    proc = run_ckptkit("convert", "--from", "dcp", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "__0_0.distcp: missing" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_chunk_damaged_after_others_were_written_leaves_no_destination(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("dcp-fsdp2-fp32", tmp_path)
    part = src / "__1_0.distcp"
    data = bytearray(part.read_bytes())
    data[-4096:] = bytes(4096)  # the last chunks' archives: zeros, same size
    part.write_bytes(bytes(data))
    proc = run_ckptkit("convert", "--from", "dcp", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "__1_0.distcp" in one_line_error(proc.stderr)
    assert_nothing_written(tmp_path, tmp_path / "out")


# --- hostile input: no code runs --------------------------------------------------------------


class _Payload:
    """Pickles as a call of `target` with `args` (what a hostile file would hold)."""

    def __init__(self, target: Any, *args: Any) -> None:
        self.target, self.args = target, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.target, self.args


@pytest.mark.parametrize("via", ["os.system", "builtins.exec"])
def test_a_crafted_metadata_pickle_is_refused_and_runs_nothing(via: str, tmp_path: Path, run_ckptkit: Any) -> None:
    src = _copy("dcp-nodist", tmp_path)
    marker = tmp_path / "pwned"
    payload = (_Payload(os.system, f"touch {marker}") if via == "os.system"
               else _Payload(exec, f"open({str(marker)!r}, 'w').close()"))
    (src / ".metadata").write_bytes(pickle.dumps(payload))
    proc = run_ckptkit("convert", "--from", "dcp", str(src), str(tmp_path / "out"))
    assert proc.returncode == 1
    line = one_line_error(proc.stderr)
    assert f"refused to unpickle {'posix.system' if via == 'os.system' else 'builtins.exec'}" in line
    assert not marker.exists()
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_hostile_value_saved_by_dcp_is_refused_or_skipped_and_runs_nothing(tmp_path: Path, run_ckptkit: Any) -> None:
    marker = tmp_path / "pwned"
    src = _save_dcp({"model": {"w": torch.arange(6.0).view(2, 3)}, "extra": {"evil": _Payload(os.system, f"touch {marker}")}},
                    tmp_path / "src")
    refused = run_ckptkit("convert", str(src), str(tmp_path / "out"))
    assert refused.returncode == 1
    assert "extra.evil" in refused.stderr and "refused to unpickle posix.system" in refused.stderr
    assert "--allow-skip" in refused.stderr.splitlines()[-1]
    assert_nothing_written(tmp_path, tmp_path / "out")
    allowed = run_ckptkit("convert", "--allow-skip", "--json", str(src), str(tmp_path / "out"))
    assert allowed.returncode == 0, allowed.stderr
    skipped = json.loads(allowed.stdout)["skipped"]
    assert [s["name"] for s in skipped] == ["extra.evil"] and "posix.system" in skipped[0]["reason"]
    assert not marker.exists()
    assert torch.equal(ckptkit.load(tmp_path / "out")["model"]["w"], torch.arange(6.0).view(2, 3))


def test_entries_ckptkit_cannot_hold_are_skipped_only_when_allowed(tmp_path: Path, run_ckptkit: Any) -> None:
    src = _save_dcp({"model": {"w": torch.ones(3), "z": torch.zeros(2, dtype=torch.complex128)},
                     "extra": {"inf": float("inf"), "ok": 1}}, tmp_path / "src")
    refused = run_ckptkit("convert", str(src), str(tmp_path / "out"))
    assert refused.returncode == 1 and "2 entries cannot be converted" in refused.stderr
    allowed = run_ckptkit("convert", "--allow-skip", "--json", str(src), str(tmp_path / "out"))
    assert allowed.returncode == 0, allowed.stderr
    report = json.loads(allowed.stdout)
    reasons = {s["name"]: s["reason"] for s in report["skipped"]}
    assert sorted(reasons) == ["extra.inf", "model.z"]
    assert "torch.complex128" in reasons["model.z"] and "not a finite number" in reasons["extra.inf"]
    assert ckptkit.read_manifest(tmp_path / "out").objects == {"extra/ok": 1}


# --- saves written with HuggingFaceStorageWriter (safetensors shards, no .metadata) -----------

HF_SAVES = ["dcp-hf-fsdp2", "dcp-hf-nodist"]


def _hf_storage_oracle(src: Path) -> dict[str, torch.Tensor]:
    """torch's own reader of such a save (HuggingFaceStorageReader), loaded whole."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meta = HuggingFaceStorageReader(str(src)).read_metadata()
        state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()}
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(src)), no_dist=True)
    return state


@pytest.mark.parametrize("name", HF_SAVES)
def test_a_huggingface_storage_writer_save_equals_torchs_reader(name: str, tmp_path: Path, run_ckptkit: Any) -> None:
    dst = tmp_path / "out"
    proc = run_ckptkit("convert", "--json", str(FIXTURES / name), str(dst))
    assert proc.returncode == 0, proc.stderr
    assert "converting from dcp" in proc.stderr
    assert not (FIXTURES / name / ".metadata").exists()
    want, got = _hf_storage_oracle(FIXTURES / name), _converted(dst)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    chunks = {t["source"]: t["chunks"] for t in json.loads(proc.stdout)["tensor_list"]}
    if name == "dcp-hf-fsdp2":  # one chunk per rank: uneven rows, column chunks
        assert chunks["model.embed.weight"] == 2 and chunks["dtensor.cols"] == 2


def test_a_huggingface_storage_writer_save_missing_a_middle_chunk_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from ckptkit_adapters.common.files import safetensors_header

    src = _copy("dcp-hf-fsdp2", tmp_path)
    first = src / "shard-00001-model-00001-of-00001.safetensors"
    metadata = safetensors_header(str(first)).metadata
    tensors = load_file(str(first))
    del tensors["model.embed.weight"]  # rows 0-5 of the embedding: its other chunk starts at row 6
    info = json.loads(metadata["DCP_SHARDING_INFO"])
    del info["model.embed.weight"]
    save_file(tensors, str(first), metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(info)})
    with pytest.raises(IntegrityError, match="model.embed.weight"):
        DCP.convert(str(src), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_a_save_without_collectives_merges_the_ranks_metadata(tmp_path: Path, run_ckptkit: Any) -> None:
    """``dcp.save(use_collectives=False)``: no ``.metadata``, each rank its own; the state is the
    one ``dcp-fsdp2-fp32`` holds (saved in the same run), so torch's consolidation of that is the oracle."""
    src = FIXTURES / "dcp-fsdp2-percall"
    assert not (src / ".metadata").exists() and (src / "__1.metadata").exists()
    dst = tmp_path / "out"
    proc = run_ckptkit("convert", "--json", str(src), str(dst))
    assert proc.returncode == 0, proc.stderr
    want, got = _oracle(FIXTURES / "dcp-fsdp2-fp32", tmp_path), _converted(dst)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == (list(value) if isinstance(value, tuple) else value), key
    chunks = {t["source"]: t["chunks"] for t in json.loads(proc.stdout)["tensor_list"]}
    assert chunks["model.embed.weight"] == 2  # one from each rank's metadata


def test_ranks_that_disagree_on_a_tensor_are_refused(tmp_path: Path) -> None:
    src = _copy("dcp-fsdp2-percall", tmp_path)
    (src / "__1.metadata").write_bytes((FIXTURES / "dcp-fsdp2-bf16" / ".metadata").read_bytes())  # another save's
    with pytest.raises(ckptkit.ManifestError, match="lower rank"):
        DCP.convert(str(src), str(tmp_path / "out"))
    assert_nothing_written(tmp_path, tmp_path / "out")


def _resumed(path: Path, out: Path) -> dict[str, Any]:
    """The DCP fixtures' FSDP2 job (2 gloo ranks) resumed from `path` and stepped once."""
    from safetensors.torch import load_file

    from ckptkit.trainer.launch import run_ranks

    from ..dcp_job import job

    out.mkdir()
    run_ranks(job, 2, str(path), str(out))
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    result["state"] = load_file(str(out / "state.safetensors"))
    return result


@pytest.mark.multiprocess
def test_an_fsdp2_save_goes_back_to_dcp_whole_and_its_job_resumes_as_from_the_original(tmp_path: Path, run_ckptkit: Any) -> None:
    # torch's own FSDP2 save (2 ranks, AdamW) -> ckptkit -> the plain DCP form with the optimizer:
    # the keys the save had, its parameter groups among them, and the job that saved it resumes
    # from the export exactly as from the original
    from torch.distributed.checkpoint import FileSystemReader

    source, converted, out = FIXTURES / "dcp-fsdp2-fp32", tmp_path / "converted", tmp_path / "dcp"
    assert run_ckptkit("convert", str(source), str(converted)).returncode == 0
    proc = run_ckptkit("export", str(converted), str(out), "--format", "dcp", "--include-optimizer")
    assert proc.returncode == 0, proc.stderr
    assert "(step 3; 0 tensors not exported)" in proc.stdout
    theirs = FileSystemReader(str(source)).read_metadata().state_dict_metadata
    assert sorted(FileSystemReader(str(out)).read_metadata().state_dict_metadata) == sorted(theirs)
    assert "optim.param_groups.0.lr" in theirs
    original, again = _resumed(source, tmp_path / "original"), _resumed(out, tmp_path / "again")
    assert again["groups"] == original["groups"] and original["groups"][0]["lr"] == 1e-2  # the saved groups, not the job's
    assert (again["loss"], again["after"]) == (original["loss"], original["after"]) and again["after"] < again["loss"]
    assert sorted(again["state"]) == sorted(original["state"]) and len(original["state"]) == 3 * 8
    assert [k for k, v in original["state"].items() if not torch.equal(again["state"][k], v)] == []


def test_without_the_optimizer_the_plain_form_lists_the_values_it_leaves_out(tmp_path: Path, run_ckptkit: Any) -> None:
    # the optimizer's parameter groups are values, not tensors: left out with its moments, each
    # listed with its reason (this was an internal error)
    converted, out = tmp_path / "converted", tmp_path / "dcp"
    assert run_ckptkit("convert", str(FIXTURES / "dcp-fsdp2-fp32"), str(converted)).returncode == 0
    proc = run_ckptkit("export", str(converted), str(out), "--format", "dcp", "--dcp-form", "plain", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    reasons = {e["name"]: e["reason"] for e in report["skipped"]}
    values = {name for name, why in reasons.items() if why == "an optimizer value, which the dcp export writes only with --include-optimizer"}
    assert values == set(ckptkit.read_manifest(converted).objects) and "optim/param_groups/0/lr" in values
    moments = {name for name, why in reasons.items() if why == "the dcp export holds no optimizer tensors without --include-optimizer"}
    assert report["not_held"] == {"optimizer": 24} and len(moments) == 24 and len(reasons) == 24 + len(values)
    from torch.distributed.checkpoint import FileSystemReader

    assert not any(k.startswith("optim") for k in FileSystemReader(str(out)).read_metadata().state_dict_metadata)


@pytest.mark.multiprocess
def test_an_fsdp2_save_reshards_without_a_layout_and_its_job_resumes_from_the_export(tmp_path: Path, run_ckptkit: Any) -> None:
    # the converter records the FSDP2 view (every parameter and its moments cut on dim 0 over DP):
    # reshard to dp 3 at ZeRO 3 (uneven and empty chunks: 11, 5 and 1 rows) with no --layout, then
    # back to DCP; the job that saved the original resumes from it exactly as from the original
    source, converted, resharded, out = (FIXTURES / "dcp-fsdp2-fp32", tmp_path / "converted", tmp_path / "dp3",
                                         tmp_path / "dcp")
    assert run_ckptkit("convert", str(source), str(converted)).returncode == 0
    proc = run_ckptkit("reshard", str(converted), str(resharded), "--dp", "3", "--zero", "3")
    assert proc.returncode == 0, proc.stderr
    manifest = ckptkit.open(str(resharded)).manifest
    assert manifest.layout is not None and manifest.layout["name"] == "fsdp2"
    cuts = {fqn: sorted(s.box.lengths[0] for s in iter_shards(t)) for fqn, t in manifest.tensors.items() if t.shape}
    assert cuts["model/embed/weight"] == cuts["optim/state/embed/weight/exp_avg_sq"] == [3, 4, 4]
    assert cuts["model/head/weight"] == [1] and len(list(iter_shards(manifest.tensors["optim/state/head/weight/step"]))) == 1
    assert run_ckptkit("diff", str(converted), str(resharded)).returncode == 0
    assert run_ckptkit("reshard", str(converted), str(tmp_path / "tp2"), "--tp", "2").returncode == 1  # no TP cut known
    proc = run_ckptkit("export", str(resharded), str(out), "--format", "dcp", "--include-optimizer")
    assert proc.returncode == 0, proc.stderr
    original, again = _resumed(source, tmp_path / "original"), _resumed(out, tmp_path / "again")
    assert again["groups"] == original["groups"]
    assert (again["loss"], again["after"]) == (original["loss"], original["after"]) and again["after"] < again["loss"]
    assert [k for k, v in original["state"].items() if not torch.equal(again["state"][k], v)] == []


def test_bytes_values_and_a_complex_buffer_come_in_and_go_back(tmp_path: Path, run_ckptkit: Any) -> None:
    # as a torchtitan-style save holds them: a dataloader's state as bytes (pickled through
    # _codecs.encode), a complex64 rotary table (safetensors' C64)
    save, converted, out = tmp_path / "save", tmp_path / "converted", tmp_path / "dcp"
    blob = bytes(range(256)) + b"\x00tail"
    state = {"model": {"w": torch.randn(3, 4), "freqs_cis": torch.polar(torch.ones(4, 2), torch.randn(4, 2))},
             "dataloader": {"state": blob, "step": 7}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(save), no_dist=True)
    proc = run_ckptkit("convert", "--from", "dcp", str(save), str(converted))
    assert proc.returncode == 0, proc.stderr
    loaded = ckptkit.load(converted)
    assert loaded["dataloader"] == {"state": blob, "step": 7}
    assert loaded["model"]["freqs_cis"].dtype == torch.complex64 and torch.equal(loaded["model"]["freqs_cis"], state["model"]["freqs_cis"])
    assert ckptkit.open(str(converted)).manifest.tensors["model/freqs_cis"].dtype == "complex64"
    assert run_ckptkit("export", str(converted), str(out), "--format", "dcp").returncode == 0
    back: dict[str, Any] = {"dataloader": {"state": b"", "step": 0},
                            "model": {"w": torch.empty(3, 4), "freqs_cis": torch.empty(4, 2, dtype=torch.complex64)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, checkpoint_id=str(out), no_dist=True)
    assert back["dataloader"] == {"state": blob, "step": 7} and torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["model"]["freqs_cis"], state["model"]["freqs_cis"])
    # diff compares complex values as points of the plane
    moved = tmp_path / "moved"
    ckptkit.save({"model": {"w": loaded["model"]["w"], "freqs_cis": loaded["model"]["freqs_cis"] * 1j}}, str(moved), step=0)
    same = tmp_path / "same"
    ckptkit.save({"model": {"w": loaded["model"]["w"], "freqs_cis": loaded["model"]["freqs_cis"]}}, str(same), step=0)
    report = ckptkit.diff(str(same), str(moved))
    (only,) = report.differences
    assert only.name == "model/freqs_cis" and only.mismatched == 8 and abs(only.max_abs - 2 ** 0.5) < 1e-6
