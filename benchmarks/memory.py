"""Peak resident memory of this process over one operation.

Linux lets a process reset its own high-water mark (``VmHWM``) by writing 5 to
``/proc/self/clear_refs``; the peak read after the operation then covers that operation
alone, however short its spikes. Where that is refused, a thread polls RSS instead
(psutil, every millisecond), which can miss very short spikes.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

import psutil

_POLL_S = 0.001


def rss_bytes() -> int:
    """Return the current resident set size of this process."""
    return int(psutil.Process().memory_info().rss)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Measure the peak RSS inside a ``with`` block: ``before`` and ``peak`` in bytes."""

    def __init__(self) -> None:
        self.before = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRss:
        self.before = rss_bytes()
        if _reset_high_water_mark():
            self.method = "VmHWM"
        else:
            self.method = "polling"
            self.peak = self.before
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.peak = _status_kib("VmHWM") * 1024

    def _poll(self) -> None:
        process = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, int(process.memory_info().rss))
            time.sleep(_POLL_S)
