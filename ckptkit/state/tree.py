"""Nested state dicts as flat name -> leaf maps and back (pure).

A tensor's fqn is its path of dict keys joined by '/', each key escaped as in JSON Pointer
('~' -> '~0', '/' -> '~1'), so any string key round-trips. A dict that holds no tensor is
one JSON leaf.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import LayoutError


def escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")


def join(path: tuple[str, ...]) -> str:
    return "/".join(escape(k) for k in path)


def split(fqn: str) -> tuple[str, ...]:
    return tuple(unescape(p) for p in fqn.split("/"))


def flatten(state: Mapping[str, Any], is_tensor: Callable[[Any], bool]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a nested dict into tensor leaves and JSON leaves, both keyed by fqn.

    Raises:
        LayoutError: a dict key that is not a string on the way to a tensor.
    """
    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    _walk(state, (), is_tensor, tensors, objects)
    return tensors, objects


def _walk(node: Any, path: tuple[str, ...], is_tensor: Callable[[Any], bool], tensors: dict[str, Any], objects: dict[str, Any]) -> None:
    if is_tensor(node):
        tensors[join(path)] = node
        return
    if isinstance(node, Mapping) and (not path or _holds_tensor(node, is_tensor)):
        for key, value in node.items():
            if not isinstance(key, str):
                raise LayoutError(f"key {key!r} under {join(path) or '<root>'!r} is not a string; use string keys")
            _walk(value, (*path, key), is_tensor, tensors, objects)
        return
    if not path:
        raise LayoutError("state must be a dict")
    objects[join(path)] = node


def _holds_tensor(node: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if is_tensor(node):
        return True
    if isinstance(node, Mapping):
        return any(_holds_tensor(v, is_tensor) for v in node.values())
    if isinstance(node, (list, tuple)):
        if any(_holds_tensor(v, is_tensor) for v in node):
            raise LayoutError("tensors inside lists are not supported; put them in a dict keyed by name")
    return False


def unflatten(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild the nested dict from fqn -> leaf."""
    root: dict[str, Any] = {}
    for fqn, value in leaves.items():
        parts = split(fqn)
        node = root
        for key in parts[:-1]:
            node = node.setdefault(key, {})
        node[parts[-1]] = value
    return root


def json_problems(objects: Mapping[str, Any]) -> list[str]:
    """Say which values are not plain JSON (string keys, finite numbers; bytes, which `as_json`
    writes as JSON, count as plain); empty when all are."""
    problems: list[str] = []
    for fqn, value in objects.items():
        _check_json(value, fqn, problems)
    return problems


BYTES = "$bytes"  # a value's bytes as JSON holds them: {"$bytes": "<base64>"}


def as_json(value: Any) -> Any:
    """A value `json_problems` accepts, as JSON holds it: every tuple a list, every mapping a dict
    (a tuple, such as AdamW's ``betas``, comes back from a load as a list), bytes as
    ``{"$bytes": "<base64>"}`` (which `from_json` turns back into bytes)."""
    if isinstance(value, (bytes, bytearray)):
        return {BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


def from_json(value: Any) -> Any:
    """A value as saved, from JSON as `as_json` wrote it: bytes back from ``{"$bytes": ...}``."""
    if isinstance(value, dict):
        if len(value) == 1 and isinstance(value.get(BYTES), str):
            return base64.b64decode(value[BYTES], validate=True)
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def _check_json(value: Any, where: str, problems: list[str]) -> None:
    if value is None or isinstance(value, (bool, int, str, bytes, bytearray)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            problems.append(f"{where}: {value} is not a finite number")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                problems.append(f"{where}: key {k!r} is not a string")
            else:
                _check_json(v, f"{where}/{escape(k)}", problems)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_json(v, f"{where}/{i}", problems)
    else:
        problems.append(f"{where}: a {type(value).__name__} is neither a tensor nor JSON")
