"""Checkpoints that refer to earlier ones (incremental saves, schema 1.4): the checks of their
bases, and what each checkpoint of a root depends on (no torch).

A checkpoint of an incremental save lists, besides its own files, files of earlier committed
checkpoints of the same root (``FileEntry.base``), each with the size and checksums its owner
recorded, and reads them as its own. The list is flat: a file is always named with the
checkpoint that holds it, never through a chain of references, so a read of one checkpoint
opens no other manifest. Before anything of it is read, each base is checked to be committed,
earlier, and to hold each file as its own with the same size and checksum
(`base_problems`); a checkpoint whose bases do not pass is refused whole. Retention keeps every
base of a kept checkpoint (`dependencies`).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import IntegrityError
from ..manifest import Manifest
from ..storage import Storage, plain_name
from .catalog import Location, sealed_manifest


def base_problems(loc: Location, manifest: Manifest) -> list[tuple[str, str]]:
    """What is wrong with the bases of the checkpoint at `loc`: (where, message) for each base
    that is not a plain name of another checkpoint, is not committed, is not earlier, or does not
    hold a file this one names in it as its own, of the same size and checksum."""
    problems: list[tuple[str, str]] = []
    for base in manifest.bases():
        where = f"../{base}"
        if not plain_name(base) or base == loc.name:
            problems.append((where, "not an earlier checkpoint of the same root"))
            continue
        raw, why = sealed_manifest(loc.storage, base)
        if raw is None:
            problems.append((where, f"a base this checkpoint reads files of is not committed ({why})"))
            continue
        step = raw.get("step")
        if type(step) is not int or step >= manifest.step:
            problems.append((where, f"a base must be an earlier step, it is step {step} (this checkpoint is step {manifest.step})"))
            continue
        owned = {}
        files = raw.get("files")
        for f in files if isinstance(files, list) else ():
            if isinstance(f, dict) and f.get("base") is None and isinstance(f.get("path"), str):
                owned[f["path"]] = (f.get("size"), f.get("checksum"))
        for entry in manifest.files:
            if entry.base == base and owned.get(entry.path) != (entry.size, entry.checksum):
                problems.append((entry.where(), "its base's manifest does not list it as its own file of this size and checksum"))
    return problems


def check_bases(loc: Location, manifest: Manifest) -> None:
    """Refuse a checkpoint whose bases do not pass `base_problems`, in one line.

    Raises:
        IntegrityError: naming the first problem and how many there are.
    """
    problems = base_problems(loc, manifest)
    if problems:
        where, message = problems[0]
        more = f" (and {len(problems) - 1} more problem(s) with its bases)" if len(problems) > 1 else ""
        raise IntegrityError(f"{loc}: refers to {where}: {message}{more}; nothing of it can be read")


def dependencies(storage: Storage, names: Iterable[str]) -> dict[str, set[str]]:
    """The bases of each checkpoint of `names` under the root `storage`, from its sealed manifest
    (a checkpoint whose manifest cannot be read depends on nothing it can show)."""
    out: dict[str, set[str]] = {}
    for name in names:
        raw, _ = sealed_manifest(storage, name)
        files = raw.get("files") if raw is not None else None
        out[name] = {f["base"] for f in files if isinstance(f, dict) and isinstance(f.get("base"), str)} if isinstance(files, list) else set()
    return out


def needed(depends: dict[str, set[str]], kept: Iterable[str]) -> set[str]:
    """Every checkpoint that the checkpoints `kept` need to be read: themselves and, transitively,
    their bases (pure)."""
    out: set[str] = set()
    todo = list(kept)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo += depends.get(name, ())
    return out


__all__ = ["base_problems", "check_bases", "dependencies", "needed"]
