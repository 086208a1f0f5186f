"""The safetensors file format, read and written without torch (pure header logic).

Layout: 8-byte little-endian header length N, N bytes of JSON header (padded with spaces to a
multiple of 8), then the raw little-endian tensor bytes. The header maps each key to its dtype,
shape and [begin, end) offsets relative to the end of the header.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..manifest.dtypes import DTYPES, SAFETENSORS_CODES
from ..manifest import strictjson
from ..errors import IntegrityError

# The safetensors reference implementation refuses headers above 100 MB; so do we.
HEADER_LIMIT = 100_000_000


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    """One tensor of a safetensors file: dtype (manifest name), shape, absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed safetensors header; entry offsets are absolute positions in the file."""

    data_start: int
    entries: dict[str, HeaderEntry]
    metadata: dict[str, str]


def build_header(
    items: Sequence[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, HeaderEntry]]:
    """Return the file prefix (length + padded JSON) for tensors written in `items` order.

    Args:
        items: (key, manifest dtype, shape) in the order their bytes will follow the header.
        metadata: string pairs for the ``__metadata__`` entry.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offset = 0
    spans = []
    for key, dtype, shape in items:
        size, code = DTYPES[dtype]
        nbytes = math.prod(shape) * size
        doc[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        spans.append((key, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    text = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    start = len(prefix)
    entries = {k: HeaderEntry(d, s, start + b, start + e) for k, d, s, b, e in spans}
    return prefix, entries


def header_length(first8: bytes, *, where: str) -> int:
    """Return the header length from a file's first 8 bytes, refusing absurd values."""
    if len(first8) < 8:
        raise IntegrityError(f"{where}: too short for a safetensors file ({len(first8)} bytes)")
    (n,) = struct.unpack("<Q", first8)
    if n > HEADER_LIMIT:
        raise IntegrityError(f"{where}: safetensors header of {n} bytes exceeds the {HEADER_LIMIT}-byte limit")
    return int(n)


def parse_header(header_json: bytes, *, where: str, file_size: int | None = None) -> Header:
    """Parse and check a safetensors JSON header (the bytes after the 8-byte length).

    Raises:
        IntegrityError: malformed JSON, an unknown dtype, a byte range that does not match
            its shape, overlaps or holes between tensors, or data past the end of the file.
    """
    start = 8 + len(header_json)
    try:
        doc = strictjson.loads(header_json)
    except strictjson.StrictJsonError as exc:
        raise IntegrityError(f"{where}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{where}: safetensors header is not a JSON object")
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise IntegrityError(f"{where}: safetensors __metadata__ is not an object of strings")
    entries: dict[str, HeaderEntry] = {}
    problems: list[str] = []
    for key, spec in doc.items():
        fields = _entry_fields(spec)
        if fields is None:
            problems.append(f"tensor {key[:200]!r} has a malformed or unknown-dtype entry {str(spec)[:200]}")
            continue
        dtype, shape, begin, end = fields
        if end - begin != math.prod(shape) * DTYPES[dtype][0]:
            problems.append(f"tensor {key[:200]!r}: byte range [{begin}, {end}) does not fit shape {list(shape)} {dtype}")
        entries[key] = HeaderEntry(dtype, shape, start + begin, start + end)
    ordered = sorted(entries.values(), key=lambda e: (e.begin, e.end))
    position = start
    for e in ordered:
        if e.begin != position:
            problems.append(f"tensor bytes are not contiguous at offset {e.begin - start} (expected {position - start})")
            break
        position = e.end
    if file_size is not None and position != file_size:
        problems.append(f"tensor data ends at byte {position} but the file has {file_size} bytes")
    if problems:
        raise IntegrityError(f"{where}: " + "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else ""))
    return Header(start, entries, dict(metadata))


def _entry_fields(spec: Any) -> tuple[str, tuple[int, ...], int, int] | None:
    """(dtype, shape, begin, end) of a header entry, or None when it is malformed: an unknown
    dtype, or anything but non-negative integers for the shape and the offsets."""
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        return None
    dtype = SAFETENSORS_CODES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
    shape, offsets = spec["shape"], spec["data_offsets"]
    if dtype is None or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if not all(type(x) is int and x >= 0 for x in (*shape, *offsets)):
        return None
    return dtype, tuple(shape), offsets[0], offsets[1]
