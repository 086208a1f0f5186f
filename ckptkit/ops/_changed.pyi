from typing import Any

# Any object with the buffer protocol (numpy arrays, memoryview, bytes); numpy's stubs do not say so
# before Python 3.12.
_Bytes = Any

def positions(before: _Bytes, after: _Bytes, out: _Bytes, limit: int, /) -> int:
    """Write the positions of the 16-bit elements that differ between two byte buffers of equal
    length into `out` (4 or 8 bytes an item, room for limit + 8), rising; return their count, or -1
    when there are more than `limit`."""
