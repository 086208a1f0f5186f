"""Host tensors a load fills: the memory of a large one is advised into transparent huge pages,
and nothing else is (smaller tensors, or with ``CKPTKIT_HUGE_PAGES=0``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ckptkit.state import host_memory
from ckptkit.state.host_memory import HUGE_PAGE, MIN_ADVISED, host_empty

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages")
def test_a_large_host_tensor_is_advised_into_huge_pages_and_holds_what_is_written() -> None:
    t = host_empty((MIN_ADVISED // 4 + 3,), torch.float32)
    assert t.shape == (MIN_ADVISED // 4 + 3,) and t.dtype == torch.float32 and t.device.type == "cpu"
    inner = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # the first whole huge page inside it
    assert "hg" in _vm_flags(inner)
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.float32))


def test_a_tensor_under_the_bound_or_with_the_advice_off_is_not_advised(monkeypatch: pytest.MonkeyPatch) -> None:
    # What ckptkit asks of the kernel, not the mapping's flags: glibc may serve a tensor from
    # heap memory an earlier, larger one was advised in, which the flags would show.
    advised: list[tuple[int, int, int]] = []
    monkeypatch.setattr(host_memory, "_madvise", lambda: lambda start, length, advice: advised.append((start, length, advice)) or 0)
    small = host_empty(((MIN_ADVISED - 4 * HUGE_PAGE) // 4,), torch.float32)  # 24 MiB
    assert small.is_contiguous() and advised == []
    monkeypatch.setenv("CKPTKIT_HUGE_PAGES", "0")
    host_empty((MIN_ADVISED // 4 + 3,), torch.float32)
    assert advised == []
    monkeypatch.delenv("CKPTKIT_HUGE_PAGES")
    large = host_empty((MIN_ADVISED // 4 + 3,), torch.float32)  # the same spy sees the advice when it is due
    start = -(-large.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    assert advised == [(start, (large.data_ptr() + MIN_ADVISED + 12) // HUGE_PAGE * HUGE_PAGE - start, 14)]
