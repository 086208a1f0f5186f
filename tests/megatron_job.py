"""A megatron-core job on CPU (gloo ranks) that loads a ``torch_dist`` checkpoint into a GPTModel
at a given TP with ``dist_checkpointing.load``, as a Megatron user resumes. Rank 0 writes what
the test compares: the loaded model's logits on the fixtures' ids (gathered over TP), and
megatron-core's own ``load_plain_tensors`` of the checkpoint (every tensor, model and optimizer
state, as megatron-core reads it). Used by ``tests/test_export_megatron.py``; needs megatron-core
(and the fixtures' CPU patches from ``fixtures/make_megatron.py``).

The distributed optimizer itself is not loaded here: ``tests/megatron_resume_job.py`` resumes it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from .megatron_session import FIXTURES, logits, megatron_ranks


def gpt_model(tp: int, dtype: torch.dtype, c: dict[str, int]) -> Any:
    """The fixtures' GPTModel of config `c` (local layer spec) at TP `tp`, on the CPU."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        num_query_groups=c["num_query_groups"], ffn_hidden_size=c["ffn_hidden_size"], gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, pipeline_dtype=dtype, params_dtype=dtype, bf16=dtype == torch.bfloat16,
    )
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                    vocab_size=c["vocab_size"], max_sequence_length=c["max_sequence_length"], position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def job(rank: int, tp: int, path: str, ids_file: str, out: str, port: int, dtype_name: str, config: dict[str, int] | None = None) -> None:
    """Load `path` into a GPTModel of `config` (default: the fixtures' model) at TP `tp` (this
    process being rank `rank`); see the module."""
    with megatron_ranks(rank, tp, port, tp=tp):
        sys.path.insert(0, str(FIXTURES))
        import make_megatron
        from megatron.core import dist_checkpointing
        from safetensors.torch import load_file, save_file

        gpt = gpt_model(tp, getattr(torch, dtype_name), config or make_megatron.CONFIG)
        gpt.load_state_dict(dist_checkpointing.load({"model": gpt.sharded_state_dict()}, path)["model"])  # as Megatron-LM nests it
        out_logits = logits(gpt, load_file(ids_file)["ids"])
        plain = dist_checkpointing.load_plain_tensors(path)
        if rank == 0:
            save_file({"logits": out_logits.contiguous()}, os.path.join(out, "logits.safetensors"))
            save_file({k: v.contiguous() for k, v in plain.items() if isinstance(v, torch.Tensor)}, os.path.join(out, "plain.safetensors"))
