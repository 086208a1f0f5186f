"""Where a training run starts: a new run, or a resume, decided before any process starts.

`plan_start` refuses the mistakes that would lose work: a new run into a root holding another
run's checkpoints, a ``--resume`` with nothing to resume, a resume past ``--steps``, a resume
whose run would save a step that is already committed. It returns the `Start` every rank
follows (with the model it builds) and the run record the root keeps; `resume_banner` is the one
line a resume prints. A new run with ``init_from`` starts at step 0 from that checkpoint's
parameters alone (`init_from.source_model` says which model that is).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ckptkit
from .. import CheckpointExistsError, CheckpointNotFoundError, Manifest, RunError, RunRecord, Topology, read_run
from .config import ModelConfig, TrainConfig, model_config
from .data import Tokenizer
from .init_from import describe, parent, recorded_model, source_model

NAME_FORMAT = "step_{step:08d}"


@dataclass(frozen=True)
class Start:
    """How the run starts: from `resume` (a committed checkpoint) at `step`, or new (step 0),
    with the parameters of `init_from` when given. `model` is the model every rank builds;
    `parent` the lineage its checkpoints record (``info.config.parent``: a weights-only start's
    source, carried over resumes)."""

    run: RunRecord
    resume: str | None = None
    step: int = 0
    banner: str = ""
    model: ModelConfig | None = None
    init_from: str | None = None
    parent: dict[str, Any] | None = None


def plan_start(cfg: TrainConfig) -> Start:
    """Decide where the run of `cfg` starts; nothing is written.

    Raises:
        CheckpointExistsError: a new run into a root holding checkpoints (of another run), or a
            resume that would save a step already committed there.
        CheckpointNotFoundError: ``--resume`` names a path that holds no checkpoint.
        RunError: ``--resume latest`` with nothing to resume (unless ``resume_if_present``; with a
            memory tier the ranks decide, as they restore), or
            the checkpoint is past ``--steps``, or of another model size; ``init_from`` holds
            no model the trainer builds, or not the one asked for.
    """
    root = ckptkit.open_storage(cfg.out)
    committed = _committed(cfg.out)
    path = _resume_path(cfg)
    if path is None:
        if committed and not cfg.resume:
            raise CheckpointExistsError(_refusal(cfg.out, committed, _record(root)))
        if committed:
            name = max(committed, key=lambda c: (c[1], c[0]))[0]
            raise CheckpointExistsError(f"{cfg.out} holds {len(committed)} checkpoint(s) but no latest pointer; "
                                        f"resume one by its path (--resume {os.path.join(cfg.out, name)}) or choose another --out")
        if cfg.resume and not cfg.resume_if_present and not (cfg.memory_dir and cfg.resume == "latest"):
            raise RunError(
                f"{cfg.out}: no checkpoint to resume (--resume latest, and no latest there); "
                "drop --resume to start a new run, or add --resume-if-present")
        if cfg.init_from:
            return _init_start(cfg)
        model = _named(cfg)
        return Start(RunRecord.start(model=_model(cfg), topology=_topology(cfg)), model=model)
    manifest = ckptkit.read_manifest(path)
    _check_resumable(cfg, path, manifest, committed)
    own = _record(root) if _under(path, cfg.out) else None
    run = own or RunRecord.start(model=_model(cfg), topology=_topology(cfg), parent=None if _under(path, cfg.out) else path)
    lineage = (manifest.info.config or {}).get("parent")
    return Start(run, path, manifest.step, resume_banner(cfg, path, manifest), model=_resumed_model(cfg, manifest),
                 parent=lineage if isinstance(lineage, dict) else None)


def _init_start(cfg: TrainConfig) -> Start:
    """A new run from the parameters of ``cfg.init_from``: its model, at step 0."""
    assert cfg.init_from is not None
    checkpoint = ckptkit.open(cfg.init_from)
    where, manifest = str(checkpoint.location), checkpoint.manifest
    model = source_model(cfg, manifest, where, min_vocab=Tokenizer().vocab_size)
    lineage = parent(where, manifest)
    run = RunRecord.start(model=f"llama {cfg.model or 'from ' + str(lineage['family'])}", topology=_topology(cfg), parent=where)
    banner = (f"starting from the weights of {where} (step {manifest.step}, {lineage['family']}: {describe(model)}) "
              f"at {_topology(cfg).describe()}; new optimizer, schedule, sampler and RNG; training steps 1-{cfg.steps}")
    return Start(run, step=0, banner=banner, model=model, init_from=where, parent=lineage)


def _named(cfg: TrainConfig) -> ModelConfig:
    """The model size `cfg` names, with the tokenizer's vocabulary."""
    return model_config(cfg.model or "tiny", vocab_size=Tokenizer().vocab_size, tie_embeddings=cfg.tie_embeddings)


def _resumed_model(cfg: TrainConfig, manifest: Manifest) -> ModelConfig:
    """The model a resume builds: the one the checkpoint records (the trainer's own), else the named size."""
    info = manifest.info.model
    recorded = recorded_model(info.config) if info is not None and info.family in ("llama", "llama-moe") else None
    return recorded or _named(cfg)


def resume_banner(cfg: TrainConfig, path: str, manifest: Manifest) -> str:
    """The one line a resume prints: from which checkpoint and step, source and target topology,
    what was resharded, whether the RNG streams are restored or derived."""
    source, target = manifest.topology, _topology(cfg)
    if source.model_copy(update={"rank_order": target.rank_order}) == target:
        moved = "same topology, nothing resharded"
    else:
        moved = "parameters and optimizer state resharded at load"
    rng = "RNG restored" if same_rng_topology(manifest, cfg) else "RNG derived from the saved streams (other ranks)"
    return (f"resuming from {path} (step {manifest.step}): saved at {source.describe()}, now {target.describe()}; "
            f"{moved}; {rng}; training steps {manifest.step + 1}-{cfg.steps}")


def same_rng_topology(manifest: Manifest, cfg: TrainConfig) -> bool:
    """Whether the saved RNG rows belong to ranks of the topology `cfg` trains at (ZeRO aside)."""
    saved = (manifest.info.rng or {}).get("topology")
    if saved is None:
        saved = rng_topology(manifest.topology.tp, manifest.topology.pp, manifest.topology.dp, manifest.topology.cp)
    return bool(saved == rng_topology(cfg.tp, cfg.pp, cfg.dp, cfg.cp))


def rng_topology(tp: int, pp: int, dp: int, cp: int = 1) -> dict[str, Any]:
    """The topology whose ranks the saved RNG rows belong to (ZeRO and EP, which do not change
    which rank is which, do not change the streams)."""
    out = {"world_size": tp * pp * dp * cp, "tp": tp, "pp": pp, "dp": dp}
    return out if cp == 1 else {**out, "cp": cp}


def _resume_path(cfg: TrainConfig) -> str | None:
    """The checkpoint to resume from: a path, or ``latest`` under ``--out`` (None if none yet)."""
    if not cfg.resume:
        return None
    if cfg.resume == "latest":
        try:
            if not ckptkit.list_checkpoints(cfg.out).latest:
                return None
        except CheckpointNotFoundError:  # no root yet (a local directory or an object store prefix)
            return None
        return str(ckptkit.open(cfg.out).location)
    return str(ckptkit.open(cfg.resume).location)


def _committed(out: str) -> list[tuple[str, int]]:
    """The committed checkpoints under the root `out` (name, step), oldest first."""
    try:
        listing = ckptkit.list_checkpoints(out)
    except CheckpointNotFoundError:
        return []
    return [(c.name, c.step) for c in listing.checkpoints if c.step is not None]


def _check_resumable(cfg: TrainConfig, path: str, manifest: Manifest, committed: list[tuple[str, int]]) -> None:
    if manifest.step > cfg.steps:
        raise RunError(f"{path} is at step {manifest.step}, past --steps {cfg.steps}: nothing to train; "
                       f"give --steps above {manifest.step}")
    saved = (manifest.info.config or {}).get("model")
    if isinstance(saved, str) and cfg.model is not None and saved != cfg.model:
        raise RunError(f"{path} was saved by a run of --model {saved}, not --model {cfg.model}; resume it with --model {saved}")
    names = {name for name, _ in committed}
    clash = [NAME_FORMAT.format(step=s) for s in save_steps(cfg, manifest.step) if NAME_FORMAT.format(step=s) in names]
    if clash:
        raise CheckpointExistsError(
            f"{os.path.join(cfg.out, clash[0])} is already committed, and resuming from step {manifest.step} would save it "
            f"again; resume from a later step (--resume latest) or choose another --out")


def save_steps(cfg: TrainConfig, start: int) -> list[int]:
    """The steps a run from `start` saves: every ``save_every``-th and the last."""
    if not cfg.save_every:
        return []
    return [s for s in range(start + 1, cfg.steps + 1) if s % cfg.save_every == 0 or s == cfg.steps]


def _refusal(out: str, committed: list[tuple[str, int]], record: RunRecord | None) -> str:
    name, step = max(committed, key=lambda c: (c[1], c[0]))
    whose = f"of {record.describe()}" if record is not None else "of another run"
    return (f"{out} already holds {len(committed)} checkpoint(s) {whose}, the newest {name} (step {step}); "
            f"continue that run with --resume latest, or start a new run with another --out")


def _record(root: ckptkit.Storage) -> RunRecord | None:
    try:
        return read_run(root)
    except ckptkit.CkptkitError:
        return None


def _under(path: str, out: str) -> bool:
    """Whether checkpoint `path` lies directly under the root `out`."""
    parent = path.rstrip("/").rsplit("/", 1)[0]
    if "://" in out or "://" in path:
        return parent == out.rstrip("/")
    return os.path.realpath(parent) == os.path.realpath(out)


def _model(cfg: TrainConfig) -> str:
    return f"llama {cfg.model}" if cfg.model else "llama (the checkpoint's model)"


def _topology(cfg: TrainConfig) -> Topology:
    return cfg.topology()
