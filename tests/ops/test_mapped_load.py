"""Mapped loads (``ckptkit.load(path, mapped=True)``): tensors that view their payload files, every
block checked through the mapping, the same values as a plain load."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.errors import IntegrityError
from ckptkit.state import mapped as mapped_io
from ckptkit.storage.memory import MemoryStorage


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(300, 257, generator=g),  # non-square, 3 blocks of 128 KiB
                      "b": torch.randn(7, generator=g).to(torch.bfloat16),
                      "i": torch.arange(5, dtype=torch.int64),
                      "s": torch.tensor(3.0),
                      "e": torch.zeros(0, 4)},
            "step": 5}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _payload(path: Path) -> Path:
    (file,) = [p for p in path.iterdir() if p.name.endswith(".safetensors")]
    return file


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _locked_kib() -> int:
    return _status_kib("VmLck")


def _is_mapped(t: torch.Tensor, file: Path) -> bool:
    """Whether `t` views a mapping of `file` whole (its storage is the file's bytes)."""
    return t.untyped_storage().nbytes() == os.path.getsize(file)


def test_a_mapped_load_returns_views_of_the_file_with_the_plain_loads_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mapped_io, "CHUNK", 128 << 10)  # one block a task: the file is locked and checked in several
    state = _state()
    ckptkit.save(state, tmp_path / "step_1", step=1)
    plain = ckptkit.load(tmp_path / "step_1")
    locked_before = _locked_kib() if sys.platform.startswith("linux") else 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # locked here (root): no warning
        got = ckptkit.load(tmp_path / "step_1", mapped=True)
    assert got["step"] == 5
    if sys.platform.startswith("linux"):
        assert _locked_kib() - locked_before >= os.path.getsize(_payload(tmp_path / "step_1")) // 1024  # every page, till the tensors go
    file = _payload(tmp_path / "step_1")
    for name, want in state["model"].items():
        t = got["model"][name]
        assert t.dtype == want.dtype and t.shape == want.shape and _bits(t) == _bits(want) == _bits(plain["model"][name])
        assert _is_mapped(t, file) == (want.numel() > 0), name  # an empty tensor has no bytes to map
    if sys.platform.startswith("linux"):
        del got, t
        gc.collect()
        assert _locked_kib() == locked_before


def test_writing_a_mapped_tensor_copies_the_page_and_leaves_the_checkpoint(tmp_path: Path) -> None:
    state = _state()
    ckptkit.save(state, tmp_path / "step_1", step=1)
    before = _payload(tmp_path / "step_1").read_bytes()
    got = ckptkit.load(tmp_path / "step_1", mapped=True)
    got["model"]["w"][0, 0] = 42.0
    got["model"]["w"].mul_(2)
    assert _payload(tmp_path / "step_1").read_bytes() == before
    assert ckptkit.verify(str(tmp_path / "step_1")).ok
    again = ckptkit.load(tmp_path / "step_1", mapped=True)
    assert _bits(again["model"]["w"]) == _bits(state["model"]["w"])
    del got, again  # the mappings close with their tensors


def test_a_damaged_block_fails_the_mapped_load(tmp_path: Path) -> None:
    ckptkit.save(_state(), tmp_path / "step_1", step=1)
    file = _payload(tmp_path / "step_1")
    data = bytearray(file.read_bytes())
    data[len(data) - 1000] ^= 0x01  # a tensor byte in the file's last block
    file.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="does not match its checksum"):
        ckptkit.load(tmp_path / "step_1", mapped=True)


def test_unlocked_pages_warn_and_still_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    ckptkit.save(state, tmp_path / "step_1", step=1)
    monkeypatch.setattr(mapped_io, "_mlock", lambda: lambda address, length: -1)  # as for want of CAP_IPC_LOCK
    with pytest.warns(mapped_io.UnlockedWarning, match="could not be locked"):
        got = ckptkit.load(tmp_path / "step_1", mapped=True)
    assert _bits(got["model"]["w"]) == _bits(state["model"]["w"])


def test_patched_tensors_and_other_storage_are_read(tmp_path: Path) -> None:
    """An incremental step's patched tensor is read and patched, not mapped; a storage of no local
    files maps nothing; both give the saved values."""
    first = _state()
    second = {"model": {**first["model"], "b": first["model"]["b"].clone()}, "step": 6}
    second["model"]["b"][3] += 1
    ckptkit.save(first, tmp_path / "run" / "step_1", step=1, incremental=True)
    ckptkit.save(second, tmp_path / "run" / "step_2", step=2, incremental=True)
    assert ckptkit.read_manifest(str(tmp_path / "run" / "step_2")).tensors["model/b"].patches
    got = ckptkit.load(tmp_path / "run" / "step_2", mapped=True)
    assert _bits(got["model"]["b"]) == _bits(second["model"]["b"])
    assert got["model"]["b"].untyped_storage().nbytes() == 7 * 2
    storage = MemoryStorage()
    ckptkit.save(first, "step_1", step=1, storage=storage)
    got = ckptkit.load("step_1", storage=storage, mapped=True)
    assert all(_bits(got["model"][k]) == _bits(v) for k, v in first["model"].items())


def test_mapped_with_a_target_is_refused(tmp_path: Path) -> None:
    state = _state()
    ckptkit.save(state, tmp_path / "step_1", step=1)
    with pytest.raises(ValueError, match="give no target"):
        ckptkit.load(tmp_path / "step_1", state, mapped=True)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_mapped_load_copies_no_page(tmp_path: Path) -> None:
    """Locked and checked, a mapped tensor is still the page cache's pages: the load adds no
    anonymous memory (locking the tensors' own private mapping would copy all 64 MiB)."""
    ckptkit.save({"w": torch.randn(16 << 20)}, tmp_path / "step_1", step=1)
    gc.collect()
    before = _status_kib("RssAnon")
    got = ckptkit.load(tmp_path / "step_1", mapped=True)
    assert _is_mapped(got["w"], _payload(tmp_path / "step_1"))
    assert _status_kib("RssAnon") - before < 16 << 10  # KiB: far below the tensor's 64 MiB


def test_a_tensor_at_an_unaligned_offset_is_read_not_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    ckptkit.save(state, tmp_path / "step_1", step=1)
    aligned = mapped_io.Reader.begin

    def begin(self: Any, read: Any, dtype: str) -> int:  # the fp32 "w" as if its bytes began one byte later
        return aligned(self, read, dtype) + (1 if read.key.endswith("w") and dtype == "float32" else 0)

    monkeypatch.setattr(mapped_io.Reader, "begin", begin)
    checkpoint = ckptkit.open(tmp_path / "step_1")
    assert set(checkpoint._mapped_views()) == {"model/b", "model/i", "model/s"}  # "w" refused before any mapping
    monkeypatch.setattr(mapped_io.Reader, "begin", aligned)
    got = checkpoint.load(mapped=True)
    assert all(_bits(got["model"][k]) == _bits(v) for k, v in state["model"].items())
