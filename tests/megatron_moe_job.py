"""A megatron-core job on CPU (gloo ranks) that loads a ``torch_dist`` checkpoint of a mixture of
experts into a GPTModel with megatron-core's MoE layer (local spec, ``SequentialMLP`` experts)
at a given TP and EP with ``dist_checkpointing.load``, then saves it again with
``dist_checkpointing.save``. Each rank writes its loaded parameters (``rank<r>.safetensors``,
its TP and EP ranks in the metadata); rank 0 writes the logits on the given ids (gathered over
TP) and megatron-core's ``load_plain_tensors`` of the checkpoint and of its own save. Used by
``tests/test_export_megatron_moe.py``; needs megatron-core (and the fixtures' CPU patches from
``fixtures/make_megatron.py``).

One more stand-in than ``tests/megatron_session.py``'s, for megatron-core 0.16.1 without
TransformerEngine on a CPU torch: its ``alltoall`` token dispatcher makes a ``torch.cuda.Stream()``
when built (``RuntimeError: torch.cuda.Stream requires CUDA support``), so the job uses the
``allgather`` dispatcher.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .megatron_session import logits, megatron_ranks


def _model(tp: int, ep: int, c: dict[str, Any]) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_heads"],
        num_query_groups=c["num_kv_heads"], ffn_hidden_size=c["intermediate_size"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", layernorm_epsilon=c["norm_eps"],
        add_bias_linear=False, use_cpu_initialization=True, tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
        pipeline_dtype=torch.float32, params_dtype=torch.float32, num_moe_experts=c["num_experts"],
        moe_router_topk=c["top_k"], moe_router_pre_softmax=False, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    )
    spec = get_gpt_layer_local_spec(num_experts=c["num_experts"], moe_grouped_gemm=False, normalization="RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=c["vocab_size"], max_sequence_length=c["max_seq_len"],
                    position_embedding_type="rope", rotary_base=int(c["rope_theta"]),
                    share_embeddings_and_output_weights=bool(c["tie_embeddings"]))


def job(rank: int, world: int, tp: int, ep: int, path: str, ids_file: str, out: str, port: int, config: dict[str, Any]) -> None:
    """Load `path` into the MoE GPTModel of the reference `config` at TP `tp` and EP `ep` over
    `world` ranks (this process being rank `rank`); see the module."""
    with megatron_ranks(rank, world, port, tp=tp, ep=ep):
        from megatron.core import dist_checkpointing, parallel_state
        from safetensors.torch import load_file, save_file

        gpt = _model(tp, ep, config)
        gpt.load_state_dict(dist_checkpointing.load({"model": gpt.sharded_state_dict()}, path)["model"])
        ranks = {"tp": parallel_state.get_tensor_model_parallel_rank(), "ep": parallel_state.get_expert_model_parallel_rank(),
                 "etp": parallel_state.get_expert_tensor_parallel_rank()}
        save_file({k: v.contiguous() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)},
                  os.path.join(out, f"rank{rank}.safetensors"), metadata={k: str(v) for k, v in ranks.items()})
        out_logits = logits(gpt, load_file(ids_file)["ids"])
        resaved = os.path.join(out, "resaved")
        if rank == 0:
            os.mkdir(resaved)
        torch.distributed.barrier()
        dist_checkpointing.save({"model": gpt.sharded_state_dict()}, resaved)
        if rank == 0:
            save_file({"logits": out_logits.contiguous()}, os.path.join(out, "logits.safetensors"))
        for name, where in (("plain", path), ("resaved-plain", resaved)):
            plain = dist_checkpointing.load_plain_tensors(where)  # collective: every rank reads
            if rank == 0:
                save_file({k: v.contiguous() for k, v in plain.items() if isinstance(v, torch.Tensor)},
                          os.path.join(out, f"{name}.safetensors"))


def plain_job(rank: int, world: int, path: str, out: str, port: int) -> None:
    """Read `path` with megatron-core's ``load_plain_tensors`` on every one of `world` ranks (it
    is collective); rank 0 writes every tensor, model and optimizer state, to ``plain.safetensors``."""
    with megatron_ranks(rank, world, port):
        from megatron.core import dist_checkpointing
        from safetensors.torch import save_file

        plain = dist_checkpointing.load_plain_tensors(path)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in plain.items() if isinstance(v, torch.Tensor)}, os.path.join(out, "plain.safetensors"))
