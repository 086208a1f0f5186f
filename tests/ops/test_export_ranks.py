"""`export` under torchrun: the ranks split the files (the Hugging Face shards; another format's
files rank 0 writes), and the export is what one process writes, file for file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptkit

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Hugging Face Llama fixture converted and resharded to tp 2 (its tensors in several files)."""
    root = tmp_path_factory.mktemp("export-ranks")
    ckptkit.convert(FIXTURES / "hf" / "llama", root / "converted")
    ckptkit.reshard(root / "converted", root / "tp2", ckptkit.Topology(world_size=2, tp=2), update_latest=False)
    return root / "tp2"


def _export(src: Path, dst: Path, ranks: int, *options: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "ckptkit.cli", "export", str(src), str(dst), "--json", *options]
    if ranks > 1:
        cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "ckptkit.cli"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)


UNIQUE = ("export_report.json", "manifest.json")  # each export's own: its time, and (zarr) its checkpoint id


def _files(out: Path) -> dict[str, bytes]:
    """Every file of an export but its report and (the zarr form) its manifest, by path; the manifest's tensors."""
    files = {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name not in UNIQUE}
    manifest = out / "manifest.json"
    return files | ({"tensors": json.dumps(json.loads(manifest.read_text())["tensors"]).encode()} if manifest.exists() else {})


def _report(out: Path) -> dict:
    report = json.loads((out / "export_report.json").read_text())
    return {k: v for k, v in report.items() if k not in ("seconds", "destination")}


@pytest.mark.parametrize("options", [("--format", "hf", "--max-shard-size", "2KB"), ("--format", "zarr")], ids=["hf", "zarr"])
def test_two_and_four_ranks_write_what_one_process_does(converted: Path, options: tuple[str, ...], tmp_path: Path) -> None:
    one = _export(converted, tmp_path / "one", 1, *options)
    assert one.returncode == 0, one.stderr
    files = _files(tmp_path / "one")
    assert len([f for f in files if f.endswith(".safetensors")]) >= 3 or options[1] == "zarr"
    for ranks in ((2, 4) if options[1] == "hf" else (2,)):
        out = tmp_path / f"ranks{ranks}"
        done = _export(converted, out, ranks, *options)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.count('"destination"') == 1  # rank 0 alone prints
        assert _files(out) == files and _report(out) == _report(tmp_path / "one")
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_a_refusal_is_said_once_and_nothing_is_written(converted: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    done = _export(converted, tmp_path / "taken", 2, "--format", "hf")
    assert done.returncode == 1
    said = [line for line in done.stderr.splitlines() if line.startswith("ckptkit: error: ")]
    assert len(said) == 1 and "already exists" in said[0], done.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["taken"] and not any((tmp_path / "taken").iterdir())


def test_each_rank_writes_its_own_shards_and_rank_0_the_rest(converted: Path, tmp_path: Path) -> None:
    from ckptkit.exports.source import Source
    from ckptkit.io.payload import open_checkpoint
    from ckptkit.storage import open_storage
    from ckptkit_adapters.hf.writer import hf_writer

    loc, manifest = open_checkpoint(converted)
    with Source(loc, manifest) as source:
        writer = hf_writer(source, None, 2000)
        assert writer.write_part is not None
        parts = [writer.write_part(source, open_storage(tmp_path), f"r{r}", r, 2) for r in (0, 1)]
    shards = sorted(p.name for p in tmp_path.glob("r*/model-*.safetensors"))
    n = len(shards)
    assert n >= 3 and sorted(f.path for p in parts for f in p.files if f.path.startswith("model-0")) == shards
    assert [f.path for f in parts[1].files] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(2, n + 1, 2)]
    assert "model.safetensors.index.json" in {f.path for f in parts[0].files} and not list((tmp_path / "r1").glob("*.json"))
