"""Canonical models and the views of them that each tool's format is (pure: no torch, no I/O).

An architecture's canonical model (``ModelSpec``: its logical tensors, unfused and named
once, per layer, with the rules that hold for them) is read from the model's own config
(``spec_from_config``); a tool's format is a ``View`` of it (names, fusions, transposition), and
``layout_of(spec, view)`` is the layout that view's checkpoints are cut by. ``hf_layout`` is
that layout for a Hugging Face ``config.json``. The views: Hugging Face's (``hf_view``),
Megatron-Core's (``megatron_view``), the reference trainer's (``REFERENCE``); ``model_of(layout)``
is a checkpoint's model and view, and ``compose`` converts any view to any other.
"""

from __future__ import annotations

from .compose import Placement, Run, Span, compose, placed
from .hf_config import READERS, spec_from_config
from .hf_view import hf_layout, hf_view, module_names, tied_heads
from .megatron_view import hf_config_of_megatron, megatron_args, megatron_config, megatron_view
from .reference import REFERENCE, model_of, reference_hf_config
from .spec import Block, ModelSpec, Rule, Tensor
from .view import Fuse, View, layout_of

__all__ = ["READERS", "REFERENCE", "Block", "Fuse", "ModelSpec", "Placement", "Rule", "Run", "Span", "Tensor", "View", "compose",
           "hf_config_of_megatron", "hf_layout", "hf_view", "layout_of", "megatron_args", "megatron_config", "megatron_view",
           "model_of", "module_names", "placed", "reference_hf_config", "spec_from_config", "tied_heads"]
