"""Evict files from the page cache so that the next read comes from the disk."""

from __future__ import annotations

import os

DROP_CACHES = "/proc/sys/vm/drop_caches"


def files_under(path: str) -> list[str]:
    """Return every regular file at or below `path`."""
    if os.path.isfile(path):
        return [path]
    found = []
    for directory, _, names in os.walk(path):
        found += [os.path.join(directory, n) for n in names]
    return sorted(found)


def evict_files(path: str) -> None:
    """Drop the cached pages of every file under `path`: fsync (dirty pages stay), then fadvise."""
    for name in files_under(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    os.sync()


def warm_files(path: str) -> int:
    """Read every file under `path` once, front to back, so that the next read finds it in the
    page cache; return the bytes read."""
    view = memoryview(bytearray(16 << 20))
    total = 0
    for name in files_under(path):
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


def drop_caches() -> bool:
    """Drop every clean page of the machine's page cache; return False, quietly, when refused.

    It needs root (``/proc/sys/vm/drop_caches``). It also evicts the pages of the tools'
    libraries that no process maps at the moment; `rewarm_libraries` reads them back.
    """
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("1")
        return True
    except OSError:
        return False



def rewarm_libraries() -> int:
    """Read every file mapped into this process (its shared libraries) back into the page cache.

    After `drop_caches`, code that a tool runs for the first time would fault its pages in
    from the disk inside the measurement (a tenth of a second and more per operation here,
    whatever the checkpoint's size); a cold-cache benchmark means cold checkpoint files.

    Returns:
        The bytes read.
    """
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                paths.add(parts[5].strip())
    buffer = memoryview(bytearray(16 << 20))
    total = 0
    for path in sorted(p for p in paths if os.path.isfile(p)):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total
