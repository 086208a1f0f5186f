"""Checkpoints of every earlier manifest version load, verify and reshard: the 1.1 Llama (before
layouts were recorded) also exports; 1.2 (layouts, block checksums, the seal), 1.3 (a converted
checkpoint's source) and 1.4 (an incremental chain) are each a frozen fixture in their newest form."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from ckptkit.layouts import reference_llama

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA_V1_1 = FIXTURES / "llama-v1.1"
NAME = "step_00000005"


@pytest.fixture(scope="module")
def fixtures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def test_the_1_1_llama_fixture_is_a_1_1_manifest_without_a_layout() -> None:
    manifest = ckptkit.read_manifest(str(LLAMA_V1_1))
    assert manifest.schema_version == "1.1" and manifest.layout is None
    assert ckptkit.verify(str(LLAMA_V1_1)).ok


def test_the_1_1_llama_fixture_loads_its_exact_values(fixtures: ModuleType) -> None:
    loaded = _flat(ckptkit.load(str(LLAMA_V1_1)))
    want = fixtures.llama_v1_1_tensors()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], v) for k, v in want.items())


def test_the_1_1_llama_fixture_reshards_with_the_built_in_layout_and_back(tmp_path: Path) -> None:
    there = tmp_path / "tp2" / NAME
    report = ckptkit.reshard(str(LLAMA_V1_1), str(there), ckptkit.Topology(world_size=4, tp=2, dp=2, zero_stage=1))
    assert report.tensors == 63 and ckptkit.diff(str(LLAMA_V1_1), str(there)).ok
    manifest = ckptkit.read_manifest(str(there))
    assert manifest.layout == reference_llama(manifest.info.model.config).to_json()  # type: ignore[union-attr]
    back = tmp_path / "tp1" / NAME
    ckptkit.reshard(str(there), str(back), ckptkit.Topology(world_size=1), files_per_rank=1)  # every box listed, as 1.1 saved
    original = (LLAMA_V1_1 / NAME / "rank00000.safetensors").read_bytes()
    assert (back / "rank00000.safetensors").read_bytes() == original
    derived = tmp_path / "tp1-derived" / NAME  # as a save with the layout writes it: the same values
    ckptkit.reshard(str(there), str(derived), ckptkit.Topology(world_size=1))
    assert ckptkit.read_manifest(str(derived)).derived is not None and ckptkit.diff(str(LLAMA_V1_1), str(derived)).ok


def test_the_1_1_llama_fixture_exports_to_hugging_face(fixtures: ModuleType, tmp_path: Path) -> None:
    report = ckptkit.export(str(LLAMA_V1_1), str(tmp_path / "hf"), dtype="fp32")
    assert report.tensors == 21
    weights = load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors")
    want = fixtures.llama_v1_1_tensors()
    assert torch.equal(weights["model.layers.1.self_attn.k_proj.weight"], want["model/layers.1.attn.k.weight"])
    assert torch.equal(weights["lm_head.weight"], want["model/lm_head.weight"])


def test_a_partial_load_of_a_1_1_checkpoint_says_once_that_it_is_not_checked(fixtures: ModuleType) -> None:
    import warnings

    from ckptkit import ShardedTensor
    from ckptkit.io import read

    read._WARNED.clear()
    want = fixtures.llama_v1_1_tensors()
    fqn = next(k for k, v in want.items() if v.dim() == 2 and v.shape[0] > 1)
    rows = want[fqn].shape[0] // 2
    target = ShardedTensor(torch.empty(rows, want[fqn].shape[1], dtype=want[fqn].dtype), tuple(want[fqn].shape), (rows, 0))
    prefix, _, leaf = fqn.rpartition("/")
    tree: dict = {}
    node = tree
    for part in prefix.split("/"):
        node = node.setdefault(part, {})
    node[leaf] = target
    with pytest.warns(UserWarning, match="partial reads of its files are not checked"):
        ckptkit.load(str(LLAMA_V1_1), tree)
    assert torch.equal(target.local, want[fqn][rows:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckptkit.load(str(LLAMA_V1_1), tree)  # said once


VERSIONS = {"v1": "1.0", "llama-v1.1": "1.1", "llama-v1.2": "1.2", "hf-llama-v1.3": "1.3", "llama-v1.4": "1.4", "llama-v1.5": "1.5",
            "llama-v1.6": "1.6"}


@pytest.mark.parametrize("root", VERSIONS)
def test_each_version_reads_as_written_and_verifies(root: str) -> None:
    manifest = ckptkit.read_manifest(str(FIXTURES / root))
    assert manifest.schema_version == VERSIONS[root]
    report = ckptkit.verify(str(FIXTURES / root))
    assert report.ok and report.files == len(manifest.files) and report.bytes_read > 0


def _want(fixtures: ModuleType, root: str, step: int = 5) -> dict[str, torch.Tensor]:
    """The tensors fixture `root` holds at `step`, from what its script wrote (the 1.3 one: the Hugging Face model's file)."""
    if root == "hf-llama-v1.3":
        return {f"model/{k}": v for k, v in load_file(FIXTURES / "hf" / "llama" / "model.safetensors").items()}
    return fixtures.llama_v1_4_tensors(step) if root == "llama-v1.4" else fixtures.llama_v1_1_tensors()


@pytest.mark.parametrize(("root", "step"), [("llama-v1.2", 5), ("hf-llama-v1.3", 5), ("llama-v1.4", 5), ("llama-v1.4", 6),
                                           ("llama-v1.5", 5), ("llama-v1.6", 5)])
def test_each_version_loads_its_exact_values(fixtures: ModuleType, root: str, step: int) -> None:
    loaded = _flat(ckptkit.load(str(FIXTURES / root / f"step_{step:08d}")))
    want = _want(fixtures, root, step)
    assert loaded.keys() == want.keys()
    assert all(loaded[k].dtype == v.dtype and torch.equal(loaded[k], v) for k, v in want.items())


@pytest.mark.parametrize("root", ["llama-v1.2", "hf-llama-v1.3", "llama-v1.4", "llama-v1.5", "llama-v1.6"])
def test_each_version_reshards_with_its_recorded_layout(fixtures: ModuleType, root: str, tmp_path: Path) -> None:
    manifest = ckptkit.read_manifest(str(FIXTURES / root))
    topology = ckptkit.Topology(world_size=1) if manifest.topology.world_size > 1 else ckptkit.Topology(world_size=2, tp=2)
    there = tmp_path / "there" / "step_00000009"
    ckptkit.reshard(str(FIXTURES / root), str(there), topology)
    assert ckptkit.read_manifest(str(there)).topology == topology and ckptkit.verify(str(there)).ok
    loaded = _flat(ckptkit.load(str(there)))
    want = _want(fixtures, root, manifest.step)
    assert all(torch.equal(loaded[k], v) for k, v in want.items()) and loaded.keys() == want.keys()
    if root in ("llama-v1.2", "llama-v1.5", "llama-v1.6"):  # back at one rank: the 1.1 checkpoint resharded there, byte for byte
        again = tmp_path / "again" / "step_00000009"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the 1.1 source's partial reads are not checked: it is read whole
            ckptkit.reshard(str(LLAMA_V1_1), str(again), topology)
        assert (there / "rank00000.safetensors").read_bytes() == (again / "rank00000.safetensors").read_bytes()
