"""Export to torch DCP and to the zarr form, on small hand-made checkpoints of many dtypes and shapes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.errors import CheckpointExistsError, LayoutError, StorageError
from ckptkit.exports.run import REPORT_NAME, export
from ckptkit.manifest import BoxShard, BoxShards, TensorEntry
from ckptkit.state.sharded import ShardedTensor
from ckptkit.storage import MemoryStorage
from ckptkit_adapters.zarr.writer import plan_arrays, zarr_metadata

zarr = pytest.importorskip("zarr")
ts = pytest.importorskip("tensorstore")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            "w": torch.randn(13, 5, generator=g),
            "half": torch.randn(6, 3, generator=g).to(torch.float16),
            "b16": torch.randn(9, 4, generator=g).to(torch.bfloat16),
            "bias": torch.zeros(11),
            "scale": torch.tensor(2.5),
            "empty": torch.zeros(0, 4),
            "cube": torch.randn(5, 2, 3, generator=g, dtype=torch.float64),
            "ids": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        },
        "optimizer": {"exp_avg": {"w": torch.randn(13, 5, generator=g)}, "count": torch.arange(10, dtype=torch.int64)},
        "rng": {"mask": torch.rand(4, 7, generator=g) > 0.5, "bytes": torch.randint(0, 255, (2, 33), generator=g, dtype=torch.uint8)},
        "step": 12,
    }


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """The state saved with some tensors cut in row boxes (so they have several shards)."""
    state = _state()
    for group, name in (("model", "w"), ("model", "cube")):
        t = state[group][name]
        state[group][name] = [ShardedTensor(t[:3], tuple(t.shape), (0,) * t.dim()),
                              ShardedTensor(t[3:], tuple(t.shape), (3,) + (0,) * (t.dim() - 1))]
    path = tmp_path / "src"
    ckptkit.save(state, path, step=12, kinds={"rng": "rng", "optimizer/count": "other"})
    assert len(ckptkit.read_manifest(str(path)).tensors["model/w"].shards.boxes) == 2  # type: ignore[union-attr]
    return path


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def test_zarr_plan_cuts_rows_into_chunks_that_tile_the_tensor() -> None:
    entry = TensorEntry(shape=(10, 3), dtype="float32", kind="param",
                        shards=BoxShards(boxes=(BoxShard(offsets=(0, 0), lengths=(10, 3), file=0, key="x"),)))
    (plan,) = plan_arrays({"model/x": entry}, chunk_bytes=40)  # 12 bytes a row: 3 rows a chunk
    assert plan.chunk_shape == (3, 3)
    assert [c.path for c in plan.chunks] == [f"model/x/c/{i}/0" for i in range(4)]
    assert [(c.box.offsets, c.box.lengths, c.size) for c in plan.chunks] == [
        ((0, 0), (3, 3), 36), ((3, 0), (3, 3), 36), ((6, 0), (3, 3), 36), ((9, 0), (1, 3), 36)]
    meta = zarr_metadata(plan)
    assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [3, 3] and meta["codecs"][0]["name"] == "bytes"
    for bad in ("model/__x", "model//x", "tokenizer/x", "manifest.json", "a/../b", "a/zarr.json"):
        with pytest.raises(LayoutError, match="cannot write the zarr form"):
            plan_arrays({bad: entry})


def test_zarr_form_is_a_checkpoint_and_a_zarr_group_bit_for_bit(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "form.zarr"
    report = export(source, dst, format="zarr", chunk_bytes=64)
    want = _flat(_state())
    want.pop("step")
    assert sorted(t.name for t in report.tensor_list) == sorted(want) and report.skipped == []
    # An ordinary committed checkpoint: verify checks every chunk, load gives every tensor back bitwise.
    assert ckptkit.verify(str(dst)).ok
    back = _flat(ckptkit.load(str(dst)))
    assert back.pop("step") == 12
    for name, t in want.items():
        assert back[name].dtype == t.dtype and torch.equal(_bits(back[name]), _bits(t)), name
    manifest = ckptkit.read_manifest(str(dst))
    assert len(manifest.tensors["model/w"].shards.boxes) == 5  # 3 rows of 20 bytes a chunk; type: ignore[union-attr]
    assert {f.encoding for f in manifest.files if f.role == "tensors"} == {"raw"}
    # A zarr v3 group: zarr-python reads any slice of every array it has a type for...
    group = zarr.open_group(str(dst), mode="r")
    assert group.attrs["ckptkit"]["step"] == 12
    for name, t in want.items():
        if t.dtype == torch.bfloat16:
            continue
        got = group[name]
        assert tuple(got.shape) == tuple(t.shape)
        if t.dim() >= 2 and t.shape[0] > 3:
            assert (got[2:-1, 1:] == t[2:-1, 1:].numpy()).all(), name
        assert (got[...] == t.numpy()).all(), name
    # ...and tensorstore also reads bfloat16 (zarr-python 3.1 has no bfloat16 type yet).
    b16 = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(dst / "model" / "b16")}}).result()
    got16 = torch.from_numpy(b16.read().result().view("uint16").astype("int32")).to(torch.int16)
    assert torch.equal(got16, want["model/b16"].view(torch.int16))
    assert json.loads((dst / REPORT_NAME).read_text())["format"] == "zarr"


def test_a_corrupt_zarr_chunk_is_caught_by_verify_and_load(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "form.zarr"
    export(source, dst, format="zarr", chunk_bytes=64)
    chunk = dst / "model" / "w" / "c" / "1" / "0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0x10
    chunk.write_bytes(bytes(data))
    report = ckptkit.verify(str(dst))
    assert not report.ok and [f.code for f in report.findings] == ["checksum"]
    with pytest.raises(ckptkit.IntegrityError, match="checksum"):
        ckptkit.load(str(dst))


def test_a_zarr_form_reshards_and_exports_like_its_source(source: Path, tmp_path: Path) -> None:
    form = tmp_path / "form.zarr"
    export(source, form, format="zarr", chunk_bytes=100)
    # Loading a box of a tensor reads it from whichever chunks hold it.
    target = {"model": {"w": ShardedTensor(torch.empty(5, 5), (13, 5), (4, 0))}}
    got = ckptkit.load(str(form), target)["model"]["w"].local
    assert torch.equal(got, _state()["model"]["w"][4:9])
    # diff sees the same logical state; a second export of the form is the same state again.
    assert ckptkit.diff(str(source), str(form), kinds=("param", "optimizer", "rng", "other")).ok
    again = tmp_path / "again.zarr"
    export(form, again, format="zarr")
    assert ckptkit.diff(str(form), str(again), kinds=("param", "optimizer", "rng", "other")).ok
    assert not (again / "export_report.json").read_text().count("form.zarr/export_report.json")


def test_dcp_export_loads_with_torch_dcp_bitwise(source: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader, load

    dst = tmp_path / "dcp"
    report = export(source, dst, format="dcp", dcp_form="plain", include_optimizer=True)
    want = _flat(_state())
    keys = {n.replace("/", ".") for n in want if n != "step"}  # every tensor: the parameters, the optimizer's, the RNG's
    assert {t.name for t in report.tensor_list} == keys and report.skipped == []
    metadata = FileSystemReader(str(dst)).read_metadata()
    assert set(metadata.state_dict_metadata) == keys | {"step"}  # and the values
    plain: dict[str, Any] = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
                             if k != "step"}
    plain["step"] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        load(plain, checkpoint_id=str(dst))
    assert plain.pop("step") == 12
    for key, t in plain.items():
        assert torch.equal(_bits(t), _bits(want[key.replace(".", "/", 1).replace("exp_avg.", "exp_avg/")])), key
    # Without --include-optimizer all but the optimizer's; with --dtype the floats are converted.
    kinds = {fqn.replace("/", "."): e.kind for fqn, e in ckptkit.read_manifest(source).tensors.items()}
    small = export(source, tmp_path / "dcp16", format="dcp", dcp_form="plain", dtype="bf16")
    assert {t.name for t in small.tensor_list} == {k for k, kind in kinds.items() if kind != "optimizer"} and small.dtype == "bfloat16"
    assert {e.name for e in small.skipped} == {f for f, e in ckptkit.read_manifest(source).tensors.items() if e.kind == "optimizer"}
    metadata = FileSystemReader(str(tmp_path / "dcp16")).read_metadata()
    dtypes = {k: v.properties.dtype for k, v in metadata.state_dict_metadata.items() if k != "step"}
    saved = {k.replace("/", "."): v.dtype for k, v in want.items() if isinstance(v, torch.Tensor)}
    assert dtypes == {k: torch.bfloat16 if saved[k].is_floating_point else saved[k] for k in dtypes}  # integers keep theirs
    assert dtypes["model.ids"] == torch.int32 and dtypes["rng.mask"] == torch.bool and dtypes["model.w"] == torch.bfloat16


def test_export_refusals_write_nothing(source: Path, tmp_path: Path, run_ckptkit: Any) -> None:
    with pytest.raises(LayoutError, match="saved dtype"):
        export(source, tmp_path / "z", format="zarr", dtype="bf16")
    with pytest.raises(LayoutError, match="available: dcp, deepspeed, hf, hf-trainer, megatron, peft, torchtitan, zarr"):
        export(source, tmp_path / "z", format="onnx")
    with pytest.raises(StorageError, match="local directory"):
        export(source, "z", format="zarr", dst_storage=MemoryStorage())
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointExistsError):
        export(source, tmp_path / "taken", format="dcp", dcp_form="plain")
    assert not (tmp_path / "z").exists()
    bad = run_ckptkit("export", str(source), str(tmp_path / "z"), "--format", "zarr", "--dtype", "fp16")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "saved dtype" in bad.stderr
    bad = run_ckptkit("export", str(source), str(tmp_path / "z"), "--include-optimizer")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    ok = run_ckptkit("export", str(source), str(tmp_path / "z"), "--format", "zarr", "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["format"] == "zarr"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "src", "taken", "z"]  # no temporary left


def test_a_dcp_export_of_a_corrupt_source_is_a_ckptkit_error(source: Path, tmp_path: Path) -> None:
    payload = next(p for p in sorted(source.glob("*.safetensors")))
    data = bytearray(payload.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")  # an absurd header length
    payload.write_bytes(bytes(data))
    with pytest.raises(ckptkit.IntegrityError, match="exceeds"):
        export(source, tmp_path / "dcp", format="dcp", dcp_form="plain", include_optimizer=True)
    assert not (tmp_path / "dcp").exists() and not list(tmp_path.glob(".dcp.tmp-*"))
