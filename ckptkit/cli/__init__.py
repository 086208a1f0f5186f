"""The ``ckptkit`` command: a thin click layer over the library.

Exit codes, the same for the same mistake in every command:

- 0: success (verify: sound; diff: equal).
- 1: a ckptkit error (a damaged or refused checkpoint, an existing destination, an impossible
  layout, a run that cannot start as asked); verify: problems found; diff: the checkpoints differ.
- 2: bad usage (an unknown option, a missing argument, a value out of range, options that do
  not go together), or no checkpoint (or root) at a path the command was given.
- 3: an internal error (a bug: please report it; CKPTKIT_DEBUG=1 shows the traceback).
- 130: interrupted.

Every error is one line on stderr; with ``--json`` a failed command also prints an error object
(``schemas/cli/error.v1.schema.json``) on stdout.
"""

from __future__ import annotations

from . import checkpoints, roots, training, writing  # noqa: F401  (each registers its commands)
from .base import cli, main, parse_size

__all__ = ["cli", "main", "parse_size"]
