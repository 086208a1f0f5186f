"""The training loop of one rank, checkpointing through ckptkit, and starting the ranks.

Call order for a run: ``prepare`` (decides where the run starts and with which model,
``start.plan_start``, and checks the topology, before any process starts), then ``launch`` with
what it returned (spawns the ranks on this machine, or runs as one rank under torchrun), whose
ranks run ``run_rank``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
import threading
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

import ckptkit
from .. import (
    CheckpointInfo,
    CheckpointManager,
    CheckpointNotFoundError,
    DataProgress,
    DataVersion,
    LayoutError,
    Manifest,
    MemoryTier,
    ModelInfo,
    OptimizerInfo,
    ParamGroup,
    RestoreReport,
    RunError,
    SaveHandle,
    Topology,
    code_version,
)
from .checkpointing import derived_seed, restore_rng, rng_state, rng_targets, seed_rngs, tensor_state
from .config import ModelConfig, TrainConfig, check_topology, model_config
from .data import Dataset, Sampler, Tokenizer, load_dataset
from .engine import Engine
from .precision import LossScaler
from .start import Start, plan_start, rng_topology, same_rng_topology
from .mesh import Mesh, build_groups


def max_world() -> int:
    """The most ranks ``ckptkit train`` starts on this machine (tiny ranks share cores)."""
    return max(8, 4 * (os.cpu_count() or 1))


def prepare(cfg: TrainConfig) -> Start:
    """Check the whole run and decide where it starts, before any process starts.

    Raises:
        LayoutError: the topology cannot run the model.
        CheckpointExistsError, CheckpointNotFoundError, RunError: see `start.plan_start`.
    """
    if cfg.init_from is None:  # the named model's topology problems come first, before any checkpoint is read
        model = model_config(cfg.model or "tiny", vocab_size=Tokenizer().vocab_size, tie_embeddings=cfg.tie_embeddings)
        check_topology(cfg, model, max_world=max_world() if "RANK" not in os.environ else None)
    start = plan_start(cfg)
    assert start.model is not None
    check_topology(cfg, start.model, max_world=max_world() if "RANK" not in os.environ else None)
    return start


def launch(cfg: TrainConfig, start: Start | None = None) -> None:
    """Start the ranks: under torchrun (RANK set) run as this rank, else spawn them here.

    `start` is what `prepare` returned (default: decided here). On the CPU the ranks talk over
    gloo; with ``--device cuda`` over NCCL, one GPU per rank (``LOCAL_RANK`` under torchrun).
    """
    start = start if start is not None else plan_start(cfg)
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
        try:
            if dist.get_world_size() != cfg.world_size:
                raise LayoutError(
                    f"torchrun started {dist.get_world_size()} ranks but tp x pp x cp x dp = {cfg.world_size}"
                )
            torch.set_num_threads(1)
            run_rank(dist.get_rank(), dist.get_world_size(), cfg, start)
        finally:
            dist.destroy_process_group()
        return
    from .launch import run_ranks

    if cfg.world_size == 1:
        _single(cfg, start, backend)
    else:
        run_ranks(run_rank, cfg.world_size, cfg, start, backend=backend)


def _single(cfg: TrainConfig, start: Start, backend: str) -> None:
    from .launch import free_port

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.set_num_threads(1)
        run_rank(0, 1, cfg, start)
    finally:
        dist.destroy_process_group()


def run_rank(rank: int, world: int, cfg: TrainConfig, plan: Start | None = None) -> None:
    """Train on this rank from the start or a checkpoint up to global step ``cfg.steps``."""
    plan = plan if plan is not None else plan_start(cfg)
    if cfg.device == "cuda":  # before the first collective: NCCL binds each rank to its GPU
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    say = _phase if cfg.phases and rank == 0 else (lambda text: None)
    mesh = Mesh(cfg.tp, cfg.dp, cfg.pp, rank, cfg.cp, cfg.ep)
    tokenizer = Tokenizer()
    model = plan.model or model_config(cfg.model or "tiny", vocab_size=tokenizer.vocab_size, tie_embeddings=cfg.tie_embeddings)
    say("preparing the data")
    dataset, dataset_id = load_dataset(cfg.corpus, tokenizer, cfg.seq_len, seed=cfg.seed)
    seed_rngs(cfg.seed * 1_000_003 + rank)  # distinct streams per rank from the start
    size = cfg.model or "checkpoint's"
    say(f"building the {size} model on {world} rank(s)")
    engine = Engine(cfg, model, mesh, build_groups(mesh))
    sampler = Sampler(dataset.num_samples, cfg.seed)
    if plan.resume is not None:
        say(f"loading {plan.resume}")
    elif plan.init_from is not None:
        say(f"loading the weights of {plan.init_from}")
        _init_weights(plan.init_from, engine)
    log = None
    if cfg.log_jsonl and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.log_jsonl)), exist_ok=True)
        log = open(cfg.log_jsonl, "a", encoding="utf-8")
    saves: list[SaveHandle] = []
    memory = _memory_tier(cfg, rank)
    with tempfile.TemporaryDirectory() as tok_dir, CheckpointManager(
        cfg.out, sync=cfg.sync_save, run=plan.run, layout=model.layout(), incremental=cfg.incremental, memory=memory
    ) as manager:
        if memory is not None and cfg.resume == "latest":  # the newest step of memory, a peer or storage
            start, restored = _restore(manager, cfg, engine, sampler, rank, world, say)
            if log is not None and restored is not None:
                log.write(json.dumps({"event": "restore", "step": restored.step, "tiers": restored.tiers(),
                                      "skipped": restored.skipped}) + "\n")
        else:
            start = _resume(plan.resume, cfg, engine, sampler, rank, world)
        if memory is not None and threading.current_thread() is threading.main_thread():
            manager.flush_on((signal.SIGTERM,))
        say(f"training steps {start + 1}-{cfg.steps}")
        tokenizer.save(tok_dir)
        for step in range(start + 1, cfg.steps + 1):
            ids = sampler.next_ids(cfg.global_batch)
            loss, lr, norm = engine.train_step(_micro_batches(cfg, mesh, dataset, ids), cfg.global_batch * cfg.seq_len)
            sampler.advance(cfg.global_batch, cfg.global_batch * cfg.seq_len)
            if cfg.echo and rank == 0:
                print(f"step {step:>6}  loss {loss:.4f}  lr {lr:.2e}  grad norm {norm:.3f}", flush=True)
            if log is not None:
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm if math.isfinite(norm) else None,
                          "consumed_samples": sampler.consumed_samples, "consumed_tokens": sampler.consumed_tokens,
                          "sample_ids": ids}
                log.write(json.dumps(record) + "\n")
                log.flush()
            if memory is not None and cfg.memory_every and step % cfg.memory_every == 0:
                saves.append(_save(manager, cfg, plan, engine, sampler, step, rank, world, tok_dir, dataset, dataset_id, "memory"))
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                saves.append(_save(manager, cfg, plan, engine, sampler, step, rank, world, tok_dir, dataset, dataset_id))
            saves = _report_saves(saves, cfg, rank, log, final=False)
        manager.wait()
        _report_saves(saves, cfg, rank, log, final=True)
    if log is not None:
        log.close()


def _report_saves(saves: list[SaveHandle], cfg: TrainConfig, rank: int, log: Any, final: bool) -> list[SaveHandle]:
    """Log each committed save: how long it stalled training, how long it took in the background.
    Return the saves not committed yet."""
    left = []
    for handle in saves:
        if not handle.committed.done() and not final:
            left.append(handle)
            continue
        handle.committed.result()  # a failed save raises (also through the manager)
        if rank != 0:
            continue
        record = {"event": "save" if handle.tier == "storage" else "snapshot", "step": handle.step,
                  "stall_s": round(handle.stall_s, 4), "background_s": round(handle.background_s or 0.0, 4), "sync": cfg.sync_save}
        if cfg.echo:
            where = os.path.join(cfg.out, handle.name) if handle.tier == "storage" else f"{handle.name} in memory"
            print(f"saved {where}: stall {record['stall_s']:.3f} s, "
                  f"background {record['background_s']:.3f} s", flush=True)
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
    return left


def _micro_batches(cfg: TrainConfig, mesh: Mesh, dataset: Dataset, ids: list[int]) -> list[torch.Tensor]:
    """This DP rank's share of the global batch, cut into micro-batches of [mb, seq_len + 1] tokens."""
    per_rank = cfg.global_batch // cfg.dp
    mine = ids[mesh.dp_rank * per_rank : (mesh.dp_rank + 1) * per_rank]
    size = per_rank // cfg.micro_batches
    return [torch.stack([dataset.sample(i) for i in mine[m * size : (m + 1) * size]]) for m in range(cfg.micro_batches)]


def _info(cfg: TrainConfig, plan: Start, engine: Engine, sampler: Sampler, dataset: Dataset, dataset_id: str) -> CheckpointInfo:
    names = tuple(sorted(engine.model_cfg.layout().tensors()))
    return CheckpointInfo(
        optimizer=OptimizerInfo(
            type="adamw",
            hyperparameters={"lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay,
                             "grad_clip": cfg.grad_clip},
            param_groups=(ParamGroup(params=names, options={"weight_decay": "on 2-D weights only"}),),
            step=engine.optimizer.step,
        ),
        loss_scaler=engine.scaler.state() if engine.scaler is not None else None,
        scheduler={"type": "warmup-cosine", "lr": cfg.lr, "min_lr": cfg.min_lr, "warmup_steps": cfg.warmup_steps,
                   "total_steps": cfg.total_steps, "step": engine.optimizer.step},
        rng={"streams": ",".join(sorted(rng_state(0, 1))), "layout": "rng/<stream> is [world_size, state bytes], row = rank",
             "topology": rng_topology(cfg.tp, cfg.pp, cfg.dp, cfg.cp)},
        data_progress=DataProgress(seed=cfg.seed, epoch=sampler.epoch, consumed_samples=sampler.consumed_samples,
                                   consumed_tokens=sampler.consumed_tokens),
        code=code_version(os.path.dirname(os.path.abspath(__file__))),
        data=DataVersion(dataset_id=dataset_id, fingerprint=dataset.fingerprint),
        config={**cfg.to_json(), **({"parent": plan.parent} if plan.parent is not None else {})},
        model=ModelInfo(family=engine.model_cfg.family, config=engine.model_cfg.to_json()),
    )


def _save(manager: CheckpointManager, cfg: TrainConfig, plan: Start, engine: Engine, sampler: Sampler, step: int,
          rank: int, world: int, tok_dir: str, dataset: Dataset, dataset_id: str, tier: str = "storage") -> SaveHandle:
    """Start saving this rank's state as checkpoint `step` (in the background unless --sync-save),
    in storage or as a memory snapshot (`tier`)."""
    state = tensor_state(list(engine.units.values()))
    state["rng"] = rng_state(rank, world)
    topo = cfg.topology()
    return manager.save(step, state, topology=topo, info=_info(cfg, plan, engine, sampler, dataset, dataset_id), tokenizer=tok_dir,
                        tier=tier)


def _memory_tier(cfg: TrainConfig, rank: int) -> MemoryTier | None:
    """The run's memory tier (None without --memory-dir); simulated nodes with --ranks-per-node."""
    if cfg.memory_dir is None:
        return None
    node = f"node{rank // cfg.ranks_per_node}" if cfg.ranks_per_node else None
    return MemoryTier(cfg.memory_dir, node=node, keep=cfg.memory_keep, replicas=cfg.memory_replicas)


def _init_weights(path: str, engine: Engine) -> None:
    """Load this rank's boxes of the parameters of the checkpoint at `path` (any topology; a
    converted Hugging Face Llama's names mapped); optimizer, schedule, sampler and RNG stay new."""
    ckptkit.load_weights(path, tensor_state(list(engine.units.values()))["model"], layout=engine.model_cfg.layout())
    for unit in engine.units.values():
        unit.publish()


def _resume(path: str | None, cfg: TrainConfig, engine: Engine, sampler: Sampler, rank: int, world: int) -> int:
    """Load the checkpoint at `path` into this rank's buffers; return its step (0 when none)."""
    if path is None:
        return 0
    checkpoint = ckptkit.open(path)  # one manifest read for the metadata and the tensors
    target = _target(checkpoint.manifest, cfg, engine, rank, world)
    checkpoint.load(target)
    return _resumed(checkpoint.manifest, target, cfg, engine, sampler, rank, world)


def _restore(manager: CheckpointManager, cfg: TrainConfig, engine: Engine, sampler: Sampler, rank: int, world: int,
             say: Any) -> tuple[int, RestoreReport | None]:
    """Restore the newest step of the memory tier or storage (collective); its step and report
    (0 and None when there is none)."""
    try:
        state, report = manager.restore(lambda manifest: _target(manifest, cfg, engine, rank, world))
    except ckptkit.CheckpointNotFoundError:
        if not cfg.resume_if_present:
            raise RunError(f"nothing to resume in the memory tier {cfg.memory_dir} or in {cfg.out} (--resume latest); "
                           "drop --resume to start a new run, or add --resume-if-present") from None
        say("nothing to restore in memory or storage: starting a new run")
        return 0, None
    say(f"restored step {report.step} ({', '.join(f'{n} file(s) from {t}' for t, n in sorted(report.tiers().items()))})")
    if report.skipped and rank == 0:
        print(f"ckptkit: train: restore skipped: {'; '.join(report.skipped)}", file=sys.stderr, flush=True)
    assert report.manifest is not None
    return _resumed(report.manifest, state, cfg, engine, sampler, rank, world), report


def _target(manifest: Manifest, cfg: TrainConfig, engine: Engine, rank: int, world: int) -> dict[str, Any]:
    """This rank's buffers to load checkpoint `manifest` into, its RNG streams as it needs them."""
    target = tensor_state(list(engine.units.values()))
    # The RNG rows belong to the ranks that saved them, which a reshard does not change.
    if same_rng_topology(manifest, cfg):  # the streams both have (a GPU's is not in a CPU run's checkpoint)
        target["rng"] = {k: v for k, v in rng_targets(rank, world).items() if f"rng/{k}" in manifest.tensors}
    else:  # every rank reads every saved stream and derives its own from them
        target["rng"] = {
            fqn.split("/", 1)[1]: torch.empty(t.shape, dtype=torch.uint8)
            for fqn, t in manifest.tensors.items()
            if t.kind == "rng" and fqn.startswith("rng/")
        }
    return target


def _resumed(manifest: Manifest, loaded: dict[str, Any], cfg: TrainConfig, engine: Engine, sampler: Sampler, rank: int,
             world: int) -> int:
    """Take up checkpoint `manifest`, loaded into `loaded` (`_target`'s buffers): RNG, loss scaler,
    optimizer step, data progress; return its step."""
    if same_rng_topology(manifest, cfg):
        restore_rng(loaded["rng"])
    else:
        seed_rngs(derived_seed(dict(sorted(loaded["rng"].items())), rank, world))
    info = manifest.info
    if engine.scaler is not None and info.loss_scaler is not None and info.loss_scaler.get("type") == "dynamic":
        engine.scaler = LossScaler.from_state(dict(info.loss_scaler))
    engine.optimizer.step = info.optimizer.step if info.optimizer and info.optimizer.step is not None else manifest.step
    if info.data_progress is not None:
        sampler.consumed_samples = info.data_progress.consumed_samples
        sampler.consumed_tokens = info.data_progress.consumed_tokens
    for unit in engine.units.values():
        unit.publish()
    return manifest.step


def _phase(text: str) -> None:
    """Say what the start-up is doing (rank 0, on a terminal; building a large model takes a while)."""
    print(f"ckptkit: train: {text}", file=sys.stderr, flush=True)


def config_from(**options: Any) -> TrainConfig:
    """Build a TrainConfig from CLI options, ignoring the ones left unset (with ``init_from``
    and no ``model``, the model is the checkpoint's)."""
    values = {k: v for k, v in options.items() if v is not None}
    if values.get("init_from") and options.get("model") is None:
        values["model"] = None
    return replace(TrainConfig(), **values)
