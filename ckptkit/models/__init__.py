"""Canonical models and the views of them that each tool's format is (pure: no torch, no I/O).

An architecture's canonical model (``ModelSpec``: its logical tensors, unfused and named
once, per layer, with the rules that hold for them) is read from the model's own config
(``spec_from_config``); a tool's format is a ``View`` of it (names, fusions, transposition), and
``layout_of(spec, view)`` is the layout that view's checkpoints are cut by. The reference
trainer's view is here (``REFERENCE``); each tool's is in its adapter (``ckptkit_adapters``:
Hugging Face's, Megatron-Core's), found through ``ckptkit.adapters``; ``model_of(layout)`` is a
checkpoint's model and view whoever's it is, and ``compose`` converts any view to any other.
"""

from __future__ import annotations

from .compose import Placement, Run, Span, compose, placed
from .hf_config import READERS, spec_from_config
from .reference import REFERENCE, REFERENCE_MODULES, model_of, modules_of, reference_hf_config
from .spec import Block, ModelSpec, Rule, Tensor
from .view import Fuse, View, layout_of

__all__ = ["READERS", "REFERENCE", "REFERENCE_MODULES", "Block", "Fuse", "ModelSpec", "Placement", "Rule", "Run", "Span", "Tensor",
           "View", "compose", "layout_of", "model_of", "modules_of", "placed", "reference_hf_config", "spec_from_config"]
