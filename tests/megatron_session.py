"""What every megatron-core job of the tests shares (gloo ranks on CPU): the process group,
megatron-core's model-parallel state and its CPU stand-ins, and a GPTModel's forward.

The stand-ins, for megatron-core 0.16.1 without TransformerEngine on a CPU torch: the fixtures'
CPU patches (``fixtures/make_megatron.py``), no CUDA RNG tracker seeding, and the MoE router's
``te_general_gemm``, a name only bound when TransformerEngine imports (``NameError``; set to None
it takes its torch path).
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@contextmanager
def megatron_ranks(rank: int, world: int, port: int, tp: int = 1, ep: int = 1) -> Iterator[None]:
    """Rank `rank` of `world` gloo ranks with megatron-core's model parallelism at `tp` x `ep`;
    every rank waits for the others at the end."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sys.path.insert(0, str(FIXTURES))
        import make_megatron

        make_megatron._cpu_patches()
        import megatron.core.transformer.moe.moe_utils as moe_utils
        from megatron.core import parallel_state, tensor_parallel

        moe_utils.te_general_gemm = None
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None  # type: ignore[assignment]
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()


def logits(gpt: Any, ids: torch.Tensor) -> torch.Tensor:
    """The GPTModel's logits on `ids` (causal, positions 0..n-1), gathered over TP."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
    mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        return gather_from_tensor_model_parallel_region(gpt.eval()(ids, positions, mask))  # type: ignore[no-any-return]
