"""Benchmarks of ckptkit against its peers and the machine's own I/O limits.

Run ``python -m benchmarks.run --help``. Tests never time anything; timing lives here.
"""

from __future__ import annotations
