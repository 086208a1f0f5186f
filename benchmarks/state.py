"""The benchmark state: a deterministic fp32 model state of realistically sized tensors.

Two big tensors (embedding and output head, each 1/8 of the state) and transformer layers of
grouped-query attention and an MLP (tensors of 1, 4 and 16 MiB, plus 4 KiB norms), repeated
until the size is reached; a last tensor takes whatever is left. At 2048 MiB that is 2
tensors of 256 MiB, 26 whole layers of 9 tensors and a partial one: 244 tensors in all.
Values are incompressible pseudo-random floats; any tensor can be rebuilt alone from its
index, so a loader's output can be spot-checked. torch is imported only to build tensors,
so that the specs cost a worker nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MIB = 1 << 20
HIDDEN = 1024
ELEMENT_BYTES = 4  # float32
SEED = 20240611
# A block of random values that every tensor is cut from, at a tensor-specific offset:
# as incompressible as fresh random numbers, and far cheaper to build 2 GiB of.
_BLOCK_ELEMENTS = 16 * MIB // ELEMENT_BYTES
_LAYER = (
    ("attn.q", (HIDDEN, HIDDEN)),
    ("attn.k", (HIDDEN // 4, HIDDEN)),
    ("attn.v", (HIDDEN // 4, HIDDEN)),
    ("attn.o", (HIDDEN, HIDDEN)),
    ("mlp.gate", (4 * HIDDEN, HIDDEN)),
    ("mlp.up", (4 * HIDDEN, HIDDEN)),
    ("mlp.down", (HIDDEN, 4 * HIDDEN)),
    ("norm1", (HIDDEN,)),
    ("norm2", (HIDDEN,)),
)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the state: its flat name, shape, and index (which seeds its values)."""

    index: int
    name: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ELEMENT_BYTES
        for d in self.shape:
            n *= d
        return n


def state_specs(size_mib: int) -> list[TensorSpec]:
    """Return the tensors of a state of about `size_mib` MiB, in a fixed order."""
    budget = size_mib * MIB
    rows_big = max(1, budget // 8 // (HIDDEN * ELEMENT_BYTES))
    specs = [
        TensorSpec(0, "model.embed.weight", (rows_big, HIDDEN)),
        TensorSpec(1, "model.head.weight", (rows_big, HIDDEN)),
    ]
    left = budget - sum(s.nbytes for s in specs)
    layer_bytes = sum(TensorSpec(0, "", shape).nbytes for _, shape in _LAYER)
    layer = 0
    while left > 0:
        whole = left >= layer_bytes
        for part, shape in _LAYER:
            spec = TensorSpec(len(specs), f"model.layers.{layer}.{part}", shape)
            if spec.nbytes <= left:
                specs.append(spec)
                left -= spec.nbytes
        layer += 1
        if not whole:
            break
    rows_left = left // (HIDDEN * ELEMENT_BYTES)
    if rows_left:
        specs.append(TensorSpec(len(specs), "model.tail.weight", (rows_left, HIDDEN)))
    return specs


def state_bytes(specs: list[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def _block() -> torch.Tensor:
    import torch

    gen = torch.Generator().manual_seed(SEED)
    return torch.randn(_BLOCK_ELEMENTS, generator=gen, dtype=torch.float32)


def build_tensor(spec: TensorSpec, block: torch.Tensor | None = None) -> torch.Tensor:
    """Return the values of one tensor of the state (the same on every call)."""
    import torch

    source = _block() if block is None else block
    out = torch.empty(spec.shape, dtype=torch.float32)
    flat = out.view(-1)
    pos = (spec.index * 7919 * 1031) % _BLOCK_ELEMENTS
    done = 0
    while done < flat.numel():
        n = min(flat.numel() - done, _BLOCK_ELEMENTS - pos)
        flat[done : done + n].copy_(source[pos : pos + n])
        done += n
        pos = 0
    return out


def build_state(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Return the whole state as a flat dict name -> tensor."""
    block = _block()
    return {s.name: build_tensor(s, block) for s in specs}


def empty_state(specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """Return uninitialized tensors of the state's names and shapes (a load target)."""
    import torch

    return {s.name: torch.empty(s.shape, dtype=torch.float32) for s in specs}
