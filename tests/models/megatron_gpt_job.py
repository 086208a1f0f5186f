"""A megatron-core job on CPU (gloo ranks) that builds the ``GPTModel`` a ``megatron-gpt`` layout's
config describes (local spec: dense or mixture of experts with ``SequentialMLP`` experts, q, k, v
biases, per-head q/k norms), loads a ``torch_dist`` checkpoint into it at a given TP with
``dist_checkpointing.load``, and has rank 0 write its logits on the given ids (gathered over TP)
to a safetensors file; one job (one start of megatron-core) does it for many checkpoints. Used
by ``tests/models/test_megatron_views.py``; needs megatron-core (and ``tests/megatron_session.py``'s
stand-ins; MoE layers take the ``allgather`` dispatcher, as ``tests/megatron_moe_job.py`` explains).
"""

from __future__ import annotations

from typing import Any

import torch

from ..megatron_session import logits, megatron_ranks


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


def job(rank: int, tp: int, loads: list[tuple[str, dict[str, Any], str]], ids_file: str, port: int) -> None:
    """Load each ``(path, config, out)`` of `loads` into the GPTModel of `config` at TP `tp` (this
    process being rank `rank`), its logits on the ids of `ids_file` written to `out`; see the module."""
    with megatron_ranks(rank, tp, port, tp=tp):
        from megatron.core import dist_checkpointing
        from safetensors.torch import load_file, save_file

        ids = load_file(ids_file)["ids"]
        for path, config, out in loads:
            gpt = _model(tp, config)
            gpt.load_state_dict(dist_checkpointing.load({"model": gpt.sharded_state_dict()}, path)["model"])
            found = logits(gpt, ids)
            if rank == 0:
                save_file({"logits": found.contiguous()}, out)
