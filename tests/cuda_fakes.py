"""A fake of the part of torch.cuda that side-stream copies use, recording which device and
stream each copy, wait and event is issued on; it lets the ordering of CUDA copies be tested
without a GPU (the real copies run in tests/gpu)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch


class FakeStream:
    """A stream of the fake: its device, a name (caller or side), and the log its waits go to."""

    def __init__(self, log: list[tuple], device: torch.device, name: str) -> None:
        self.log, self.device, self.name = log, device, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait", self, other))

    def __repr__(self) -> str:
        return f"{self.name}@{self.device}"


class FakeCuda:
    """Enough of torch.cuda to record which device and stream each copy, wait and event is
    issued on (streams are per device, as in CUDA: setting one does not change another device's)."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)
        self.current: dict[torch.device, FakeStream] = {}
        self.log: list[tuple] = []

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        d = device or self.device
        return self.current.setdefault(d, FakeStream(self.log, d, "caller"))

    def Stream(self, device: torch.device) -> FakeStream:  # noqa: N802
        return FakeStream(self.log, device, "side")

    def Event(self) -> Any:  # noqa: N802
        fake = self

        class Event:
            def record(self, stream: FakeStream) -> None:
                self.stream = stream
                fake.log.append(("record", stream))

            def synchronize(self) -> None:
                fake.log.append(("sync", self.stream))

        return Event()

    @contextlib.contextmanager
    def on_device(self, device: torch.device) -> Iterator[None]:
        before, self.device = self.device, device
        try:
            yield
        finally:
            self.device = before

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current[stream.device] = self.current_stream(stream.device), stream
        try:
            with self.on_device(stream.device):
                yield
        finally:
            self.current[stream.device] = before


class FakeTensor:
    """A CUDA-like tensor whose copies record the device and the stream they were issued on."""

    def __init__(self, fake: FakeCuda, name: str, device: torch.device) -> None:
        self.fake, self.name, self.device = fake, name, device

    def detach(self) -> FakeTensor:
        return self

    def copy_(self, src: FakeTensor, non_blocking: bool = False) -> None:
        cuda = src.device if src.device.type == "cuda" else self.device
        self.fake.log.append(("copy", src.name, self.fake.device, self.fake.current_stream(cuda)))

    def record_stream(self, stream: FakeStream) -> None:
        self.fake.log.append(("record_stream", self.name, stream))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("current_stream", "Stream", "Event", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "device", fake.on_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.device.index)
    return fake
