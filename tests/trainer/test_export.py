"""Export of real trainer checkpoints to Hugging Face: transformers loads it and computes the same logits."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.io.checksum import checksum_of
from ckptkit.errors import CheckpointExistsError, LayoutError
from ckptkit.exports.run import REPORT_NAME, export
from ckptkit.manifest import Topology, manifest_to_json, seal
from ckptkit.manifest.shards import listed_form
from ckptkit.trainer.data import Tokenizer

from .runs import train, trainer_logits

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A (2,2,2,z1) checkpoint after 4 steps."""
    root = tmp_path_factory.mktemp("export-src")
    train(root / "run", (2, 2, 2, 1), 4)
    return root / "run" / "step_00000004"


def test_fp32_export_loads_in_transformers_with_the_same_logits(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    report = export(source, dst, dtype="fp32", max_shard_bytes=200_000)
    shards = sorted(p.name for p in dst.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(dst), output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(dst))
    text = "the cat sat on the mat.\nit was warm."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == Tokenizer().encode(text).tolist()
    with torch.no_grad():
        theirs = model(ids).logits
    assert (theirs - trainer_logits(source, ids)).abs().max().item() <= 1e-4
    written = json.loads((dst / REPORT_NAME).read_text())
    assert written == json.loads(report.model_dump_json())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(t.name for t in report.tensor_list) and report.tensors == 39
    for t in report.tensor_list[:5]:  # each tensor's checksum is that of its bytes in its file
        tensor = load_file(str(dst / t.file))[t.name]
        assert checksum_of(tensor.contiguous().view(torch.uint8).numpy().tobytes()) == t.checksum
    assert {e.name for e in report.skipped} == {f for f in ckptkit.read_manifest(str(source)).tensors if not f.startswith("model/")}


def test_bf16_export_holds_the_rounded_master_weights(source: Path, tmp_path: Path) -> None:
    export(source, tmp_path / "hf", dtype="bf16")
    whole = ckptkit.load(str(source))["model"]
    got = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert got["model.layers.2.self_attn.k_proj.weight"].dtype == torch.bfloat16
    for name, logical in (("model.embed_tokens.weight", "embed.weight"), ("model.layers.3.mlp.down_proj.weight", "mlp.down.weight")):
        key = logical if logical == "embed.weight" else "layers.3." + logical
        assert torch.equal(got[name].view(torch.int16), whole[key].to(torch.bfloat16).view(torch.int16))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_from_any_topology_gives_byte_identical_files(source: Path, tmp_path: Path) -> None:
    single = tmp_path / "single" / "step_00000004"
    ckptkit.reshard(str(source), str(single), Topology(world_size=1))
    export(source, tmp_path / "a")
    export(single, tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir() if p.name != REPORT_NAME)
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir() if p.name != REPORT_NAME)
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_the_command_counts_what_the_format_does_not_hold_by_kind(source: Path, tmp_path: Path, run_ckptkit: Callable) -> None:
    done = run_ckptkit("export", str(source), str(tmp_path / "hf"), "--allow-skip")
    manifest = ckptkit.open(str(source)).manifest
    kinds = {k: sum(t.kind == k for t in manifest.tensors.values()) for k in ("optimizer", "rng")}
    assert done.returncode == 0 and kinds["optimizer"] and kinds["rng"]
    want = f"{kinds['optimizer'] + kinds['rng']} tensors not exported: {kinds['optimizer']} optimizer, {kinds['rng']} rng)\n"
    assert done.stdout.endswith(want) and "left out" not in done.stdout  # nothing the hf format holds was left out
    report = json.loads((tmp_path / "hf" / "export_report.json").read_text())
    assert report["not_held"] == kinds and not any(e["reason"].startswith("left out") for e in report["skipped"])


def test_export_refuses_bad_input_before_writing(source: Path, tmp_path: Path, run_ckptkit: Callable) -> None:
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointExistsError):
        export(source, tmp_path / "taken")
    with pytest.raises(CheckpointExistsError, match="may not be, contain or lie inside the source"):
        export(source, source / "hf")
    assert not (source / "hf").exists() and ckptkit.verify(str(source)).ok
    bad = run_ckptkit("export", str(source), str(tmp_path / "x"), "--max-shard-size", "lots")
    assert bad.returncode == 2 and bad.stderr.startswith("ckptkit: error: --max-shard-size:") and bad.stderr.count("\n") == 1
    missing = run_ckptkit("export", str(tmp_path / "nothing"), str(tmp_path / "x"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()
    # A checkpoint that lacks a parameter the model config needs: every missing name is listed.
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    doc = json.loads(manifest_to_json(listed_form(ckptkit.read_manifest(str(broken)))))
    for name in ("model/layers.1.attn.q.weight", "model/norm.weight"):
        del doc["tensors"][name]
    (broken / "manifest.json").write_bytes(seal(doc))  # a consistent manifest that lacks them
    with pytest.raises(LayoutError, match=r"2 tensor\(s\) the model config needs are missing: model/layers.1.attn.q.weight, model/norm.weight"):
        export(broken, tmp_path / "y")
    assert not (tmp_path / "y").exists()


def test_a_failed_write_leaves_no_output(source: Path) -> None:
    from ckptkit.errors import StorageError

    from ..fakes import FaultyStorage

    dst = FaultyStorage(fail_write=2)
    with pytest.raises(StorageError, match="No space left"):
        export(source, "hf", dst_storage=dst, max_shard_bytes=200_000)
    assert dst.list("") == []


def test_dcp_export_holds_model_and_optimizer_bitwise(source: Path, tmp_path: Path) -> None:
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    export(source, tmp_path / "dcp", format="dcp", dcp_form="plain", include_optimizer=True)
    saved = ckptkit.load(str(source))
    metadata = FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    plain = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
             if hasattr(v, "properties")}  # the tensors (values are bytes entries)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(plain, checkpoint_id=str(tmp_path / "dcp"))
    expected = {f"model.{k}": v for k, v in saved["model"].items()}
    for moment in ("exp_avg", "exp_avg_sq"):
        expected.update({f"optimizer.{moment}.{k}": v for k, v in saved["optimizer"][moment].items()})
    assert len(expected) == 3 * 39
    rng = {f"rng.{k}": v for k, v in saved["rng"].items()}  # and every other tensor: the RNG's
    assert sorted(plain) == sorted({**expected, **rng}) and rng
    for key, value in expected.items():
        assert torch.equal(plain[key].view(torch.int32), value.view(torch.int32)), key
    assert all(torch.equal(plain[key], value) for key, value in rng.items())


def test_zarr_form_reshards_and_exports_like_the_native_checkpoint(
    source: Path, tmp_path: Path, run_ckptkit: Callable
) -> None:
    zarr = pytest.importorskip("zarr")
    form = tmp_path / "form"
    done = run_ckptkit("export", str(source), str(form), "--format", "zarr")
    assert done.returncode == 0, done.stderr
    saved = ckptkit.load(str(source))
    group = zarr.open_group(str(form), mode="r")
    for name in ("model/embed.weight", "model/layers.1.mlp.up.weight", "optimizer/exp_avg_sq/norm.weight"):
        *path, leaf = name.split("/")
        want = functools.reduce(lambda tree, key: tree[key], path, saved)[leaf]
        assert (group[name][...] == want.numpy()).all(), name
        assert (group[name][3:7, ...] == want[3:7].numpy()).all(), name
    # The form as a reshard source: the same checkpoint as from the native source.
    done = run_ckptkit("reshard", str(form), str(tmp_path / "from-zarr"), "--tp", "1", "--pp", "1", "--dp", "1")
    assert done.returncode == 0, done.stderr
    ckptkit.reshard(str(source), str(tmp_path / "native"), Topology(world_size=1))
    same = run_ckptkit("diff", str(tmp_path / "from-zarr"), str(tmp_path / "native"))
    assert same.returncode == 0, same.stdout + same.stderr
    assert ckptkit.verify(str(tmp_path / "from-zarr")).ok
    assert not list((tmp_path / "from-zarr").rglob("zarr.json"))  # the form's own files stay behind
    # The form as an export source: the same Hugging Face files.
    export(form, tmp_path / "hf-a")
    export(source, tmp_path / "hf-b")
    names = sorted(p.name for p in (tmp_path / "hf-a").iterdir() if p.name != REPORT_NAME)
    for name in names:
        assert (tmp_path / "hf-a" / name).read_bytes() == (tmp_path / "hf-b" / name).read_bytes(), name
