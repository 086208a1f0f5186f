"""How long starting gloo ranks takes: ckptkit's launcher (ranks forked from a forkserver that
imported torch once) against torch.multiprocessing's ``spawn`` (an interpreter and a torch import
per rank), each rank joining the process group and leaving it, nothing else.

Usage: ``python -m benchmarks.launch [--ranks 2,4,8] [--repeats 5]``. Prints, per rank count, the
median seconds of each (after ckptkit's first launch, which starts the server: reported apart) and
their ratio, all from this run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def _idle(rank: int, world: int) -> None:
    """A rank that does nothing (ckptkit's launcher has joined it to the group)."""


def _spawned(rank: int, world: int, port: int) -> None:
    """A spawned rank joining the group and leaving it, as ckptkit's launcher's ranks do."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dist.destroy_process_group()


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8", help="rank counts, comma-separated (default 2,4,8)")
    parser.add_argument("--repeats", type=int, default=5, help="launches per rank count and launcher (default 5)")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    from ckptkit.trainer.launch import free_port, run_ranks

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    counts = [int(n) for n in args.ranks.split(",")]
    first = _timed(lambda: run_ranks(_idle, counts[0]))
    print(f"ckptkit's first launch ({counts[0]} ranks, the forkserver starting): {first:.2f} s")
    print(f"{'ranks':>5} {'ckptkit s':>10} {'spawn s':>10} {'spawn / ckptkit':>16}   (medians of {args.repeats})")
    for n in counts:
        ours = [_timed(lambda: run_ranks(_idle, n)) for _ in range(args.repeats)]
        spawn = [_timed(lambda: mp.start_processes(_spawned, args=(n, free_port()), nprocs=n, start_method="spawn"))
                 for _ in range(args.repeats)]
        a, b = statistics.median(ours), statistics.median(spawn)
        print(f"{n:>5} {a:>10.2f} {b:>10.2f} {b / a:>16.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
