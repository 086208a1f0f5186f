"""Unpickle another tool's files without running its code: a restricted unpickler over an
explicit allowlist, in which every allowed class is a stand-in of ours.

A pickle names the callables that rebuild its objects (``module.name``); ``find_class`` returns
only what the caller's allowlist maps that name to, and refuses anything else with an error that
names the class. The allowlists map framework classes to `Record` types (which keep the
arguments and state the pickle gives them and run nothing of the framework) or to small pure
functions, so no code of the tool that wrote the file, nor of torch, runs on its bytes.
Persistent ids are refused unless the caller resolves them.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from ckptkit.errors import ManifestError


class Record:
    """An allowlisted class as a pickle builds it: the arguments it was called with (``args``)
    and the state it was given (``state``); nothing of the real class runs."""

    qualname: ClassVar[str] = "record"
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> Record:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualname}>"


def record_type(qualname: str) -> type[Record]:
    """Return a new `Record` type standing for the class `qualname` (``module.Name``)."""
    return type(qualname.rsplit(".", 1)[-1], (Record,), {"qualname": qualname})


Allowlist = Mapping[tuple[str, str], Any]


def unpickle(
    data: bytes, allowed: Allowlist, *, where: str, persistent: Callable[[Any], Any] | None = None
) -> Any:
    """Unpickle `data`, resolving global names only through `allowed`.

    Raises:
        ManifestError: the pickle names a class that is not allowed (the message names it),
            uses a persistent id `persistent` does not resolve, or is malformed.
    """

    class _Restricted(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return allowed[(module, name)]
            except KeyError:
                raise ManifestError(
                    f"{where}: refused to unpickle {module}.{name}: not a class this format needs (no code from the file is run)"
                ) from None

        def persistent_load(self, pid: Any) -> Any:
            if persistent is None:
                raise ManifestError(f"{where}: refused a persistent id in the pickle (this format has none here)")
            return persistent(pid)

    try:
        return _Restricted(io.BytesIO(data)).load()
    except ManifestError:
        raise
    except Exception as exc:  # any malformed pickle: truncated, bad opcodes, wrong arguments
        raise ManifestError(f"{where}: not a readable pickle ({type(exc).__name__}: {exc})") from None
