"""Record what produced a checkpoint: the code's git commit and dirty flag, package versions."""

from __future__ import annotations

import os
import subprocess
from importlib import metadata

from ..manifest import CodeVersion

DEFAULT_PACKAGES = ("ckptkit", "torch", "numpy", "safetensors")


def code_version(
    directory: str | os.PathLike[str] = ".", *, packages: tuple[str, ...] = DEFAULT_PACKAGES
) -> CodeVersion:
    """Return the git commit and dirty flag of `directory`'s work tree and installed package versions.

    Outside a git work tree (or without git), the commit and dirty flag are None.
    """
    commit = _git(directory, "rev-parse", "HEAD")
    status = _git(directory, "status", "--porcelain", "--untracked-files=no") if commit else None
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return CodeVersion(git_commit=commit, dirty=None if status is None else bool(status), packages=versions)


def _git(directory: str | os.PathLike[str], *args: str) -> str | None:
    try:
        out = subprocess.run(
            # --no-optional-locks: `status` would otherwise refresh the index under .git/index.lock,
            # which a process killed meanwhile leaves behind, locking the user's repository.
            ["git", "--no-optional-locks", "-C", os.fspath(directory), *args], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
