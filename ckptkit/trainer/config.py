"""Model and run configuration of the reference trainer, with named model sizes."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from .. import LayoutError, Topology
from ..layouts import Layout, reference_llama, reference_llama_moe, topology_problems


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only Llama-architecture transformer; with ``num_experts``, a mixture of
    experts (Mixtral's structure: each layer's MLP is a router and that many SwiGLU experts of
    ``intermediate_size``, ``top_k`` of them per token, with an auxiliary load-balancing loss)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_seq_len: int = 256
    num_experts: int = 0  # 0: a dense MLP
    top_k: int = 2
    aux_loss_coef: float = 0.01

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def family(self) -> str:
        return "llama-moe" if self.num_experts else "llama"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.num_experts:  # a dense model's config is what it always was
            del out["num_experts"], out["top_k"], out["aux_loss_coef"]
        return out

    def layout(self) -> Layout:
        """The model's layout: the library's built-in reference Llama (or its mixture of experts)."""
        return (reference_llama_moe if self.num_experts else reference_llama)(self.to_json())


# Named sizes: tiny for tests (0.16M parameters), small (6M), base (0.49B) for benchmarks; the
# mixtures of experts tiny-moe (0.24M, 8 experts of which 2 per token) and small-moe (19M).
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8, num_kv_heads=4),
    "small": dict(hidden_size=256, intermediate_size=704, num_layers=8, num_heads=8, num_kv_heads=4),
    "base": dict(hidden_size=1536, intermediate_size=3072, num_layers=24, num_heads=24, num_kv_heads=8),
    "tiny-moe": dict(hidden_size=64, intermediate_size=64, num_layers=2, num_heads=8, num_kv_heads=4, num_experts=8, top_k=2),
    "small-moe": dict(hidden_size=256, intermediate_size=352, num_layers=8, num_heads=8, num_kv_heads=4, num_experts=8,
                      top_k=2),
}


@dataclass(frozen=True)
class TrainConfig:
    """One training run: topology, schedule, data, checkpointing."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1  # context parallelism: each CP rank holds a slice of every sequence
    ep: int = 1  # expert parallelism, carved out of dp (a mixture of experts only)
    zero: int = 0
    device: str = "cpu"  # or cuda: NCCL, one GPU per rank
    precision: str = "fp32"  # or bf16 / fp16: compute in that dtype on fp32 master weights (fp16 with a loss scaler)
    loss_scale: float = 2.0**16  # fp16: the loss scaler's first scale
    loss_scale_window: int = 2000  # fp16: steps without overflow before the scale doubles
    steps: int = 10
    save_every: int = 0
    out: str = "runs/train"
    resume: str | None = None
    resume_if_present: bool = False  # --resume latest with nothing to resume starts a new run (from init_from if given)
    init_from: str | None = None  # a checkpoint whose parameters a new run starts from (all else fresh, step 0)
    model: str | None = "tiny"  # None: the model of init_from
    seed: int = 1234
    seq_len: int = 32
    global_batch: int = 8
    micro_batches: int = 2
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 5
    total_steps: int = 300
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    corpus: str | None = None
    log_jsonl: str | None = None
    tie_embeddings: bool = False
    sync_save: bool = False
    incremental: bool = False  # saves write only the boxes that changed since the previous save
    memory_dir: str | None = None  # a memory tier: snapshots in node-local shared memory under this folder
    memory_every: int = 0  # a memory snapshot every K steps (0: none)
    memory_keep: int = 2  # snapshots each node keeps
    memory_replicas: int = 1  # other nodes holding a copy of each rank's files
    ranks_per_node: int = 0  # simulated nodes: rank r on node r // N (0: $CKPTKIT_NODE, else the host)
    freeze_layers: int = 0  # the embedding and the first N layers are not trained (a fine-tune of the top)
    echo: bool = False
    phases: bool = False  # say what the start-up is doing (on a terminal)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def topology(self, zero: int | None = None) -> Topology:
        """The topology the run trains at (the manifest's record of it), at ZeRO stage `zero`
        (default: the run's)."""
        return Topology(world_size=self.world_size, tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, ep=self.ep,
                        zero_stage=self.zero if zero is None else zero)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["betas"] = list(self.betas)
        del out["echo"], out["phases"], out["sync_save"], out["incremental"]  # how the run reports and saves, not what it trains
        for key in ("memory_dir", "memory_every", "memory_keep", "memory_replicas", "ranks_per_node"):
            del out[key]
        if out["freeze_layers"] == 0:  # a run without it records what it always did
            del out["freeze_layers"]
        for axis in ("cp", "ep"):
            if out[axis] == 1:  # a run without them records what it always did
                del out[axis]
        if out["precision"] != "fp16":
            del out["loss_scale"], out["loss_scale_window"]
        if out["precision"] == "fp32":
            del out["precision"]
        del out["device"]  # where it runs, not what it trains
        return out


def model_config(name: str, *, vocab_size: int, tie_embeddings: bool = False) -> ModelConfig:
    """Return the named model size with the tokenizer's vocabulary size."""
    if name not in MODELS:
        raise LayoutError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")
    return ModelConfig(vocab_size=vocab_size, tie_embeddings=tie_embeddings, **MODELS[name])


def device_problems(cfg: TrainConfig) -> list[str]:
    """Why the run cannot compute where and how it asks (empty when it can)."""
    import torch

    problems = []
    if cfg.precision not in ("fp32", "bf16", "fp16"):
        problems.append(f"precision {cfg.precision!r} is not one of fp32, bf16, fp16")
    if cfg.device not in ("cpu", "cuda"):
        problems.append(f"device {cfg.device!r} is not one of cpu, cuda")
    elif cfg.device == "cuda":
        if not torch.cuda.is_available():
            problems.append("--device cuda, but CUDA is not available here")
        else:  # ranks on this machine: all of them, or under torchrun its LOCAL_WORLD_SIZE
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) if "RANK" in os.environ else cfg.world_size
            if local > torch.cuda.device_count():
                problems.append(f"--device cuda runs one rank per GPU (NCCL): {local} ranks on this machine, "
                                f"{torch.cuda.device_count()} GPU(s) here")
    return problems


def check_topology(cfg: TrainConfig, model: ModelConfig, *, max_world: int | None = None) -> None:
    """Raise LayoutError with every reason the topology cannot run this model; nothing when it can."""
    problems = [] if cfg.zero in (0, 1, 2, 3) else [f"zero stage {cfg.zero} is not one of 0, 1, 2, 3"]
    problems += device_problems(cfg)
    if min(cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep) < 1:
        problems.append("tp, pp, dp, cp and ep must be at least 1")
    else:
        topology = cfg.topology(zero=min(max(cfg.zero, 0), 3))
        problems += topology_problems(model.layout(), topology)
        if cfg.seq_len % cfg.cp:
            problems.append(f"sequence length {cfg.seq_len} is not divisible by cp {cfg.cp}")
        if model.num_experts and model.top_k > model.num_experts:
            problems.append(f"top-{model.top_k} routing needs at least {model.top_k} experts, the model has {model.num_experts}")
    if cfg.dp >= 1 and cfg.micro_batches >= 1 and cfg.global_batch % (cfg.dp * cfg.micro_batches):
        problems.append(
            f"global batch {cfg.global_batch} is not divisible by dp {cfg.dp} x micro-batches {cfg.micro_batches}"
        )
    if max_world is not None and cfg.world_size > max_world:
        problems.append(f"world size {cfg.world_size} is more than this machine runs ({max_world} ranks)")
    if cfg.freeze_layers > model.num_layers:
        problems.append(f"--freeze-layers {cfg.freeze_layers} is more than the model's {model.num_layers} layers")
    if cfg.seq_len > model.max_seq_len:
        problems.append(f"sequence length {cfg.seq_len} exceeds the model's {model.max_seq_len}")
    if problems:
        raise LayoutError("; ".join(problems))
