"""Megatron-Core's module names that more than its view needs (pure): where a mixture of experts'
experts are (``SequentialMLP``'s ``local_experts``, each under its global index as at EP 1, and
the key megatron-core stacks them under on a (layer, expert) axis pair), and the linear modules
whose ``_extra_state`` megatron-core asks for (``None`` in the local spec). The built-in
``megatron-gpt`` layout (``layout``), the Megatron view (``view``), the export and the
converter read them here.
"""

from __future__ import annotations

MEGATRON_LOCAL_EXPERTS = "mlp.experts.local_experts"
MEGATRON_EXPERTS = "mlp.experts.experts"
MEGATRON_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
MEGATRON_MOE_EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv")
MEGATRON_EXPERT_EXTRA_STATE = (f"{MEGATRON_EXPERTS}.linear_fc1", f"{MEGATRON_EXPERTS}.linear_fc2")

__all__ = ["MEGATRON_EXPERTS", "MEGATRON_EXPERT_EXTRA_STATE", "MEGATRON_EXTRA_STATE", "MEGATRON_LOCAL_EXPERTS",
           "MEGATRON_MOE_EXTRA_STATE"]
