"""Local file-system storage: temp name, fsync, atomic rename, directory fsync."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections.abc import Iterable, Sequence

from ..errors import CheckpointExistsError, StorageError
from .base import Buffer, Capabilities, byte_view, check_key

# A long write starts the write-back of every WRITEBACK_BYTES it has written (see _start_writeback).
WRITEBACK_BYTES = 64 << 20
IOV_MAX = 1024  # buffers per preadv call (the Linux limit)


class LocalStorage:
    """Storage in a directory of a local or shared POSIX file system.

    Keys are paths under the root; no key may resolve outside it, symlinks included.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self._real_root = os.path.realpath(self.root)  # resolved once: a root moved later fails the checks below

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(rename=True, local_files=True)

    def local_path(self, key: str) -> str:
        return self.path(key)

    def path(self, key: str) -> str:
        """Return the file-system path of `key`.

        A key may not resolve (symlinks followed) outside the root, nor outside its own
        top-level directory: a file of one checkpoint never points into another.

        Raises:
            StorageError: the key is unsafe or escapes.
        """
        check_key(key)
        parts = key.split("/")
        path = os.path.join(self.root, *parts)
        real = os.path.realpath(path)
        if not _within(real, self._real_root):
            raise StorageError(f"{key}: resolves outside the storage root {self.root} (symlink?)")
        if len(parts) > 1:
            top = os.path.realpath(os.path.join(self.root, parts[0]))
            if not _within(real, top):
                raise StorageError(f"{key}: resolves outside {parts[0]}/ (symlink?)")
        return path

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self.path(key)
        fd, size = open_regular(path)
        try:
            want = max(0, size - offset) if length is None else length
            parts = []
            done = 0
            while done < want:
                part = os.pread(fd, want - done, offset + done)
                if not part:
                    break
                parts.append(part)
                done += len(part)
        except OSError as exc:
            raise StorageError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        finally:
            os.close(fd)
        if done != want:
            raise StorageError(f"{path}: short read, wanted {want} bytes at {offset}, got {done}")
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, key: str, offset: int, buffer: memoryview) -> None:
        self.readv(key, offset, [buffer])

    def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        path = self.path(key)
        fd, _ = open_regular(path)
        try:
            _preadv_full(fd, [byte_view(b) for b in buffers], offset, path)
        finally:
            os.close(fd)

    def write(self, key: str, chunks: Iterable[Buffer]) -> int:
        path = self.path(key)
        parent = os.path.dirname(path)
        tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            _makedirs(parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                size = flushed = 0
                for chunk in chunks:
                    size += _write_full(fd, memoryview(chunk).cast("B"))
                    if size - flushed >= WRITEBACK_BYTES:
                        _start_writeback(fd, flushed, size - flushed)
                        flushed = size
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(parent)
        except OSError as exc:
            _remove_quietly(tmp)
            raise StorageError(f"{path}: cannot write ({exc.strerror or exc})") from exc
        except BaseException:
            _remove_quietly(tmp)
            raise
        return size

    def create(self, key: str, data: bytes) -> None:
        """Write a temporary file, then hard-link it to `key`: the link fails if `key` exists."""
        path = self.path(key)
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.new-{uuid.uuid4().hex[:8]}")
        try:
            _makedirs(os.path.dirname(path))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_full(fd, memoryview(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.link(tmp, path)
            _fsync_dir(os.path.dirname(path))
        except FileExistsError:
            raise CheckpointExistsError(f"{path}: already exists (another writer got there first)") from None
        except OSError as exc:
            raise StorageError(f"{path}: cannot write ({exc.strerror or exc})") from exc
        finally:
            _remove_quietly(tmp)

    def size(self, key: str) -> int:
        path = self.path(key)
        try:
            info = os.lstat(path)
        except OSError as exc:
            raise StorageError(f"{path}: cannot stat ({exc.strerror or exc})") from exc
        if not stat.S_ISREG(info.st_mode):
            raise StorageError(f"{path}: {_kind(info.st_mode)}, not a regular file")
        return info.st_size

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def is_prefix(self, key: str) -> bool:
        """Return True when `key` names a directory (a prefix holding keys)."""
        return os.path.isdir(self.path(key))

    def list(self, prefix: str = "", *, recursive: bool = True) -> list[str]:
        base = self.path(prefix) if prefix else self.root
        if not os.path.isdir(base):
            return []
        head = f"{prefix}/" if prefix else ""
        if not recursive:
            return sorted(head + e.name + ("/" if e.is_dir() else "") for e in os.scandir(base))
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, base)
            sub = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            keys += [head + sub + name for name in files]
        return sorted(keys)

    def delete(self, prefix: str) -> None:
        path = self.path(prefix)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"{path}: cannot delete ({exc.strerror or exc})") from exc
        _fsync_dir(os.path.dirname(path))

    def rename(self, src: str, dst: str) -> None:
        src_path, dst_path = self.path(src), self.path(dst)
        if os.path.lexists(dst_path):
            raise StorageError(f"{dst_path}: already exists, refusing to replace it")
        try:
            _makedirs(os.path.dirname(dst_path))
            os.rename(src_path, dst_path)
        except OSError as exc:
            raise StorageError(f"cannot rename {src_path} to {dst_path} ({exc.strerror or exc})") from exc
        _fsync_dir(os.path.dirname(dst_path))


def open_regular(path: str) -> tuple[int, int]:
    """Open `path` for reading only if it is a regular file; return the descriptor and its size.

    The open neither follows a symlink nor blocks (a FIFO would wait for a writer forever),
    and the type is checked on the open descriptor: a symlink, FIFO, device, socket or
    directory is refused before a byte is read from it.

    Raises:
        StorageError: the file is missing, unreadable or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StorageError(f"{path}: a symlink, not a regular file") from None
        raise StorageError(f"{path}: cannot open ({exc.strerror or exc})") from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise StorageError(f"{path}: {_kind(info.st_mode)}, not a regular file")
    return fd, info.st_size


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "a special file"


def _within(path: str, directory: str) -> bool:
    return os.path.commonpath([path, directory]) == directory


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing a range of dirty pages back to disk without waiting (Linux starts writeback
    on POSIX_FADV_DONTNEED), so that the final fsync finds little left to write."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:  # only a hint
            pass


def _write_full(fd: int, view: memoryview) -> int:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


def _preadv_full(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill `views` in order from `offset`, however many calls the kernel needs."""
    want = sum(len(v) for v in views)
    done = 0
    views = [v for v in views if len(v)]
    while views:
        try:
            n = os.preadv(fd, views[:IOV_MAX], offset + done)
        except OSError as exc:
            raise StorageError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        if n == 0:
            raise StorageError(f"{path}: short read, wanted {want} bytes at {offset}, got {done}")
        done += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _makedirs(path: str) -> None:
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        _fsync_dir(os.path.dirname(d))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
