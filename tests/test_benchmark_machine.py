"""The benchmark's description of the machine: whether its host takes back freed memory."""

from __future__ import annotations

from pathlib import Path

from benchmarks.run import free_page_reporting


def _device(root: Path, name: str, device: str, features: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "device").write_text(device + "\n")
    (root / name / "features").write_text(features + "\n")


def test_a_balloon_with_the_reporting_feature_is_found(tmp_path: Path) -> None:
    _device(tmp_path, "virtio0", "0x0002", "1" * 64)  # a block device: its bit 5 means something else
    assert not free_page_reporting(str(tmp_path))
    _device(tmp_path, "virtio1", "0x0005", "0110000100" + "0" * 54)  # a balloon without it (bit 5 clear)
    assert not free_page_reporting(str(tmp_path))
    _device(tmp_path, "virtio2", "0x0005", "0110010100" + "0" * 54)  # as on the benchmark machine: bit 5 set
    assert free_page_reporting(str(tmp_path))


def test_no_virtio_bus_or_unreadable_entries_mean_no(tmp_path: Path) -> None:
    assert not free_page_reporting(str(tmp_path / "absent"))
    (tmp_path / "virtio0").mkdir()  # no device or features file
    _device(tmp_path, "virtio1", "not-hex", "1" * 64)
    assert not free_page_reporting(str(tmp_path))
