"""The few collectives save needs (gather to rank 0, broadcast, scatter), and sharing outcomes.

Two implementations: one process (no torch.distributed), and a torch.distributed process
group. Objects travel between the job's own ranks in memory; nothing here is ever written
into a checkpoint.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

from .. import errors
from ..errors import CkptkitError


class Collective(Protocol):
    rank: int
    world_size: int

    def gather(self, obj: Any) -> list[Any] | None:
        """Return every rank's `obj` on rank 0 (in rank order), None elsewhere."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Return rank `src`'s `obj` on every rank."""

    def scatter(self, objs: list[Any] | None) -> Any:
        """Return ``objs[rank]`` of rank 0's list on every rank (others pass None)."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Return every rank's `obj` on every rank (in rank order)."""

    def exchange(self, sends: list[tuple[int, Any]], receives: list[tuple[int, Any]]) -> None:
        """Send each (rank, tensor) of `sends` and fill each (rank, tensor) of `receives`, posted in
        the same order on every rank (the n-th message between two ranks matches the n-th)."""


class SingleProcess:
    rank = 0
    world_size = 1

    def gather(self, obj: Any) -> list[Any] | None:
        return [obj]

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def scatter(self, objs: list[Any] | None) -> Any:
        assert objs is not None and len(objs) == 1
        return objs[0]

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def exchange(self, sends: list[tuple[int, Any]], receives: list[tuple[int, Any]]) -> None:
        assert not sends and not receives, "one process has no peer to exchange with"


class TorchDistributed:
    """Collectives over a torch.distributed process group (the default group when None)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=self._global(0), group=self._group)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._global(src), group=self._group)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def exchange(self, sends: list[tuple[int, Any]], receives: list[tuple[int, Any]]) -> None:
        works = [self._dist.isend(t, self._global(r), group=self._group) for r, t in sends]
        works += [self._dist.irecv(t, self._global(r), group=self._group) for r, t in receives]
        for work in works:
            if work is not None:
                work.wait()

    def _global(self, rank: int) -> int:
        return self._dist.get_global_rank(self._group, rank) if self._group is not None else rank

    def scatter(self, objs: list[Any] | None) -> Any:
        out: list[Any] = [None]
        self._dist.scatter_object_list(out, objs if self.rank == 0 else None, src=self._global(0), group=self._group)
        return out[0]


def default_collective(process_group: Any = None) -> Collective:
    """Return collectives over `process_group`, or the default group when torch.distributed is up."""
    if process_group is not None:
        return TorchDistributed(process_group)
    dist = sys.modules.get("torch.distributed")  # not imported: not initialized (and torch stays unloaded)
    if dist is None:
        return SingleProcess()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributed(None)
    return SingleProcess()


def guard(fn: Any) -> tuple[str, Any]:
    """Run `fn`; return ("ok", result) or ("error", (type name, message)) to share with other ranks."""
    try:
        return ("ok", fn())
    except CkptkitError as exc:
        return ("error", (type(exc).__name__, str(exc)))
    except OSError as exc:
        return ("error", ("StorageError", str(exc)))
    except Exception as exc:  # shared with the other ranks so that none of them waits forever
        return ("error", ("CkptkitError", f"{type(exc).__name__}: {exc}"))


def first_error(coll: Collective, outcome: tuple[str, Any]) -> tuple[str, Any]:
    """Every rank's `outcome` of one step (a `guard` outcome): the first error among them, on
    every rank, else ("ok", None)."""
    said = coll.gather(outcome if outcome[0] != "ok" else ("ok", None))
    first: tuple[str, Any] = coll.broadcast(next((o for o in said if o[0] != "ok"), ("ok", None)) if said is not None else None)
    return first


def unwrap(outcome: tuple[str, Any]) -> Any:
    """Return the result of a `guard` outcome, or raise its error as the same ckptkit error class."""
    status, value = outcome
    if status == "ok":
        return value
    name, message = value
    cls = getattr(errors, name, errors.CkptkitError)
    raise cls(message)
