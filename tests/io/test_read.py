"""The byte engine checks every byte it returns against block checksums, whatever the read pattern."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.errors import IntegrityError
from ckptkit.io import checksum
from ckptkit.layouts import reference_llama
from ckptkit.storage import MemoryStorage

LLAMA = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=2,
             rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, max_seq_len=16)


def test_every_payload_file_records_the_checksum_of_each_block(tmp_path: Path) -> None:
    with mock.patch.object(checksum, "MIN_BLOCK", 1000):
        ckptkit.save({"model": {"w": torch.arange(5000.0)}}, tmp_path / "ck", step=1)
    (entry,) = ckptkit.read_manifest(str(tmp_path / "ck")).files
    data = (tmp_path / "ck" / entry.path).read_bytes()
    assert entry.blocks is not None and entry.blocks.size == 1000 and len(data) == entry.size > 20000
    want = b"".join(xxhash.xxh3_64_digest(data[i : i + 1000]) for i in range(0, len(data), 1000))
    assert entry.blocks.digests is None and entry.sidecar()  # schema 1.5: the digests sit beside the file
    assert (tmp_path / "ck" / (entry.path + ".blocks")).read_bytes() == want
    assert entry.checksum == "xxh3-128-blocks:" + xxhash.xxh3_128_hexdigest(want)  # which covers them


@pytest.mark.parametrize("damage", ["missing", "flipped", "short"])
def test_a_missing_or_damaged_sidecar_fails_every_read_and_verify_names_it(tmp_path: Path, damage: str) -> None:
    with mock.patch.object(checksum, "MIN_BLOCK", 1000):
        ckptkit.save({"model": {"w": torch.arange(5000.0)}}, tmp_path / "ck", step=1)
    sidecar = tmp_path / "ck" / "rank00000.safetensors.blocks"
    digests = sidecar.read_bytes()
    if damage == "missing":
        sidecar.unlink()
    else:
        sidecar.write_bytes(digests[:-8] if damage == "short" else bytes([digests[0] ^ 1]) + digests[1:])
    with pytest.raises(IntegrityError, match=r"rank00000\.safetensors\.blocks: .*the file's blocks cannot be checked"):
        ckptkit.load(tmp_path / "ck")
    report = ckptkit.verify(tmp_path / "ck")  # the payload's bytes are sound: the finding is the sidecar, once
    assert [(f.code, f.where) for f in report.findings] == [("checksum", "rank00000.safetensors")]
    assert "rank00000.safetensors.blocks" in report.findings[0].message


def test_a_checkpoint_of_manifest_digests_and_one_of_sidecars_read_the_same(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(5000.0).reshape(50, 100)}}
    with mock.patch.object(checksum, "MIN_BLOCK", 1000):
        inline = ckptkit.save(state, tmp_path / "inline", step=1, digests_in_manifest=True)
        beside = ckptkit.save(state, tmp_path / "beside", step=1)
    assert inline.files[0].blocks.digests is not None and not (tmp_path / "inline" / "rank00000.safetensors.blocks").exists()
    assert beside.files[0].sidecar() and inline.files[0].checksum == beside.files[0].checksum
    part = ShardedTensor(torch.empty(20, 30), (50, 100), (10, 40))
    for path in ("inline", "beside"):
        ckptkit.load(tmp_path / path, {"model": {"w": part}})
        assert torch.equal(part.local, state["model"]["w"][10:30, 40:70]) and ckptkit.verify(tmp_path / path).ok


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3), st.data())
def test_any_box_of_a_checkpoint_with_small_blocks_loads_exactly(shape: list[int], data: st.DataObject) -> None:
    g = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) * 0.5
    cut = data.draw(st.integers(0, shape[0]))
    pieces = [ShardedTensor(g[:cut].clone(), tuple(shape), (0,) * len(shape)),
              ShardedTensor(g[cut:].clone(), tuple(shape), (cut,) + (0,) * (len(shape) - 1))]
    store = MemoryStorage()
    block = data.draw(st.sampled_from([8, 12, 64, 1 << 20]))
    with mock.patch.object(checksum, "MIN_BLOCK", block):
        ckptkit.save({"w": [p for p in pieces if p.local.numel()]}, "ck", step=1, storage=store, max_file_bytes=64)
    lo = [data.draw(st.integers(0, n - 1)) for n in shape]
    lengths = [data.draw(st.integers(1, n - o)) for n, o in zip(shape, lo)]
    target = ShardedTensor(torch.zeros(lengths), tuple(shape), tuple(lo))
    small_run = data.draw(st.sampled_from([1, 16, 1 << 16]))
    with mock.patch("ckptkit.io.read.SMALL_RUN", small_run):
        ckptkit.load("ck", {"w": target}, storage=store)
    assert torch.equal(target.local, g[tuple(slice(o, o + n) for o, n in zip(lo, lengths))])


def _save_llama(path: Path) -> None:
    layout = reference_llama(LLAMA)
    torch.manual_seed(0)
    state: dict = {"model": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    for name, shape in layout.tensors().items():
        state["model"][name] = torch.randn(shape)
        state["optimizer"]["exp_avg"][name] = torch.randn(shape) * 1e-3
        state["optimizer"]["exp_avg_sq"][name] = torch.rand(shape) * 1e-6
    info = ckptkit.CheckpointInfo(model=ckptkit.ModelInfo(family="llama", config=LLAMA))
    ckptkit.save(state, str(path), step=3, layout=layout, info=info)


def _flip_in(path: Path, tensor: str) -> None:
    """Flip one bit inside the bytes of `tensor` in its payload file."""
    import json

    payload = path / "rank00000.safetensors"
    data = bytearray(payload.read_bytes())
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    start = 8 + int.from_bytes(data[:8], "little") + header[tensor]["data_offsets"][0]
    data[start + 5] ^= 0x04
    payload.write_bytes(bytes(data))


@pytest.fixture
def flipped(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "step_00000003"
    _save_llama(path)
    _flip_in(path, "model/layers.1.attn.k.weight")
    return path


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptkit.cli", *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("fmt", ["hf", "dcp", "zarr"])
def test_export_refuses_a_flipped_payload_byte_and_writes_nothing(flipped: Path, tmp_path: Path, fmt: str) -> None:
    dst = tmp_path / f"out-{fmt}"
    done = _cli("export", str(flipped), str(dst), "--format", fmt)
    assert done.returncode == 1, done.stderr
    assert len(done.stderr.splitlines()) == 1 and "does not match its checksum" in done.stderr
    assert not dst.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_every_reader_refuses_a_flipped_payload_byte(flipped: Path, tmp_path: Path) -> None:
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        ckptkit.load(str(flipped))
    k = ShardedTensor(torch.zeros(8, 16), (16, 16), (8, 0))  # the half of the tensor holding the flip
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        ckptkit.load(str(flipped), {"model": {"layers.1.attn.k.weight": k}})
    report = ckptkit.verify(str(flipped))
    assert [(f.code, f.where) for f in report.findings] == [("checksum", "rank00000.safetensors")]
    assert "1 block(s) of 131072 bytes do not match their checksums" in report.findings[0].message
    for args in (("diff", str(flipped), str(flipped)), ("reshard", str(flipped), str(tmp_path / "r"), "--tp", "2")):
        done = _cli(*args)
        assert done.returncode == 1 and "does not match" in done.stderr and len(done.stderr.splitlines()) == 1, args
    assert not (tmp_path / "r").exists()


def test_two_reads_of_one_call_read_the_block_they_share_once() -> None:
    store = MemoryStorage()
    a = torch.arange(3000, dtype=torch.float32)
    with mock.patch.object(checksum, "MIN_BLOCK", 1000):
        ckptkit.save({"a": a}, "ck", step=1, storage=store)
    opened = ckptkit.open("ck", storage=store)
    one = ShardedTensor(torch.empty(900), (3000,), (2000,))  # bytes [8000, 11600) of a's data
    two = ShardedTensor(torch.empty(40), (3000,), (2950,))  # bytes [11800, 11960): 200 bytes further
    opened._reader.header_of(0)  # the header (and its blocks) first, counted apart
    before = opened._reader.bytes_read
    opened.load({"a": [one, two]})
    assert torch.equal(one.local, a[2000:2900]) and torch.equal(two.local, a[2950:2990])
    start = opened._reader.headers[0][0].data_start
    first, last = (start + 8000) // 1000, (start + 11960 - 1) // 1000
    touched = min((last + 1) * 1000, opened.manifest.files[0].size) - first * 1000
    assert opened._reader.bytes_read - before == touched  # every touched block once, nothing else
