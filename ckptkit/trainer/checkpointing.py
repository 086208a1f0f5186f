"""The trainer's checkpoint: everything to resume, in logical form, through the public ckptkit API.

Parameters and Adam moments are saved as their logical (unfused, unpadded) tensors: each rank
contributes the boxes it holds, as views of its flat buffers (no copy); ZeRO ranges become the
few boxes they cover. RNG states are uint8 tensors with one row per rank.
"""

from __future__ import annotations

import random
import struct
from collections import defaultdict
from typing import Any

import numpy as np
import torch
import xxhash

from .. import ShardedTensor
from ..layouts import part_ranges
from .zero import Unit


def range_boxes(unit: Unit, values: torch.Tensor, lo: int, hi: int) -> dict[str, list[ShardedTensor]]:
    """Describe `values` (the unit's flat elements [lo, hi)) as boxes of the logical tensors.

    The ShardedTensors are views of `values`: saving reads them, loading fills them in place.
    """
    out: dict[str, list[ShardedTensor]] = defaultdict(list)
    for part, start, x, y in part_ranges(unit.specs, lo, hi):
        out[part.name] += ShardedTensor.from_flat(
            values[x - lo : y - lo], part.global_shape, x - start, origin=part.offsets, extent=part.lengths
        )
    return out


def tensor_state(units: list[Unit]) -> dict[str, Any]:
    """Return this rank's parameters and Adam moments as nested dicts of ShardedTensor lists."""
    model: dict[str, list[ShardedTensor]] = {}
    exp_avg: dict[str, list[ShardedTensor]] = {}
    exp_avg_sq: dict[str, list[ShardedTensor]] = {}
    for unit in units:
        if unit.zero == 3:
            model.update(range_boxes(unit, unit.shard.data, unit.lo, unit.hi))
        else:
            assert unit.flat is not None
            model.update(range_boxes(unit, unit.flat, 0, unit.numel))
        exp_avg.update(range_boxes(unit, unit.exp_avg, unit.state_lo, unit.state_hi))
        exp_avg_sq.update(range_boxes(unit, unit.exp_avg_sq, unit.state_lo, unit.state_hi))
    return {"model": model, "optimizer": {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}}


def _python_rng_bytes() -> torch.Tensor:
    version, internal, gauss = random.getstate()
    data = struct.pack(f"<i{len(internal)}Id?", version, *internal, gauss or 0.0, gauss is not None)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _restore_python_rng(raw: torch.Tensor) -> None:
    data = raw.numpy().tobytes()
    n = (len(data) - 4 - 8 - 1) // 4
    fields = struct.unpack(f"<i{n}Id?", data)
    version, internal, gauss, has_gauss = fields[0], fields[1 : 1 + n], fields[1 + n], fields[2 + n]
    random.setstate((version, tuple(internal), gauss if has_gauss else None))


def _numpy_rng_bytes() -> torch.Tensor:
    state: Any = np.random.get_state()
    name, keys, pos, has_gauss, cached = state
    assert name == "MT19937"
    data = keys.astype("<u4").tobytes() + struct.pack("<ii d", pos, has_gauss, cached)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _restore_numpy_rng(raw: torch.Tensor) -> None:
    data = raw.numpy().tobytes()
    keys = np.frombuffer(data[: 624 * 4], dtype="<u4")
    pos, has_gauss, cached = struct.unpack("<ii d", data[624 * 4 :])
    np.random.set_state(("MT19937", keys, pos, has_gauss, cached))


RNG_STREAMS = {
    "torch_cpu": (torch.get_rng_state, torch.set_rng_state),
    "python": (_python_rng_bytes, _restore_python_rng),
    "numpy": (_numpy_rng_bytes, _restore_numpy_rng),
}


def _streams() -> dict[str, tuple[Any, Any]]:
    """The generators this process uses: CPU, Python, NumPy, and the current GPU's once CUDA is in use."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {**RNG_STREAMS, "torch_cuda": (torch.cuda.get_rng_state, torch.cuda.set_rng_state)}
    return RNG_STREAMS


def rng_state(rank: int, world: int) -> dict[str, ShardedTensor]:
    """Return every generator's state on this rank as row `rank` of a [world, n] uint8 tensor."""
    out = {}
    for name, (get, _) in _streams().items():
        state = get().reshape(1, -1).clone()
        out[name] = ShardedTensor(state, (world, state.shape[1]), (rank, 0))
    return out


def rng_targets(rank: int, world: int) -> dict[str, ShardedTensor]:
    """Return load targets for this rank's row of every generator state."""
    return {name: ShardedTensor(torch.empty_like(t.local), t.global_shape, t.global_offsets) for name, t in rng_state(rank, world).items()}


def restore_rng(loaded: dict[str, ShardedTensor]) -> None:
    streams = _streams()
    for name, target in loaded.items():
        streams[name][1](target.local.reshape(-1).clone())


def seed_rngs(seed: int) -> None:
    """Seed every generator this rank uses (torch CPU, Python, NumPy)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def derived_seed(saved: dict[str, torch.Tensor], rank: int, world: int) -> int:
    """Return the seed of `rank`'s streams after a topology change: a hash of every saved state
    (all ranks of the old topology) with the new rank and world size, so that the result is
    deterministic and no two new ranks share a stream."""
    h = xxhash.xxh3_64()
    for name, states in saved.items():
        h.update(name.encode())
        h.update(states.contiguous().numpy().tobytes())
    h.update(f"rank {rank} of {world}".encode())
    return h.intdigest() % 2**63
