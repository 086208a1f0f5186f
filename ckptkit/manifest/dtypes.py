"""Tensor element types as the manifest names them, with sizes and safetensors codes (no torch import)."""

from __future__ import annotations

from ..errors import ManifestError

# manifest name -> (bytes per element, safetensors dtype code)
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
    "complex64": (8, "C64"),  # a complex rotary table (torchtitan's freqs_cis); safetensors reads it since 0.6
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint64": (8, "U64"),
    "uint32": (4, "U32"),
    "uint16": (2, "U16"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
}

SAFETENSORS_CODES: dict[str, str] = {code: name for name, (_, code) in DTYPES.items()}


def itemsize(dtype: str) -> int:
    """Return the size in bytes of one element of `dtype`.

    Raises:
        ManifestError: `dtype` is not a dtype ckptkit knows.
    """
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise ManifestError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPES)}") from None


def safetensors_code(dtype: str) -> str:
    """Return the safetensors header code (``F32``, ``BF16``...) for a manifest dtype name."""
    itemsize(dtype)
    return DTYPES[dtype][1]
