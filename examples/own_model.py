"""Your own model, saved with its layout at tp 2, resharded offline, loaded back.

A small model that is not the reference Llama: an embedding (vocabulary split over TP, padded),
blocks of norm + MLP (fc1 column-parallel with its bias, fc2 row-parallel), a classifier head
kept whole on every rank, with Adam moments beside the weights. Its layout, written once as
data, lets ``ckptkit reshard`` move the checkpoint to any topology the layout allows.

    python examples/own_model.py OUT_DIR

writes OUT_DIR/layout.json and OUT_DIR/tp2/step_00000001 (saved by 2 processes over gloo, one
per TP rank), reshards it with ``ckptkit reshard ... --tp 1`` to OUT_DIR/tp1/step_00000001,
loads that back in one process and checks every tensor against the model it started from.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptkit
from ckptkit import ShardedTensor
from ckptkit.layouts import Layout, Param, TensorPart, TPCut, Unit

VOCAB, HIDDEN, FFN, BLOCKS, CLASSES = 50, 16, 32, 2, 10
TP = 2


def layout() -> Layout:
    """How the model's tensors are cut: the embedding's vocabulary over TP (padded), fc1 and its
    bias by output rows, fc2 by input columns; norms, fc2's bias and the head are replicated."""
    def whole(name: str, shape: tuple[int, ...], dim: int | None = None, **cut: int) -> Param:
        return Param(name=name, parts=(TensorPart(tensor=name, shape=shape),), tp=None if dim is None else TPCut(dim=dim, **cut))

    b = "blocks.{layer}."
    return Layout(
        name="toy-mlp",
        config={"vocab": VOCAB, "hidden": HIDDEN, "ffn": FFN, "blocks": BLOCKS, "classes": CLASSES},
        num_layers=BLOCKS,
        units=(
            Unit(name="embed", place="first", params=(whole("embed.weight", (VOCAB, HIDDEN), 0, pad_multiple=1),)),
            Unit(name="blocks.{layer}", place="layers", params=(
                whole(b + "norm.weight", (HIDDEN,)),
                whole(b + "fc1.weight", (FFN, HIDDEN), 0),
                whole(b + "fc1.bias", (FFN,), 0),
                whole(b + "fc2.weight", (HIDDEN, FFN), 1),
                whole(b + "fc2.bias", (HIDDEN,)),
            )),
            Unit(name="head", place="last", params=(whole("head.weight", (CLASSES, HIDDEN)), whole("head.bias", (CLASSES,)))),
        ),
    )


def full_model(seed: int = 0) -> dict[str, torch.Tensor]:
    """The whole model's tensors, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    out = {"embed.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(BLOCKS):
        out[f"blocks.{i}.norm.weight"] = torch.ones(HIDDEN) + 0.1 * torch.randn(HIDDEN, generator=g)
        out[f"blocks.{i}.fc1.weight"] = torch.randn(FFN, HIDDEN, generator=g)
        out[f"blocks.{i}.fc1.bias"] = torch.randn(FFN, generator=g)
        out[f"blocks.{i}.fc2.weight"] = torch.randn(HIDDEN, FFN, generator=g)
        out[f"blocks.{i}.fc2.bias"] = torch.randn(HIDDEN, generator=g)
    out["head.weight"] = torch.randn(CLASSES, HIDDEN, generator=g)
    out["head.bias"] = torch.randn(CLASSES, generator=g)
    return out


def local_shard(name: str, full: torch.Tensor, rank: int) -> ShardedTensor | torch.Tensor:
    """What TP rank `rank` holds of tensor `name`, as the model's own TP code cuts it."""
    if name == "embed.weight":  # rows padded to a multiple of TP, the padding on the last rank
        per = -(-VOCAB // TP)
        rows = full[rank * per : (rank + 1) * per]
        return ShardedTensor(rows.clone(), tuple(full.shape), (min(rank * per, VOCAB), 0))
    if name.endswith("fc1.weight") or name.endswith("fc1.bias"):
        n = FFN // TP
        return ShardedTensor(full[rank * n : (rank + 1) * n].clone(), tuple(full.shape), (rank * n,) + (0,) * (full.dim() - 1))
    if name.endswith("fc2.weight"):
        n = FFN // TP
        return ShardedTensor(full[:, rank * n : (rank + 1) * n].clone(), tuple(full.shape), (0, rank * n))
    return full.clone()  # replicated: written once, by whichever rank has written less


def moments(model: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return {k: v * 1e-3 for k, v in model.items()}, {k: v.abs() * 1e-6 for k, v in model.items()}


def save_rank(rank: int, out: str, port: int) -> None:
    """One TP rank: hold its shards and save them collectively, with the layout."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        model = full_model()
        exp_avg, exp_avg_sq = moments(model)
        state = {
            "model": {k: local_shard(k, v, rank) for k, v in model.items()},
            "optimizer": {"exp_avg": {k: local_shard(k, v, rank) for k, v in exp_avg.items()},
                          "exp_avg_sq": {k: local_shard(k, v, rank) for k, v in exp_avg_sq.items()}},
            "trainer": {"epoch": 3},
        }
        ckptkit.save(state, os.path.join(out, "tp2", "step_00000001"), step=1, layout=layout(),
                     topology=ckptkit.Topology(world_size=TP, tp=TP))
    finally:
        dist.destroy_process_group()


def main(out: str) -> int:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "layout.json"), "w", encoding="utf-8") as f:
        f.write(layout().model_dump_json(indent=2))
    with socket.socket() as s:  # a free port on the loopback interface for the process group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(save_rank, args=(out, port), nprocs=TP, start_method="spawn")
    src, dst = os.path.join(out, "tp2", "step_00000001"), os.path.join(out, "tp1", "step_00000001")
    print(f"saved {src} from {TP} processes")
    cli = os.path.join(os.path.dirname(sys.executable), "ckptkit")
    subprocess.run([cli, "reshard", src, dst, "--tp", "1"], check=True)
    loaded = ckptkit.load(dst)
    model = full_model()
    exp_avg, _ = moments(model)
    bad = [k for k, v in model.items() if not torch.equal(loaded["model"][k], v)]
    bad += [k for k, v in exp_avg.items() if not torch.equal(loaded["optimizer"]["exp_avg"][k], v)]
    if bad or loaded["trainer"] != {"epoch": 3}:
        print(f"loaded back from {dst}: {len(bad)} tensor(s) differ: {', '.join(bad)}")
        return 1
    print(f"loaded back from {dst}: all {len(model)} tensors and their Adam moments are equal")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "own-model-out"))
