"""Canonical models and the views of them that each tool's format is (pure: no torch, no I/O).

An architecture's canonical model (``ModelSpec``: its logical tensors, unfused and named
once, per layer, with the rules that hold for them) is read from the model's own config
(``spec_from_config``); a tool's format is a ``View`` of it (names, fusions, transposition), and
``layout_of(spec, view)`` is the layout that view's checkpoints are cut by. ``hf_layout`` is
that layout for a Hugging Face ``config.json``.
"""

from __future__ import annotations

from .hf_config import READERS, spec_from_config
from .hf_view import hf_layout, hf_view, module_names, tied_heads
from .spec import Block, ModelSpec, Rule, Tensor
from .view import Fuse, View, layout_of

__all__ = ["READERS", "Block", "Fuse", "ModelSpec", "Rule", "Tensor", "View", "hf_layout", "hf_view", "layout_of", "module_names", "spec_from_config", "tied_heads"]
