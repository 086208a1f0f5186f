"""A tool's format as a view of a canonical model (pure data), and the layout it implies.

A `View` says, for one tool and one architecture, what each canonical tensor is called there
and which are fused into one tensor (`Fuse`: concatenated in order, as Phi-3's ``qkv_proj``, or
interleaved group by group, as GPT-NeoX's per-head ``query_key_value``), whether the
layers' matrices are stored transposed (GPT-2's ``Conv1D``), and which rows a tool keeps in the
original Llama's rotary order (torchtitan's and Meta's q and k: each head's two halves
interleaved, where the canonical model, as Hugging Face, keeps them one after the other). `layout_of` turns a model and a
view into the layout (``ckptkit-layout``) that cuts the tool's tensors as tensor, pipeline,
expert and data parallelism would: one unit per top-level module, one per layer (one of each
kind where layers differ: dense and mixture-of-experts layers), one expert unit per MoE layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import LayoutError
from ..layouts.model import Constraint, Layout, Param, TensorPart, TPCut, Unit
from .spec import Block, ModelSpec, Tensor

LAYER, EXPERT = "{layer}", "{expert}"


@dataclass(frozen=True, slots=True)
class Fuse:
    """A tool tensor made of canonical ones (names relative to the layer), fused along their
    dim 0: one after another, or (`groups` > 0) interleaved: each of `groups` groups takes its
    rows of every part in turn."""

    name: str
    parts: tuple[str, ...]
    groups: int = 0


@dataclass(frozen=True)
class View:
    """One tool's names for one architecture's canonical tensors."""

    name: str  # the layout's name
    top: Mapping[str, str]  # canonical top-level name -> the tool's full name
    layer: str  # the layer's module, with {layer}
    names: Mapping[str, str]  # canonical name in a layer -> the tool's, relative to the layer
    experts: str = "mlp.experts"  # the experts' module, relative to the layer
    expert_names: Mapping[str, str] = field(default_factory=dict)  # canonical name in an expert -> the tool's
    fused: tuple[Fuse, ...] = ()
    expert_fused: tuple[Fuse, ...] = ()  # fusions within an expert (names relative to it)
    # tensors of a layer (names relative to it) stacking every expert's parts (fused along dim 0) on a leading expert axis
    expert_stacks: tuple[Fuse, ...] = ()
    transposed: bool = False  # the layers' matrices are stored [in, out]
    vocab_rows: int = 0  # the rows the tool stores a vocabulary in, padded (0: the model's)
    # a tied model's tensors the tool also holds under their own name (the head) -> the name of the one they share
    tied: Mapping[str, str] = field(default_factory=dict)
    # a layer's tensors (canonical names) whose rows the tool keeps in the original Llama's rotary order -> their head size:
    # each head's rows pair i with i + head/2 side by side (canonical row h*head + j*head/2 + i is stored at h*head + 2i + j)
    rotary: Mapping[str, int] = field(default_factory=dict)

    def padded_rows(self, tensor: Tensor) -> int:
        """The rows the tool stores `tensor` in: its own, or a vocabulary's padded ones."""
        rows = tensor.shape[0] if tensor.shape else 1
        return max(self.vocab_rows, rows) if tensor.cut == "vocab" else rows

    def rename(self, scope: str, name: str) -> str:
        """The tool's name of canonical `name` in `scope` (``top``, ``layer`` or ``expert``).

        Raises:
            LayoutError: the view has no name for it.
        """
        table = {"top": self.top, "layer": self.names, "expert": self.expert_names}[scope]
        if name not in table:
            raise LayoutError(f"the {self.name} view has no name for the {scope} tensor {name!r}")
        return table[name]


def _cut(tensor: Tensor, transposed: bool, padded: bool = False) -> TPCut | None:
    if tensor.cut is None:
        return None
    if tensor.cut == "vocab":  # padded to a multiple of tp here, unless the tool stores it padded
        return TPCut(dim=0) if padded else TPCut(dim=0, pad_multiple=1)
    dim = 0 if tensor.cut == "column" else 1
    return TPCut(dim=1 - dim if transposed and len(tensor.shape) == 2 else dim)


def _stored(shape: tuple[int, ...], transposed: bool) -> tuple[int, ...]:
    return shape[::-1] if transposed and len(shape) == 2 else shape


def _param(tensor: Tensor, name: str, full: str, view: View, transposed: bool = False) -> Param:
    rows = view.padded_rows(tensor)
    shape = _stored((rows, *tensor.shape[1:]) if tensor.shape else (), transposed)
    return Param(name=name, parts=(TensorPart(tensor=full, shape=shape),), tp=_cut(tensor, transposed, rows != _rows(tensor)))


def _rows(tensor: Tensor) -> int:
    return tensor.shape[0] if tensor.shape else 1


def _fused(fuse: Fuse, tensors: Mapping[str, Tensor], full: str, transposed: bool) -> Param:
    parts = [tensors[p] for p in fuse.parts]
    cuts = {t.cut for t in parts}
    if cuts != {"column"}:
        raise LayoutError(f"{full}: fuses {', '.join(fuse.parts)}, which tensor parallelism does not all cut by rows")
    rows = [t.shape[0] for t in parts]
    shape = _stored((sum(rows), *parts[0].shape[1:]), transposed)
    dim = 1 if transposed and len(shape) == 2 else 0
    if fuse.groups:  # a TP rank holds whole groups: a run of the fused rows
        return Param(name=fuse.name, parts=(TensorPart(tensor=full, shape=shape),), tp=TPCut(dim=dim))
    starts = [sum(rows[:i]) for i in range(len(rows))]
    return Param(name=fuse.name, parts=tuple(TensorPart(tensor=full, shape=shape, start=a, length=n) for a, n in zip(starts, rows)),
                 tp=TPCut(dim=dim))


def _scope_params(tensors: tuple[Tensor, ...], fusions: tuple[Fuse, ...], scope: str, module: str, local: str,
                  view: View) -> tuple[Param, ...]:
    """The parameters of one scope (a layer: `local` ""; an expert: ``{expert}.``), fused as the
    view fuses them, their tensors under `module` (the scope's module) and `local`."""
    by_name = {t.name: t for t in tensors}
    fused = {p: f for f in fusions if all(q in by_name for q in f.parts) for p in f.parts}
    out, done = [], set()
    for tensor in tensors:
        fuse = fused.get(tensor.name)
        if fuse is not None:
            if fuse.name not in done:
                done.add(fuse.name)
                param = _fused(fuse, by_name, f"{module}.{local}{fuse.name}", view.transposed)
                out.append(Param(name=local + param.name, parts=param.parts, tp=param.tp))
            continue
        name = local + view.rename(scope, tensor.name)
        out.append(_param(tensor, name, f"{module}.{name}", view, view.transposed))
    return tuple(out)


def _top_units(tensors: tuple[Tensor, ...], view: View, place: str) -> list[Unit]:
    """One unit per module of the top-level tensors, in order."""
    by_module: dict[str, list[Param]] = {}
    for tensor in tensors:
        full = view.rename("top", tensor.name)
        module, _, name = full.rpartition(".")
        by_module.setdefault(module, []).append(_param(tensor, name, full, view))
    return [Unit(name=module, place=place, params=tuple(params)) for module, params in by_module.items()]  # type: ignore[arg-type]


def layout_of(spec: ModelSpec, view: View) -> Layout:
    """The layout that cuts `spec`'s tensors under `view`'s names.

    Raises:
        LayoutError: the view has no name for a tensor of the model, or stacks its experts
            (a module's form, which no layout cuts by expert).
    """
    if view.expert_stacks:
        raise LayoutError(f"the {view.name} view stacks each layer's experts in one tensor: no layout cuts it by expert")
    units = _top_units(spec.first, view, "first")
    kinds = spec.kinds()
    for block, layers in kinds:
        on = None if len(kinds) == 1 else layers
        units.append(Unit(name=view.layer, place="layers", layers=on,
                          params=_scope_params(block.tensors, view.fused, "layer", view.layer, "", view)))
        if block.experts:
            module = f"{view.layer}.{view.experts}"
            params = _scope_params(block.expert_tensors, view.expert_fused, "expert", module, f"{EXPERT}.", view)
            units.append(Unit(name=module, place="layers", layers=on, experts=block.experts, params=params))
    units += _top_units(spec.last, view, "last")
    constraints = tuple(Constraint(axis=r.axis, divides=r.divides, at_most=r.at_most, what=r.what) for r in spec.rules)
    return Layout(name=view.name, config=dict(spec.config), num_layers=len(spec.layers), units=tuple(units), constraints=constraints)
