"""Export to a Hugging Face ``Trainer`` checkpoint folder, which ``Trainer.train(resume_from_checkpoint=DIR)``
resumes from: the model directory the ``hf`` format writes (the weights in their saved dtype), and
what `ckptkit_adapters.hf.trainer` read of a Trainer folder written back as Trainer writes it:

- ``optimizer.pt``: torch's optimizer state dict, each parameter's ``step``, ``exp_avg`` and
  ``exp_avg_sq`` under the index its place in the groups of ``info.optimizer`` gives (as torch
  numbers them), the groups' options and their indices;
- ``scheduler.pt``: the scheduler's state dict (``info.scheduler``);
- ``trainer_state.json``: the value ``trainer/state``;
- ``rng_state.pth`` (and each ``rng_state_<rank>.pth``): the RNG states, Python's and numpy's as
  the ``random`` and ``numpy`` modules take them, torch's as their tensors.

The source must be a checkpoint converted from a Trainer folder (its state, optimizer groups by
name and scheduler recorded); planned before anything is written.
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptkit.errors import LayoutError, summarize
from ckptkit.exports.source import ExportedFile, Source, Writer, Written, exported
from ckptkit.io.checksum import checksum_of
from ckptkit.state.torch_io import byte_view, torch_dtype
from ckptkit.state.tree import escape
from ckptkit.storage import Storage
from ckptkit_adapters.hf.trainer import MOMENTS, OPTIMIZER, SCHEDULER, STATE
from ckptkit_adapters.hf.writer import hf_writer


@dataclass(frozen=True)
class TrainerPlan:
    """The optimizer's parameters by index (their names), its groups, the step, the scheduler,
    the trainer state, the RNG files' states (values and tensors by key)."""

    params: list[str]
    groups: list[dict[str, Any]]  # each group's options, its "params" the indices
    step: float
    scheduler: dict[str, Any]
    state: dict[str, Any]
    rng_values: dict[str, dict[str, Any]]  # file stem -> key -> value
    rng_tensors: dict[str, dict[str, str]]  # file stem -> key (cuda/0 as such) -> the tensor's fqn


def trainer_folder_writer(source: Source, max_shard_bytes: int) -> Writer:
    """Plan the Trainer folder (failing before any write) and return its writer.

    Raises:
        LayoutError: a checkpoint that does not hold what a Trainer folder needs (every finding listed).
    """
    plan = plan_trainer(source)
    weights = hf_writer(source, None, max_shard_bytes)

    def write(source: Source, dst: Storage, tmp: str) -> Written:
        written = weights.write(source, dst, tmp)
        tensors, files = list(written.tensors), list(written.files)

        def save(path: str, data: bytes) -> None:
            dst.write(f"{tmp}/{path}", [data])
            files.append(ExportedFile(path=path, size=len(data), checksum=checksum_of(data)))

        def read(fqn: str, name: str, path: str) -> torch.Tensor:
            entry = source.manifest.tensors[fqn]
            tensor = torch.from_numpy(source.read(fqn)).view(torch_dtype(entry.dtype)).reshape(entry.shape)
            tensors.append(exported(source, name, fqn, byte_view(tensor), entry.dtype, path))
            return tensor

        state = {i: {"step": torch.tensor(plan.step, dtype=torch.float32),
                     **{m: read(f"optimizer/{m}/{escape(name)}", f"state.{i}.{m}", OPTIMIZER) for m in MOMENTS}}
                 for i, name in enumerate(plan.params)}
        save(OPTIMIZER, _torch_bytes({"state": state, "param_groups": plan.groups}))
        save(SCHEDULER, _torch_bytes(plan.scheduler))
        save(STATE, (json.dumps(plan.state, indent=2, sort_keys=True) + "\n").encode())
        for stem in sorted({*plan.rng_values, *plan.rng_tensors}):
            rng: dict[str, Any] = _rng_values(plan.rng_values.get(stem, {}))
            for key, fqn in sorted(plan.rng_tensors.get(stem, {}).items()):
                head, _, index = key.partition("/")
                tensor = read(fqn, f"{stem}.{key}", f"{stem}.pth")
                if index:
                    rng.setdefault(head, []).append(tensor)
                else:
                    rng[head] = tensor
            save(f"{stem}.pth", _torch_bytes(rng))
        return Written(tensors, files)

    used = ({f"optimizer/{m}/{escape(name)}" for name in plan.params for m in MOMENTS}
            | {fqn for keys in plan.rng_tensors.values() for fqn in keys.values()})
    carried = {"trainer/state"} | {f"trainer/{stem}/{key}" for stem, keys in plan.rng_values.items() for key in keys}
    return Writer([fqn for fqn in weights.skipped if fqn not in used], write, weights.values | carried)


def plan_trainer(source: Source) -> TrainerPlan:
    """What the Trainer folder holds beyond the model (pure but for the manifest).

    Raises:
        LayoutError: see `trainer_folder_writer`.
    """
    manifest, where = source.manifest, str(source.loc)
    objects: dict[str, Any] = manifest.objects
    optimizer, problems = manifest.info.optimizer, []
    state = objects.get("trainer/state")
    if not isinstance(state, dict):
        problems.append("no Trainer state (trainer/state, from trainer_state.json)")
    if manifest.info.scheduler is None:
        problems.append("no scheduler state (info.scheduler, from scheduler.pt)")
    if optimizer is None or optimizer.type != "adamw" or not optimizer.param_groups:
        problems.append("no AdamW with its parameter groups by name (info.optimizer, from optimizer.pt)")
    if problems:
        raise LayoutError(f"{where}: a Trainer folder is written from a checkpoint converted from one, and this one has "
                          + summarize(problems))
    assert optimizer is not None and isinstance(state, dict)
    params = [name for group in optimizer.param_groups for name in group.params]
    missing = [f"optimizer/{m}/{escape(n)}" for n in params for m in MOMENTS if f"optimizer/{m}/{escape(n)}" not in manifest.tensors]
    if missing:
        raise LayoutError(f"{where}: cannot write the Trainer's optimizer.pt: " + summarize([f"{m} is missing" for m in missing]))
    groups, start = [], 0
    for group in optimizer.param_groups:
        options = {k: tuple(v) if k == "betas" and isinstance(v, list) else v for k, v in group.options.items()}
        groups.append({**options, "params": list(range(start, start + len(group.params)))})
        start += len(group.params)
    rng_values: dict[str, dict[str, Any]] = defaultdict(dict)
    for name, value in objects.items():
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "trainer" and parts[1].startswith("rng_state"):
            rng_values[parts[1]][parts[2]] = value
    rng_tensors: dict[str, dict[str, str]] = defaultdict(dict)
    for fqn, entry in manifest.tensors.items():
        parts = fqn.split("/")
        if entry.kind == "rng" and len(parts) >= 3 and parts[0] == "rng" and parts[1].startswith("rng_state"):
            rng_tensors[parts[1]]["/".join(parts[2:])] = fqn
    return TrainerPlan(params=params, groups=groups, step=float(optimizer.step or 0), scheduler=dict(manifest.info.scheduler or {}),
                       state=state, rng_values=dict(rng_values), rng_tensors=dict(rng_tensors))


def _rng_values(values: dict[str, Any]) -> dict[str, Any]:
    """Python's and numpy's states as ``random.setstate`` and ``numpy.random.set_state`` take them."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "python" and isinstance(value, list) and len(value) == 3:
            out[key] = (value[0], tuple(value[1]), value[2])
        elif key == "numpy" and isinstance(value, list) and len(value) == 5:
            out[key] = (value[0], np.array(value[1], dtype=np.uint32), *value[2:])
        else:
            out[key] = value
    return out


def _torch_bytes(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


__all__ = ["TrainerPlan", "plan_trainer", "trainer_folder_writer"]
