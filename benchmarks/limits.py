"""The machine's own limits: a durable write and a cold read of the same bytes, one stream or several."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

BUFFER_BYTES = 16 << 20
LIMIT_FILE = "limit.bin"


def write_limit(directory: str, nbytes: int, threads: int = 1) -> float:
    """Write `nbytes` to a new file from reusable buffers, then fdatasync: with one thread front
    to back with os.write; with more, each thread its own contiguous range with os.pwrite (the
    file sized first), as a parallel writer can.

    Returns:
        The seconds from open to the end of fdatasync.
    """
    buffer = memoryview(os.urandom(min(BUFFER_BYTES, max(nbytes, 1))))
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LIMIT_FILE)
    part = -(-nbytes // threads)
    ranges = [(i * part, min(nbytes, (i + 1) * part)) for i in range(threads)]
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if threads == 1:
            left = nbytes
            while left:
                left -= os.write(fd, buffer[: min(left, len(buffer))])
        else:
            os.ftruncate(fd, nbytes)
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda r: _write_range(fd, buffer, *r), ranges))
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _write_range(fd: int, buffer: memoryview, begin: int, end: int) -> None:
    done = begin
    while done < end:
        done += os.pwrite(fd, buffer[: min(len(buffer), end - done)], done)


def read_limit(directory: str, nbytes: int, threads: int = 1) -> float:
    """Read the file `write_limit` wrote into reusable buffers: sequentially, or in parallel ranges.

    With one thread the file is read front to back with os.readv; with more, each thread
    reads its own contiguous range with os.preadv, as a parallel reader can.

    Returns:
        The seconds from the first open to the last byte read.

    Raises:
        OSError: the file holds fewer than `nbytes` bytes.
    """
    path = os.path.join(directory, LIMIT_FILE)
    if threads > 1:
        if os.path.getsize(path) < nbytes:
            raise OSError(f"{path}: holds {os.path.getsize(path)} bytes, expected {nbytes}")
        return read_files_limit([path], threads)
    start = time.perf_counter()
    _read_sequential(path, nbytes)
    return time.perf_counter() - start


def read_files_limit(paths: list[str], threads: int) -> float:
    """Read the files `paths` (a checkpoint's payload files) as one stream of bytes cut into
    `threads` contiguous ranges, each thread reading its range front to back with os.preadv into
    a reusable buffer: the same bytes a load reads, where the disk has put them.

    Returns:
        The seconds from the first open to the last byte read.
    """
    sizes = [os.path.getsize(p) for p in paths]
    part = -(-sum(sizes) // threads)
    ranges: list[list[tuple[str, int, int]]] = [[] for _ in range(threads)]  # per thread: (file, begin, end)
    base = 0
    for path, size in zip(paths, sizes):
        for i, mine in enumerate(ranges):
            begin, end = max(i * part, base), min((i + 1) * part, base + size)
            if begin < end:
                mine.append((path, begin - base, end - base))
        base += size
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(_read_ranges, ranges))
    return time.perf_counter() - start


def _read_ranges(ranges: list[tuple[str, int, int]]) -> None:
    for path, begin, end in ranges:
        _read_range(path, begin, end)


def _read_sequential(path: str, nbytes: int) -> None:
    view = memoryview(bytearray(BUFFER_BYTES))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < nbytes:
            n = os.readv(fd, [view[: min(len(view), nbytes - done)]])
            if n == 0:
                raise OSError(f"{path}: ends after {done} bytes, expected {nbytes}")
            done += n
    finally:
        os.close(fd)


def _read_range(path: str, begin: int, end: int) -> None:
    view = memoryview(bytearray(BUFFER_BYTES))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = begin
        while done < end:
            n = os.preadv(fd, [view[: min(len(view), end - done)]], done)
            if n == 0:
                raise OSError(f"{path}: ends at {done} bytes, expected {end}")
            done += n
    finally:
        os.close(fd)
