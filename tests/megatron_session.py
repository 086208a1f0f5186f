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


def torch_adam_resume_patches() -> None:
    """Let megatron-core 0.16.1's DistributedOptimizer resume over torch's Adam, as it does over
    FusedAdam (TransformerEngine or Apex), in this process only.

    Without TE or Apex it steps torch's Adam, which keeps a ``step`` tensor per parameter
    (FusedAdam: one per parameter group), and its resume path assumes FusedAdam's layout:
    ``DistributedOptimizer.state_dict`` (distrib_optimizer.py:641) reads every parameter's
    ``step``, which an optimizer that has not stepped yet does not have; ``load_state_dict``
    (:818-825) gives every parameter one shared ``step`` tensor (torch's Adam then adds 1 to it
    once per parameter); ``_set_main_param_and_optimizer_states`` (:938-940) copies every state
    key from the loaded tensors, which carry no ``step`` (``KeyError: 'step'``). The stand-in
    gives torch's optimizer the state its first step creates before megatron-core reads it, keeps
    the ``step`` megatron-core took from the saved parameter groups, and gives each parameter
    its own copy of it. The masters and moments are megatron-core's own loads, untouched."""
    from megatron.core.optimizer import distrib_optimizer as do

    cls = do.DistributedOptimizer
    if do.HAVE_APEX_OR_TE or getattr(cls, "_ckptkit_tests_resume", False):
        return
    state_dict, load_state_dict, set_states = cls.state_dict, cls.load_state_dict, cls._set_main_param_and_optimizer_states

    def init_state(self: Any) -> None:
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state[p]
                if not state:  # as torch.optim.Adam's first step
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def patched_state_dict(self: Any) -> Any:
        init_state(self)
        return state_dict(self)

    def patched_load_state_dict(self: Any, sd: Any) -> Any:
        init_state(self)
        out = load_state_dict(self, sd)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].detach().clone()
        return out

    def patched_set_states(self: Any, model_param: Any, tensors: dict[str, torch.Tensor]) -> Any:
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state:
            tensors = {**tensors, "step": state["step"]}
        with torch.no_grad():
            return set_states(self, model_param, tensors)

    cls.state_dict = patched_state_dict
    cls.load_state_dict = patched_load_state_dict
    cls._set_main_param_and_optimizer_states = patched_set_states
    cls._ckptkit_tests_resume = True
