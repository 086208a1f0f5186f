"""Small files of a source checkpoint (metadata, configs, tokenizer files), read whole, within a size limit."""

from __future__ import annotations

import os

from ckptkit.errors import IntegrityError
from ckptkit.storage.local import open_regular

from .torchsave import pread_into


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
