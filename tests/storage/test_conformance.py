"""One conformance suite that every storage backend passes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptkit.errors import CheckpointExistsError, StorageError
from ckptkit.storage import LocalStorage, MemoryStorage, Storage


@pytest.fixture(params=["local", "memory", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "s3":
        from ckptkit.storage.s3 import S3Storage

        bucket = request.getfixturevalue("s3_bucket")
        return S3Storage(f"s3://{bucket}/some/prefix", part_size=5 << 20, concurrency=3)
    return LocalStorage(tmp_path / "root") if request.param == "local" else MemoryStorage()


def test_written_bytes_read_back_whole_and_by_range(storage: Storage) -> None:
    assert storage.write("a/b.bin", [b"hello ", memoryview(b"world")]) == 11
    assert storage.read("a/b.bin") == b"hello world"
    assert storage.read("a/b.bin", 6, 5) == b"world"
    assert storage.size("a/b.bin") == 11


def test_readinto_fills_the_buffer_from_an_offset(storage: Storage) -> None:
    storage.write("k", [bytes(range(100))])
    buf = bytearray(10)
    storage.readinto("k", 90, memoryview(buf))
    assert bytes(buf) == bytes(range(90, 100))


def test_readv_fills_buffers_in_order_from_one_offset(storage: Storage) -> None:
    storage.write("k", [bytes(range(256)) * 4])
    bufs = [bytearray(3), bytearray(0), bytearray(300), bytearray(5)]
    storage.readv("k", 250, [memoryview(b) for b in bufs])
    data = bytes(range(256)) * 4
    assert [bytes(b) for b in bufs] == [data[250:253], b"", data[253:553], data[553:558]]
    with pytest.raises(StorageError):
        storage.readv("k", 1020, [memoryview(bytearray(2)), memoryview(bytearray(3))])


def test_reading_past_the_end_is_an_error(storage: Storage) -> None:
    storage.write("k", [b"abc"])
    with pytest.raises(StorageError):
        storage.read("k", 1, 5)
    with pytest.raises(StorageError):
        storage.readinto("k", 2, memoryview(bytearray(4)))


def test_missing_key_is_a_storage_error(storage: Storage) -> None:
    with pytest.raises(StorageError):
        storage.read("nope")
    assert not storage.exists("nope")


def test_failed_write_leaves_nothing_behind(storage: Storage) -> None:
    storage.write("d/keep", [b"x"])

    def chunks() -> Iterator[bytes]:
        yield b"partial"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        storage.write("d/new", chunks())
    assert storage.list("d") == ["d/keep"]


def test_failed_overwrite_keeps_the_old_value(storage: Storage) -> None:
    storage.write("k", [b"old"])

    def chunks() -> Iterator[bytes]:
        yield b"new"
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        storage.write("k", chunks())
    assert storage.read("k") == b"old"


def test_listing_is_sorted_and_can_stop_at_children(storage: Storage) -> None:
    for key in ["x/2", "x/1", "x/sub/3", "y"]:
        storage.write(key, [b"."])
    assert storage.list("x") == ["x/1", "x/2", "x/sub/3"]
    assert storage.list("", recursive=False) == ["x/", "y"]
    assert storage.list("x", recursive=False) == ["x/1", "x/2", "x/sub/"]
    assert storage.list("absent") == []


def test_delete_removes_a_prefix_and_everything_under_it(storage: Storage) -> None:
    storage.write("p/a", [b"1"])
    storage.write("p/q/b", [b"2"])
    storage.write("pp", [b"3"])
    storage.delete("p")
    assert storage.list("") == ["pp"]
    storage.delete("p")  # deleting nothing is fine


def test_rename_moves_a_prefix_and_refuses_to_replace(storage: Storage) -> None:
    if not storage.capabilities.rename:
        with pytest.raises(StorageError, match="cannot rename"):
            storage.rename("a", "b")
        return
    storage.write(".tmp/a", [b"1"])
    storage.write(".tmp/b/c", [b"2"])
    storage.rename(".tmp", "final")
    assert storage.list("final") == ["final/a", "final/b/c"]
    assert not storage.exists(".tmp")
    storage.write("other/x", [b"3"])
    with pytest.raises(StorageError):
        storage.rename("other", "final")
    assert storage.read("final/a") == b"1"


def test_create_refuses_an_existing_key(storage: Storage) -> None:
    storage.create("c/manifest.json", b"first")
    with pytest.raises(CheckpointExistsError):
        storage.create("c/manifest.json", b"second")
    assert storage.read("c/manifest.json") == b"first"


def test_large_writes_in_parts_read_back_exactly(storage: Storage) -> None:
    data = os.urandom(13 << 20)  # several parts on S3 (5 MiB parts here), sent as uneven chunks
    chunks = [memoryview(data)[i : i + 3_000_001] for i in range(0, len(data), 3_000_001)]
    assert storage.write("big/blob", chunks) == len(data)
    assert storage.size("big/blob") == len(data) and storage.read("big/blob") == data
    buf = bytearray(1 << 20)
    storage.readinto("big/blob", 7 << 20, memoryview(buf))
    assert bytes(buf) == data[7 << 20 : 8 << 20]


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../b", "a//b", "a\\b", "./a"])
def test_unsafe_keys_are_refused(storage: Storage, key: str) -> None:
    with pytest.raises(StorageError):
        storage.write(key, [b"x"])


def test_local_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_bytes(b"s3cr3t")
    os.symlink(tmp_path / "secret", root / "link")
    store = LocalStorage(root)
    with pytest.raises(StorageError, match="outside"):
        store.read("link")


def test_local_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    store.write("d/f", [b"x" * 1000])
    assert sorted(os.listdir(tmp_path / "d")) == ["f"]


def test_local_paths_exist_exactly_where_the_capabilities_say(storage: Storage) -> None:
    storage.write("a/b", [b"xyz"])
    if storage.capabilities.local_files:
        with open(storage.local_path("a/b"), "rb") as f:
            assert f.read() == b"xyz"
        assert os.path.isdir(storage.root)
    else:
        with pytest.raises(StorageError):
            storage.local_path("a/b")
    assert isinstance(storage.root, str)


def test_schemes_open_their_backends_and_an_unknown_one_is_refused(tmp_path: Path) -> None:
    from ckptkit.storage import LocalStorage, open_storage, register_scheme, SCHEMES

    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    with pytest.raises(StorageError, match=r"no storage backend for scheme 'gs' \(supported: local paths, file://, s3://\)"):
        open_storage("gs://bucket/x")
    register_scheme("mem-test", lambda url: MemoryStorage())
    try:
        assert isinstance(open_storage("mem-test://anything"), MemoryStorage)
    finally:
        del SCHEMES["mem-test"]
