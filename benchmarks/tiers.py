"""The memory tier: restart to a restored state from this node's memory, from a peer and from
storage, against each one's floor; the training stall of a memory snapshot against a memcpy.

Two gloo ranks, each a simulated node of its own (a folder under /dev/shm), each holding
`size_mib` of fp32 state (its rows of four global tensors). One save job writes two memory
snapshots (replicated: each node holds both ranks' files) and a storage checkpoint, timing each
snapshot's stall against a copy of the rank's state into reused buffers. Then, per repeat and
per source, two fresh interpreters restart and restore:

- ``memory``: both nodes' folders intact; each rank reads its own node's copy;
- ``peer``: node 1's folder lost; rank 1's file comes from rank 0 over the process group;
- ``storage``: both folders lost; each rank reads storage, its page cache dropped first.

"Restart" is from the launcher starting the interpreters to the state restored in the rank's
tensors (imports, the process group, the manager, the restore, every byte checked). The floor of
a rank is the job's imports (the slower rank's, measured in each: no rank can restore before
every rank has started) plus the bytes it reads at the speed of the medium: a memcpy (measured
in it), gloo's loopback send (measured between the ranks) or a cold single-stream read of the
disk (`limits.read_limit`). The ratio is the median of each run's restart / its floor.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

TENSORS = 4
SNAPSHOTS = 5  # memory snapshots timed per save job (the first one, which allocates the buffers, is left out)
SOURCES = ("memory", "peer", "storage")


def _rank_state(torch: Any, rank: int, world: int, size_mib: int) -> dict[str, Any]:
    """The rank's state: random values in `_target`'s boxes."""
    g = torch.Generator().manual_seed(rank)
    state = _target(torch, rank, world, size_mib)
    for t in state["model"].values():
        t.local.normal_(generator=g)
    return {**state, "step": 0}


def _target(torch: Any, rank: int, world: int, size_mib: int) -> dict[str, Any]:
    """Empty tensors of the rank's boxes (a restarted trainer's, before the restore fills them)."""
    from ckptkit import ShardedTensor

    rows = max(world, (size_mib << 20) // (4 * TENSORS * 1024) * world)
    n = rows // world
    return {"model": {f"w{i}": ShardedTensor(torch.empty(n, 1024), (rows, 1024), (rank * n, 0)) for i in range(TENSORS)}}


def rank_main(args: list[str]) -> None:
    """One rank: ``save`` (snapshots and a storage save, timed) or ``restore`` (timed from spawn)."""
    spawned = float(os.environ["CKPTKIT_BENCH_SPAWNED"])
    mode, base, rank_s, world_s, port, size_s, out = args
    rank, world, size_mib = int(rank_s), int(world_s), int(size_s)
    import torch
    import torch.distributed as dist

    import ckptkit
    from ckptkit import CheckpointManager, MemoryTier

    imported = time.time()
    torch.set_num_threads(1)
    # The launcher hosts the store, as torchrun's agent does: no rank waits on another's start to connect.
    store = dist.TCPStore("127.0.0.1", int(port), world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    joined = time.time()
    tier = MemoryTier(os.path.join(base, "shm"), node=f"node{rank}")
    result: dict[str, Any] = {"rank": rank, "imports_s": imported - spawned}
    if mode == "save":
        state = _rank_state(torch, rank, world, size_mib)
        copies = {k: torch.empty_like(v.local) for k, v in state["model"].items()}
        stalls, memcpys = [], []
        with CheckpointManager(os.path.join(base, "store"), memory=tier) as manager:
            for step in range(1, SNAPSHOTS + 1):
                state["step"] = step
                started = time.perf_counter()
                for k, v in state["model"].items():
                    copies[k].copy_(v.local)
                memcpys.append(time.perf_counter() - started)
                stalls.append(manager.save(step, state, tier="memory").stall_s)
                manager.wait()
            manager.save(SNAPSHOTS, state).committed.result()
        result.update(stall_s=statistics.median(stalls[1:]), memcpy_s=statistics.median(memcpys[1:]))
    else:
        with CheckpointManager(os.path.join(base, "store"), memory=tier) as manager:
            made = time.time()
            target = _target(torch, rank, world, size_mib)
            allocated = time.time()
            _, report = manager.restore(target)
            restored = time.time()
        nbytes = sum(t.local.numel() * 4 for t in target["model"].values())
        copy = torch.empty(nbytes, dtype=torch.uint8)
        source = torch.cat([t.local.reshape(-1).view(torch.uint8) for t in target["model"].values()])
        memcpy = []
        for _ in range(3):
            started = time.perf_counter()
            copy.copy_(source)
            memcpy.append(time.perf_counter() - started)
        loopback = []
        for _ in range(3):
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                dist.send(source, 1)
            elif rank == 1:
                dist.recv(copy, 0)
            loopback.append(time.perf_counter() - started)
        result.update(restart_s=restored - spawned, group_s=joined - imported, manager_s=made - joined, target_s=allocated - made,
                      restore_s=restored - allocated, bytes=nbytes, step=report.step, tiers=report.tiers(),
                      memcpy_s=statistics.median(memcpy), loopback_s=statistics.median(loopback[1:]))
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


def _ranks(mode: str, base: str, size_mib: int, world: int = 2) -> list[dict[str, Any]]:
    """Start `world` fresh interpreters for `mode`; return their results (raises on failure)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    outs = [os.path.join(base, f"{mode}-rank{r}.json") for r in range(world)]
    env = {**os.environ, "CKPTKIT_BENCH_SPAWNED": repr(time.time())}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.tiers", mode, base, str(r), str(world), str(port), str(size_mib), outs[r]],
                              env=env, stderr=subprocess.PIPE) for r in range(world)]
    errors = [p.stderr.read().decode()[-2000:] if p.wait(timeout=600) and p.stderr else "" for p in procs]
    if any(errors):
        raise RuntimeError("; ".join(e for e in errors if e))
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    return results


def run(settings: Any, size_mib: int) -> dict[str, Any]:
    """The tier phase: the save job once, then each source's restart --repeats times."""
    from .cache import drop_caches, rewarm_libraries
    from .limits import read_limit, write_limit

    base = os.path.join("/dev/shm", f"ckptkit-bench-{os.getpid()}")
    disk = os.path.join(settings.work, "tier")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(disk, exist_ok=True)
    os.makedirs(base)
    os.symlink(disk, os.path.join(base, "store"))  # storage on the disk, the nodes' folders in memory
    try:
        saved = _ranks("save", base, size_mib)
        stall = statistics.median(r["stall_s"] for r in saved)
        memcpy = statistics.median(r["memcpy_s"] for r in saved)
        settings.say(f"[tier] memory snapshot stall {stall * 1e3:.1f} ms vs memcpy {memcpy * 1e3:.1f} ms: x{stall / memcpy:.2f}")
        pristine = os.path.join(base, "pristine")
        shutil.copytree(os.path.join(base, "shm"), pristine)
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SOURCES}
        for repeat in range(settings.repeats):
            for source in SOURCES:
                shutil.rmtree(os.path.join(base, "shm"), ignore_errors=True)
                shutil.copytree(pristine, os.path.join(base, "shm"))
                if source in ("peer", "storage"):
                    shutil.rmtree(os.path.join(base, "shm", "node1"))
                if source == "storage":
                    shutil.rmtree(os.path.join(base, "shm", "node0"))
                    dropped = drop_caches()
                    rewarm_libraries()
                else:
                    dropped = None
                ranks = _ranks("restore", base, size_mib)
                rank = ranks[1]  # the one that reads from a peer in "peer"
                # No rank can restore before every rank of the job has started: the floor's imports are the slowest's.
                runs[source].append({**rank, "job_imports_s": max(r["imports_s"] for r in ranks), "dropped": dropped})
                settings.say(f"[tier {source} {repeat + 1}/{settings.repeats}] restart {rank['restart_s']:.2f} s: imports "
                             f"{rank['imports_s']:.2f} s, process group {rank['group_s']:.2f} s, manager {rank['manager_s']:.2f} s, "
                             f"target {rank['target_s']:.2f} s, restore {rank['restore_s']:.2f} s; tiers {rank['tiers']}")
        nbytes = runs["memory"][0]["bytes"]
        write_limit(disk, nbytes)
        drop_caches()
        disk_s = read_limit(disk, nbytes)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    block: dict[str, Any] = {"size_mib_per_rank": size_mib, "stall_s": stall, "memcpy_s": memcpy, "stall_vs_memcpy": stall / memcpy,
                             "disk_read_s": disk_s, "sources": {}}
    medium = {"memory": "memcpy_s", "peer": "loopback_s"}
    for source, rs in runs.items():
        restart = statistics.median(r["restart_s"] for r in rs)
        imports = statistics.median(r["job_imports_s"] for r in rs)
        move = statistics.median(r[medium[source]] for r in rs) if source in medium else disk_s
        floor = imports + move
        paired = statistics.median(r["restart_s"] / (r["job_imports_s"] + (r[medium[source]] if source in medium else disk_s)) for r in rs)
        block["sources"][source] = {"restart_s": restart, "imports_s": imports, "bytes_s": move, "floor_s": floor,
                                    "vs_floor": paired, "tiers": rs[-1]["tiers"], "all_restart_s": [r["restart_s"] for r in rs],
                                    "cache_dropped": rs[-1]["dropped"]}
    return block


def render(block: dict[str, Any]) -> list[str]:
    lines = [f"MEMORY TIER: 2 ranks as 2 nodes, {block['size_mib_per_rank']} MiB of state per rank (restart: interpreter start "
             "to state restored, rank 1)",
             f"  {'source':<10}{'restart s':>10}{'imports s':>10}{'bytes s':>9}{'floor s':>9}{'x floor':>9}  rank 1 read from"]
    for name, s in block["sources"].items():
        lines.append(f"  {name:<10}{s['restart_s']:>10.3f}{s['imports_s']:>10.3f}{s['bytes_s']:>9.3f}{s['floor_s']:>9.3f}"
                     f"{s['vs_floor']:>9.2f}  {', '.join(f'{k} {v}' for k, v in sorted(s['tiers'].items()))}")
    lines.append(f"  memory snapshot stall {block['stall_s'] * 1e3:.1f} ms, memcpy of the rank's state {block['memcpy_s'] * 1e3:.1f} ms: "
                 f"x{block['stall_vs_memcpy']:.2f}")
    return lines


if __name__ == "__main__":
    rank_main(sys.argv[1:])
