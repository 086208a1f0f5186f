"""A megatron-core job on CPU (gloo ranks) that builds the ``GPTModel`` a ``megatron-gpt`` layout's
config describes (local spec: dense or mixture of experts with ``SequentialMLP`` experts, q, k, v
biases, per-head q/k norms), loads a ``torch_dist`` checkpoint into it at a given TP with
``dist_checkpointing.load``, and has rank 0 write its logits on the given ids (gathered over TP)
to ``logits.safetensors``. Used by ``tests/models/test_megatron_views.py``; needs megatron-core
and the stand-ins of ``tests/megatron_moe_job.py`` (the fixtures' CPU patches, the router's
``te_general_gemm``, the ``allgather`` dispatcher).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch

from ..megatron_moe_job import FIXTURES


def _model(tp: int, c: dict[str, Any]) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    experts = c.get("num_moe_experts")
    moe = dict(num_moe_experts=experts, moe_ffn_hidden_size=c.get("moe_ffn_hidden_size"), moe_router_topk=c.get("moe_router_topk"),
               moe_router_pre_softmax=bool(c.get("moe_router_pre_softmax")), moe_token_dispatcher_type="allgather",
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0) if experts else {}
    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_query_groups"], kv_channels=c["kv_channels"], ffn_hidden_size=c["ffn_hidden_size"],
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        layernorm_epsilon=c["layernorm_epsilon"], add_bias_linear=False, add_qkv_bias=bool(c.get("add_qkv_bias")),
        qk_layernorm=bool(c.get("qk_layernorm")), use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=bool(c.get("qk_layernorm")),
                                    normalization="RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["vocab_size"], max_sequence_length=c["max_sequence_length"],
                    position_embedding_type="rope", rotary_base=int(c["rotary_base"]),
                    share_embeddings_and_output_weights=bool(c["share_embeddings_and_output_weights"]))


def job(rank: int, tp: int, path: str, ids_file: str, out: str, port: int, config: dict[str, Any]) -> None:
    """Load `path` into the GPTModel of `config` at TP `tp` (this process being rank `rank`); see the module."""
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        sys.path.insert(0, str(FIXTURES))
        import make_megatron

        make_megatron._cpu_patches()
        import megatron.core.transformer.moe.moe_utils as moe_utils
        from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
        from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
        from safetensors.torch import load_file, save_file

        moe_utils.te_general_gemm = None  # unbound without TransformerEngine (see tests/megatron_moe_job.py)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed = lambda *a, **k: None  # type: ignore[assignment]
        gpt = _model(tp, config)
        gpt.load_state_dict(dist_checkpointing.load({"model": gpt.sharded_state_dict()}, path)["model"])
        ids = load_file(ids_file)["ids"]
        positions = torch.arange(ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
        mask = torch.triu(torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool), diagonal=1)
        with torch.no_grad():
            logits = gather_from_tensor_model_parallel_region(gpt.eval()(ids, positions, mask))
        if rank == 0:
            save_file({"logits": logits.contiguous()}, os.path.join(out, "logits.safetensors"))
        dist.barrier()
    finally:
        dist.destroy_process_group()
