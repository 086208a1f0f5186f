"""Small files of a source checkpoint (metadata, configs, tokenizer files), read whole, within a size limit."""

from __future__ import annotations

import os

from ckptkit.errors import IntegrityError
from ckptkit.io.safetensors import Header, header_length, parse_header
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.torchsave import pread_into


def read_small(path: str, limit: int, what: str) -> bytes:
    """Return the whole content of the regular file `path` (`what` it is, for messages).

    Raises:
        StorageError: the file is missing or not a regular file (a symlink, FIFO, device...).
        IntegrityError: it is over `limit` bytes, or shorter than its size when read.
    """
    fd, size = open_regular(path)
    try:
        if size > limit:
            raise IntegrityError(f"{path}: {size} bytes, over the {limit}-byte limit of {what}")
        data = bytearray(size)
        pread_into(fd, memoryview(data), 0, path)
    finally:
        os.close(fd)
    return bytes(data)


def safetensors_header(path: str) -> Header:
    """The parsed and checked header of the safetensors file `path` (entries at absolute offsets).

    Raises:
        StorageError: the file is missing or not a regular file.
        IntegrityError: a malformed or truncated header, entries past the file's end.
    """
    fd, size = open_regular(path)
    try:
        n = header_length(os.pread(fd, 8, 0), where=path)
        text = os.pread(fd, n, 8)
        if len(text) < n:
            raise IntegrityError(f"{path}: the header is cut short at {8 + len(text)} of {8 + n} bytes (truncated?)")
        return parse_header(text, where=path, file_size=size)
    finally:
        os.close(fd)
