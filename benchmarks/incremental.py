"""Incremental saves against full ones, on three kinds of training: bytes written and save time
per save, the restore of a chain's newest step, the speed of finding changed elements, and
whether a lossless codec would pay on this machine.

Each scenario saves the same `saves` successive states twice, as full saves and as incremental
ones, the two interleaved step by step (the order alternating), durable (ckptkit's saves fsync):

- ``frozen``: a fine-tune of the top tenth of an fp32 model (the rest frozen), with AdamW moments
  of the trained part;
- ``rl-bf16``: bf16 weights of fp32 masters moved at an RL-like rate (about 1 % of the bf16
  elements change per step, the PULSE measure), the weights alone (what RL stacks sync);
- ``rl-compact``: rl-bf16's states, the incremental saves through a ``CheckpointManager`` that
  compacts a save once a box lies under `COMPACT_AFTER` patches (its save time includes such a
  compaction; the bytes compactions write are counted apart, ``compacted``);
- ``dense``: an fp32 model and both AdamW moments, every element changing every step.

"Changed bytes" are the bytes of the elements that differ from the previous step (value bytes:
4 per fp32 element, 2 per bf16 one); an incremental save may add 4 bytes of index per patched
element, a safetensors header per file and the manifest.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import zlib
from typing import Any

import numpy as np
import torch

from ckptkit.state.tree import flatten, unflatten

from .cache import evict_files

SCENARIOS = ("frozen", "rl-bf16", "rl-compact", "dense")
SAVES = 20
# ``rl-compact``: rl-bf16's states, the incremental side through ``CheckpointManager(compact_after=...)``,
# which rewrites a save whole in the background once a box lies under this many patches.
COMPACT_AFTER = 4


def _states(scenario: str, nbytes: int, saves: int) -> list[dict[str, Any]]:
    """The successive states of a scenario, of about `nbytes` each (built before any timing)."""
    g = torch.Generator().manual_seed(0)
    rows = 1024
    if scenario == "frozen":
        layers = 10
        cols = max(1, nbytes // (4 * rows * (layers + 2)))  # 9 frozen layers, 1 trained with 2 moments
        frozen = {f"layers/{i}/w": torch.randn(rows, cols, generator=g) for i in range(layers - 1)}
        out = []
        for _ in range(saves):
            top = torch.randn(rows, cols, generator=g)
            out.append({"model": {**frozen, "layers/9/w": top}, "optim": {"layers/9/w/exp_avg": top * 0.1,
                                                                             "layers/9/w/exp_avg_sq": top * top}})
        return [_nested(s) for s in out]
    if scenario in ("rl-bf16", "rl-compact"):
        tensors = 8
        cols = max(1, nbytes // (2 * rows * tensors))
        masters = [torch.randn(rows, cols, generator=g) for _ in range(tensors)]
        out = []
        for _ in range(saves):
            masters = [m + torch.randn(m.shape, generator=g) * 1.5e-5 for m in masters]
            out.append({"model": {f"w{i}": m.to(torch.bfloat16) for i, m in enumerate(masters)}})
        return [_nested(s) for s in out]
    tensors = 6
    cols = max(1, nbytes // (4 * rows * tensors * 3))
    out = []
    for _ in range(saves):
        model = {f"w{i}": torch.randn(rows, cols, generator=g) for i in range(tensors)}
        out.append({"model": model, "optim": {f"{k}/exp_avg": v * 0.1 for k, v in model.items()}
                    | {f"{k}/exp_avg_sq": v * v for k, v in model.items()}})
    return [_nested(s) for s in out]


def _nested(state: dict[str, dict[str, torch.Tensor]]) -> dict[str, Any]:
    return unflatten({f"{group}/{name}": value for group, tensors in state.items() for name, value in tensors.items()})


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return flatten(state, lambda v: isinstance(v, torch.Tensor))[0]


def changed_bytes(before: dict[str, Any] | None, after: dict[str, Any]) -> int:
    """The value bytes of the elements of `after` that differ (bitwise) from `before`."""
    a = _flat(after)
    if before is None:
        return sum(t.numel() * t.element_size() for t in a.values())
    b = _flat(before)
    total = 0
    for name, t in a.items():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        total += int((t.view(bits) != b[name].view(bits)).sum()) * t.element_size()
    return total


def _written(manifest: Any, directory: str) -> dict[str, int]:
    """What a save wrote: its own files, their headers, the patch indices, the manifest."""
    own = [f for f in manifest.files if f.base is None]
    headers = 0
    for f in own:
        with open(os.path.join(directory, f.path), "rb") as fh:
            headers += 8 + int.from_bytes(fh.read(8), "little")
    index = sum(p.count * 4 for t in manifest.tensors.values() for p in t.patches if manifest.files[p.file].base is None)
    return {"files": sum(f.size for f in own), "headers": headers, "index": index,
            "manifest": os.path.getsize(os.path.join(directory, "manifest.json"))}


def _restore(directory: str) -> float:
    from ckptkit import load

    evict_files(os.path.dirname(directory))
    start = time.perf_counter()
    load(directory)
    return time.perf_counter() - start


def encode_speed(nbytes: int = 256 << 20, changed: float = 0.01) -> dict[str, float]:
    """Finding the changed elements of a bf16 box (about `changed` of them) against a memcpy of it,
    in memory, medians of 5."""
    from ckptkit.ops.incremental import changed_positions

    rng = np.random.default_rng(0)
    before = rng.integers(0, 1 << 16, nbytes // 2, dtype=np.uint16)
    after = before.copy()
    after[rng.choice(len(after), int(len(after) * changed), replace=False)] ^= 1
    out = np.empty_like(after)
    diffs, copies = [], []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(out, after)
        copies.append(time.perf_counter() - start)
        start = time.perf_counter()
        changed_positions(before.view(np.uint8), after.view(np.uint8), len(after))
        diffs.append(time.perf_counter() - start)
    diff, copy = statistics.median(diffs), statistics.median(copies)
    return {"bytes": nbytes, "changed": changed, "diff_s": diff, "memcpy_s": copy, "vs_memcpy": copy / diff}


def codec(directory: str, nbytes: int = 64 << 20) -> dict[str, float]:
    """A lossless codec for fp32 optimizer state: the 4 byte planes of Adam's second moment of a
    random model, each through zlib at level 1 (the fastest codec this environment has), against
    a durable write of the same bytes; it pays when compressing and writing the smaller bytes
    takes less than writing them as they are."""
    from .limits import write_limit

    g = torch.Generator().manual_seed(1)
    v = (torch.randn(nbytes // 4, generator=g) * 1e-3) ** 2
    planes = v.numpy().view(np.uint8).reshape(-1, 4).T.copy()
    start = time.perf_counter()
    packed = sum(len(zlib.compress(plane.tobytes(), 1)) for plane in planes)
    seconds = time.perf_counter() - start
    write_s = statistics.median(write_limit(directory, nbytes) for _ in range(3))
    shutil.rmtree(directory, ignore_errors=True)
    ratio = packed / nbytes
    return {"bytes": nbytes, "ratio": ratio, "compress_s": seconds, "write_s": write_s,
            "time_vs_plain": (seconds + ratio * write_s) / write_s}


def run(request: dict[str, Any]) -> dict[str, Any]:
    """One scenario: `saves` states saved full and incrementally, interleaved; then the newest
    step of each restored cold, in turns."""
    from ckptkit import save

    scenario, work, saves = request["scenario"], request["work"], request.get("saves", SAVES)
    nbytes = request["size_mib"] << 20
    states = _states(scenario, nbytes, saves)
    roots = {mode: os.path.join(work, "incremental", scenario, mode) for mode in ("full", "incremental")}
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    per_save: list[dict[str, Any]] = []
    previous = None
    manager = None
    if scenario == "rl-compact":
        from ckptkit import CheckpointManager

        manager = CheckpointManager(roots["incremental"], name_format="step_{step:04d}", incremental=True,
                                    compact_after=COMPACT_AFTER)
    for step, state in enumerate(states, 1):
        row: dict[str, Any] = {"step": step, "changed": changed_bytes(previous, state)}
        for mode in (("full", "incremental") if step % 2 else ("incremental", "full")):
            directory = os.path.join(roots[mode], f"step_{step:04d}")
            start = time.perf_counter()
            if manager is not None and mode == "incremental":
                manifest = manager.save(step, state).committed.result()  # a compaction it starts included
            else:
                manifest = save(state, directory, step=step, incremental=mode == "incremental")
            row[f"{mode}_s"] = time.perf_counter() - start
            row[mode] = _written(manifest, directory)
            if mode == "full" and step > 1:  # only the newest full save is kept (it is restored)
                shutil.rmtree(os.path.join(roots[mode], f"step_{step - 1:04d}"))
        per_save.append(row)
        previous = state
    if manager is not None:
        manager.close()
    compacted = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(roots["incremental"])
                    if ".compact-" in d for f in files)
    newest = {mode: os.path.join(root, f"step_{saves:04d}") for mode, root in roots.items()}
    restores: dict[str, list[float]] = {"full": [], "incremental": []}
    for turn in range(3):
        for mode in (("full", "incremental") if turn % 2 == 0 else ("incremental", "full")):
            restores[mode].append(_restore(newest[mode]))
    state_bytes = sum(t.numel() * t.element_size() for t in _flat(states[0]).values())
    for root in roots.values():
        shutil.rmtree(root, ignore_errors=True)
    return {"scenario": scenario, "saves": saves, "state_bytes": state_bytes, "per_save": per_save, "compacted": compacted,
            "restore_full_s": restores["full"], "restore_incremental_s": restores["incremental"], "seconds": 0.0}


def summary(block: dict[str, Any]) -> dict[str, Any]:
    """Medians over the saves after the first (the first of a chain is a full one either way); the
    value bytes written against the bytes that changed, summed over them."""
    later = block["per_save"][1:]
    changed = sum(r["changed"] for r in later)
    values = sum(r["incremental"]["files"] - r["incremental"]["headers"] - r["incremental"]["index"] for r in later)
    return {
        "state_bytes": block["state_bytes"],
        "changed_bytes": statistics.median(r["changed"] for r in later),
        "full_written": statistics.median(r["full"]["files"] + r["full"]["manifest"] for r in later),
        "incremental_written": statistics.median(r["incremental"]["files"] + r["incremental"]["manifest"] for r in later),
        "index_bytes": statistics.median(r["incremental"]["index"] for r in later),
        "manifest_bytes": statistics.median(r["incremental"]["manifest"] for r in later),
        "bytes_vs_changed": values / changed if changed else None,  # over every save after the first
        "full_s": statistics.median(r["full_s"] for r in later),
        "incremental_s": statistics.median(r["incremental_s"] for r in later),
        "incremental_mean_s": statistics.mean(r["incremental_s"] for r in later),  # rl-compact: its compactions count here
        "throughput_vs_full": statistics.median(r["full_s"] / r["incremental_s"] for r in later),
        "restore_vs_full": statistics.median(a / b for a, b in zip(block["restore_incremental_s"], block["restore_full_s"])),
        "restore_full_s": statistics.median(block["restore_full_s"]),
        "restore_incremental_s": statistics.median(block["restore_incremental_s"]),
        "compacted_per_save": block.get("compacted", 0) / len(later) if later else 0,  # what compactions wrote, spread
    }
