"""The FSDP2 view of a DCP save: the layout a converted DCP checkpoint records when none is given (pure).

A DCP save of an FSDP2 job holds ``{"model": model_sd, "optim": optim_sd}`` as
``get_state_dict(model, optimizer)`` gives them: each parameter under ``model.<fqn>``, and
torch's optimizer state under ``optim.state.<fqn>.<state>`` (``exp_avg``, ``exp_avg_sq``,
``momentum_buffer``, ...; the per-parameter ``step`` a scalar). FSDP2 cuts every parameter, and
each of its states shaped as it, on dim 0 over the data-parallel ranks (``fully_shard``'s
``Shard(0)``: chunks of ``ceil(rows / dp)`` rows), whatever the model is. That is the layout
`fsdp2_layout` gives (``zero.flatten = "param"``; the optimizer states as state groups named
with a suffix), so that ``reshard`` and ``load`` of the converted checkpoint need no layout file:
at ZeRO 3 every parameter and state is cut on dim 0 over DP, at ZeRO 1-2 only the states.
A DCP save names no tensor-parallel cut and no pipeline stage, so the layout allows neither.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from ckptkit.layouts import Constraint, Layout, Param, StateGroup, TensorPart, Unit, Zero
from ckptkit.ops.convert import TensorSpec

NAME = "fsdp2"
MODEL = "model"  # the prefix of the parameters in ``get_state_dict``'s form
STATE = "/state/"  # torch's optimizer state dict: <optimizer>/state/<fqn>/<state>


def fsdp2_layout(specs: Iterable[TensorSpec]) -> Layout | None:
    """The FSDP2 layout of the converted tensors `specs`, or None when they are not in
    ``get_state_dict``'s form: no ``model/`` parameters, a parameter of no dims (FSDP2 cuts dim
    0), or an optimizer state shaped as its parameter that not every parameter has (it could not
    be cut with them). Other tensors (the optimizer's ``step`` scalars, values outside ``model``
    and the optimizer) are not placed: a reshard keeps them as saved."""
    specs = list(specs)
    params = {s.name[len(MODEL) + 1:]: s.shape for s in specs if s.kind == "param" and s.name.startswith(f"{MODEL}/")}
    if not params or any(not shape for shape in params.values()):
        return None
    held: dict[tuple[str, str], set[str]] = defaultdict(set)  # (optimizer prefix, state) -> the parameters holding it
    for spec in specs:
        at = spec.name.find(STATE)
        if spec.kind != "optimizer" or at < 0:
            continue
        tensor, _, state = spec.name[at + len(STATE):].rpartition("/")
        if params.get(tensor) == spec.shape:
            held[(spec.name[:at], state)].add(tensor)
    if any(len(names) != len(params) for names in held.values()):
        return None
    states = (StateGroup(prefix=MODEL, role="param"),) + tuple(
        StateGroup(prefix=f"{prefix}/state", suffix=state, role="optimizer") for prefix, state in sorted(held))
    unit = Unit(name=MODEL, place="first", params=tuple(
        Param(name=name, parts=(TensorPart(tensor=name, shape=shape),)) for name, shape in params.items()))
    why = "a DCP save names no {} (give --layout FILE for one)"
    return Layout(name=NAME, zero=Zero(flatten="param"), states=states, units=(unit,), constraints=(
        Constraint(axis="tp", at_most=1, what=why.format("tensor-parallel cut")),
        Constraint(axis="pp", at_most=1, what=why.format("pipeline stages")),
        Constraint(axis="ep", at_most=1, what=why.format("experts"))))
