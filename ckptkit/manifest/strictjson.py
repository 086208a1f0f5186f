"""JSON as checkpoint files hold it, parsed with limits (pure).

Manifests and safetensors headers come from disk and may be damaged or hostile. `loads` refuses
what no writer produces: duplicate keys in an object (the last would silently win), NaN and
infinities (also numbers too large for a float, which JSON parsers turn into infinity),
integers with more than `MAX_DIGITS` digits, and nesting deeper than the interpreter's recursion
limit allows (the documents are size-capped before they are parsed, so this bounds the
memory too). Each refusal is
a `StrictJsonError` (a ValueError) whose message says what, so callers turn it into their own
one-line error.

`canonical` is the one serialization of a parsed document that checksums cover: sorted keys,
no spaces, UTF-8, so the same content always gives the same bytes.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DIGITS = 40  # a 128-bit integer has 39 digits; nothing a checkpoint stores is larger


class StrictJsonError(ValueError):
    """A JSON document that is malformed, or well formed but outside the limits above."""


def loads(data: bytes | str) -> Any:
    """Parse `data` as JSON within the limits of this module.

    Raises:
        StrictJsonError: not JSON, a duplicate key, a non-finite or oversized number, or too
            deep a nesting.
    """
    try:
        return json.loads(data, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite, parse_int=_bounded_int)
    except StrictJsonError:
        raise
    except RecursionError:
        raise StrictJsonError("nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise StrictJsonError(f"not valid JSON ({exc})") from None


def canonical(doc: Any) -> bytes:
    """The canonical bytes of a parsed document: sorted keys, compact, UTF-8, no NaN."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise StrictJsonError(f"key {key[:80]!r} appears twice in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise StrictJsonError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise StrictJsonError(f"number {text[:40]} is too large for a float")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise StrictJsonError(f"integer of {len(text)} digits is too large")
    return int(text)
