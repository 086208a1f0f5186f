"""What a Hugging Face ``Trainer`` checkpoint folder (``checkpoint-N/``) holds beside the weights.

- ``trainer_state.json``: kept as the value ``trainer/state`` (JSON as written); its
  ``global_step`` is the checkpoint's step.
- ``optimizer.pt``: torch's AdamW state dict (read in place through the allowlist, no class
  rebuilt), its index-keyed state named as ``Trainer`` groups the parameters: the model's
  ``named_parameters`` in their order, weights that decay first and the rest after
  (``Trainer.get_decay_parameter_names``, run on the model transformers builds from the
  ``config.json`` on the meta device, so no weights are made). Each parameter's ``exp_avg`` and
  ``exp_avg_sq`` become ``optimizer/exp_avg/<name>`` and ``optimizer/exp_avg_sq/<name>``; the
  step and the groups' options ``info.optimizer`` (type ``adamw``; ``lr`` the base rate,
  ``initial_lr``).
- ``scheduler.pt``: the LR scheduler's state dict, as JSON, in ``info.scheduler``.
- ``rng_state*.pth``: each process's RNG states (`_read_rng`), numpy's read through its
  allowlist (``common.numpy_pickle``).
- ``training_args.bin``: the pickled ``TrainingArguments`` as the value ``trainer/training_args``
  (`_read_args`: its fields, enums and devices as their values, through an allowlist of the
  classes it names; another class is skipped, naming it).
- ``scaler.pt``: not read yet (listed as skipped, which fails the conversion unless
  ``--allow-skip``).

An optimizer that is not AdamW, or whose parameters are not the weight files' tensors (a
mixture of experts whose modules stack the experts the files hold one by one), is skipped with
its reason, as is everything when transformers is not installed to say the parameters' order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import JsonValue

from ckptkit.errors import IntegrityError, ManifestError
from ckptkit.manifest.dtypes import itemsize
from ckptkit.manifest.model import OptimizerInfo, ParamGroup
from ckptkit.ops.convert import SkippedEntry, TensorSpec
from ckptkit.state.tree import escape, json_problems
from ckptkit.storage.local import open_regular
from ckptkit_adapters.common.files import read_small
from ckptkit_adapters.common.numpy_pickle import NUMPY_ALLOWED, NumpyArray
from ckptkit_adapters.common.safepickle import Record, record_type
from ckptkit_adapters.common.torchsave import STATE_DICT_ALLOWED, Archive, StoredTensor, copy_tensor, open_archive, plain, stored_object

OPTIMIZER, SCHEDULER, STATE = "optimizer.pt", "scheduler.pt", "trainer_state.json"
ARGS = "training_args.bin"
NOT_READ = {"scaler.pt": "the AMP gradient scaler's state: not read yet"}


class _Value(Record):
    """An enum member or a ``torch.device`` as a pickle rebuilds it from its value: read as the value."""


# The classes a TrainingArguments pickle names: the arguments, the dataclasses and accelerate's
# state they hold (read as their fields), enums and devices (read as their values).
_RECORDS = ("transformers.training_args.TrainingArguments", "transformers.trainer_pt_utils.AcceleratorConfig",
            "accelerate.state.PartialState")
_VALUES = ("transformers.trainer_utils.IntervalStrategy", "transformers.trainer_utils.SaveStrategy",
           "transformers.trainer_utils.HubStrategy", "transformers.trainer_utils.SchedulerType",
           "transformers.training_args.OptimizerNames", "accelerate.utils.dataclasses.DistributedType", "torch.device")
ARGS_ALLOWED: dict[tuple[str, str], Any] = {
    **{tuple(q.rsplit(".", 1)): record_type(q) for q in _RECORDS},  # type: ignore[misc]
    **{tuple(q.rsplit(".", 1)): type(q.rsplit(".", 1)[1], (_Value,), {"qualname": q}) for q in _VALUES},  # type: ignore[misc]
}
MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_LIMIT = 64 << 20


@dataclass
class TrainerState:
    """What the folder holds beside the weights, as the checkpoint keeps it."""

    step: int = 0
    tensors: list[tuple[TensorSpec, Callable[[], memoryview]]] = field(default_factory=list)
    objects: dict[str, JsonValue] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # ckptkit name -> the source it came from
    skipped: list[SkippedEntry] = field(default_factory=list)
    optimizer: OptimizerInfo | None = None
    scheduler: dict[str, JsonValue] | None = None
    fds: list[int] = field(default_factory=list)  # the files held open for the tensors' reads; the caller closes them


def is_trainer_folder(names: set[str]) -> bool:
    """Whether a folder's names are a Trainer checkpoint's (its state file or its optimizer)."""
    return STATE in names or OPTIMIZER in names


def read_trainer(src: str, config: Mapping[str, Any], weights: Mapping[str, tuple[int, ...]]) -> TrainerState:
    """Read what `src` holds beside its weights (`weights`: each weight file tensor's key and shape).

    Raises:
        ManifestError: a malformed trainer_state.json, a pickle needing a class outside the allowlist.
        IntegrityError: a file unlike a torch.save archive.
    """
    names = set(os.listdir(src))
    out = TrainerState()
    try:
        _read_files(src, names, config, weights, out)
    except BaseException:
        for fd in out.fds:
            os.close(fd)
        raise
    return out


def _read_files(src: str, names: set[str], config: Mapping[str, Any], weights: Mapping[str, tuple[int, ...]],
                out: TrainerState) -> None:
    if STATE in names:
        path = os.path.join(src, STATE)
        try:
            state = json.loads(read_small(path, STATE_LIMIT, "the Trainer's state file"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(state, dict) or json_problems({"s": state}):
            raise ManifestError(f"{path}: not a JSON object of plain values")
        out.objects["trainer/state"], out.sources["trainer/state"] = state, STATE
        step = state.get("global_step")
        out.step = step if isinstance(step, int) and step >= 0 else 0
    if SCHEDULER in names:
        value = plain(stored_object(_archive(src, SCHEDULER, out), STATE_DICT_ALLOWED))
        if isinstance(value, dict) and not json_problems({"s": value}):
            out.scheduler = value
        else:
            out.skipped.append(SkippedEntry(name=SCHEDULER, reason="the scheduler's state is not plain values"))
    if OPTIMIZER in names:
        _read_optimizer(src, config, weights, out)
    if ARGS in names:
        _read_args(src, out)
    out.skipped += [SkippedEntry(name=n, reason=NOT_READ[n]) for n in sorted(names & set(NOT_READ))]
    for name in sorted(n for n in names if n.startswith("rng_state") and n.endswith(".pth")):
        _read_rng(src, name, out)


def _read_rng(src: str, name: str, out: TrainerState) -> None:
    """One process's RNG states (``rng_state.pth``, ``rng_state_<rank>.pth``): torch's as uint8
    tensors of kind ``rng`` (``rng/<file>/cpu``, ``rng/<file>/cuda/<i>``), Python's and numpy's
    as values (``trainer/<file>/python``, ``trainer/<file>/numpy``: the generator's name, its key's
    624 words, its position, its Gaussian cache)."""
    archive = _archive(src, name, out)
    states = stored_object(archive, {**STATE_DICT_ALLOWED, **NUMPY_ALLOWED})
    stem = name.removesuffix(".pth")
    if not isinstance(states, dict):
        out.skipped.append(SkippedEntry(name=name, reason="not a dict of RNG states"))
        return
    for key, value in states.items():
        where = f"{name}:{key}"
        tensors = {"": value} if isinstance(value, StoredTensor) else \
            {f"/{i}": v for i, v in enumerate(value)} if isinstance(value, list) and all(isinstance(v, StoredTensor) for v in value) \
            else None
        if tensors is not None:
            for suffix, stored in tensors.items():
                spec = TensorSpec(name=f"rng/{stem}/{escape(str(key))}{suffix}", source=where + suffix.replace("/", "."),
                                  dtype=stored.dtype, shape=tuple(stored.shape), kind="rng")
                out.tensors.append((spec, _reader(archive, stored)))
            continue
        if isinstance(value, tuple) and value and isinstance(value[0], str) and len(value) > 1 and isinstance(value[1], NumpyArray):
            words = value[1].values()
            value = None if words is None else [value[0], words, *value[2:]]
        converted = plain(value)
        if value is None or json_problems({"v": converted}):
            out.skipped.append(SkippedEntry(name=where, reason="an RNG state that is neither a tensor nor plain values"))
            continue
        out.objects[f"trainer/{stem}/{escape(str(key))}"], out.sources[f"trainer/{stem}/{escape(str(key))}"] = converted, where


def _read_args(src: str, out: TrainerState) -> None:
    """``training_args.bin`` (the pickled ``TrainingArguments``) as the value ``trainer/training_args``:
    its fields as JSON, enums and devices as their values; a pickle naming another class is
    skipped, naming it."""
    try:
        args = stored_object(_archive(src, ARGS, out), ARGS_ALLOWED)
    except ManifestError as exc:
        message = str(exc)
        out.skipped.append(SkippedEntry(name=ARGS, reason=message[message.find("refused"):] if "refused" in message else message))
        return
    value = plain(_values(args))
    if not isinstance(value, dict) or json_problems({"v": value}):
        out.skipped.append(SkippedEntry(name=ARGS, reason="TrainingArguments whose fields are not plain values"))
        return
    out.objects["trainer/training_args"], out.sources["trainer/training_args"] = value, ARGS


def _values(value: Any) -> Any:
    """`value` with each enum member or device as its value."""
    if isinstance(value, _Value):
        return value.args[0] if len(value.args) == 1 else list(value.args)
    if isinstance(value, Record):
        return _values(value.state if value.state is not None else list(value.args))
    if isinstance(value, dict):
        return {k: _values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_values(v) for v in value]
    return value


def _archive(src: str, name: str, out: TrainerState) -> Archive:
    path = os.path.join(src, name)
    fd, size = open_regular(path)
    out.fds.append(fd)
    return open_archive(fd, 0, size, path)


def _read_optimizer(src: str, config: Mapping[str, Any], weights: Mapping[str, tuple[int, ...]], out: TrainerState) -> None:
    """The optimizer's moments and groups under the parameters' names, or a skip saying why not."""
    archive = _archive(src, OPTIMIZER, out)
    sd = stored_object(archive, STATE_DICT_ALLOWED)
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    state = sd.get("state") if isinstance(sd, dict) else None
    if not isinstance(groups, list) or not isinstance(state, dict) or not all(isinstance(g, dict) for g in groups):
        raise IntegrityError(f"{archive.where}: not a torch optimizer's state dict (state, param_groups)")

    def skip(reason: str) -> None:
        out.skipped.append(SkippedEntry(name=OPTIMIZER, reason=reason))

    if any(set(s) != {"step", *MOMENTS} for s in state.values() if isinstance(s, dict)):
        return skip("not an AdamW state (each parameter's step, exp_avg and exp_avg_sq)")
    named = trainer_groups(config)
    if isinstance(named, str):
        return skip(named)
    if [len(g.get("params", [])) for g in groups] != [len(n) for n in named]:
        return skip(f"its groups hold {[len(g.get('params', [])) for g in groups]} parameters, the Trainer's of this model "
                    f"{[len(n) for n in named]}")
    index = {i: name for g, names in zip(groups, named) for i, name in zip(g["params"], names)}
    odd = sorted(n for n in index.values() if n not in weights)
    if odd:
        return skip(f"its parameters are not the weight files' tensors ({', '.join(odd[:5])}): not read yet")
    steps = set()
    for i, name in index.items():
        entry = state.get(i)
        if entry is None:  # a parameter no step has touched yet: no state, as torch keeps it
            continue
        for moment in MOMENTS:
            stored = entry[moment]
            if not isinstance(stored, StoredTensor) or tuple(stored.shape) != tuple(weights[name]):
                return skip(f"state {i}'s {moment} is not a tensor of {name}'s shape {list(weights[name])}")
        steps.add(_scalar(archive, entry["step"]))
        for moment in MOMENTS:
            spec = TensorSpec(name=f"optimizer/{moment}/{escape(name)}", source=f"{OPTIMIZER}:state.{i}.{moment}",
                              dtype=entry[moment].dtype, shape=tuple(entry[moment].shape), kind="optimizer")
            out.tensors.append((spec, _reader(archive, entry[moment])))
    options = [{k: v for k, v in plain(g).items() if k != "params"} for g in groups]
    if len(steps) > 1 or json_problems({"o": options}):
        return skip("its parameters' steps differ, or its options are not plain values")
    first = options[0]
    out.optimizer = OptimizerInfo(
        type="adamw", step=int(steps.pop()) if steps else 0,
        hyperparameters={"lr": first.get("initial_lr", first.get("lr")), "betas": first.get("betas"), "eps": first.get("eps"),
                         "weight_decay": first.get("weight_decay")},
        param_groups=tuple(ParamGroup(params=tuple(names), options=o) for names, o in zip(named, options)))


def trainer_groups(config: Mapping[str, Any]) -> list[list[str]] | str:
    """The parameter names of each optimizer group ``Trainer`` makes for the model of `config`
    (decayed, then not), in the model's order; or why they cannot be said."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, Trainer
    except ImportError:
        return "transformers is not installed, and the parameters' order is its model's (pip install transformers)"
    values = {k: v for k, v in config.items() if k != "model_type"}
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(str(config.get("model_type")), **values))  # type: ignore[no-untyped-call]
    except Exception as exc:  # transformers' own refusal of the config, whatever its class
        return f"transformers cannot build the model of config.json ({type(exc).__name__}: {exc})"
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # uses no Trainer state
    params = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in params if n in decay], [n for n in params if n not in decay]]


def _scalar(archive: Archive, stored: Any) -> float:
    if not isinstance(stored, StoredTensor) or stored.shape != () or stored.dtype not in ("float32", "float64", "int64"):
        raise IntegrityError(f"{archive.where}: a step that is not a scalar tensor")
    dest = np.empty((itemsize(stored.dtype),), np.uint8)
    copy_tensor(archive, stored, dest)
    return float(dest.view({"float32": np.float32, "float64": np.float64, "int64": np.int64}[stored.dtype])[0])


def _reader(archive: Archive, stored: StoredTensor) -> Callable[[], memoryview]:
    def read() -> memoryview:
        dest = np.empty((*stored.shape, itemsize(stored.dtype)), np.uint8)
        copy_tensor(archive, stored, dest)
        return memoryview(dest.reshape(-1))  # type: ignore[arg-type]
    return read


__all__ = ["TrainerState", "is_trainer_folder", "read_trainer", "trainer_groups"]
