from __future__ import annotations

import subprocess
from pathlib import Path

from ckptkit.ops.provenance import code_version


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_code_version_names_the_commit_and_dirty_flag(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "f.py").write_text("x = 1\n")
    _git(tmp_path, "add", "f.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = code_version(tmp_path)
    assert clean.git_commit == _git(tmp_path, "rev-parse", "HEAD") and clean.dirty is False
    (tmp_path / "f.py").write_text("x = 2\n")
    assert code_version(tmp_path).dirty is True
    assert "ckptkit" in clean.packages


def test_outside_a_work_tree_there_is_no_commit(tmp_path: Path) -> None:
    v = code_version(tmp_path)
    assert v.git_commit is None and v.dirty is None
