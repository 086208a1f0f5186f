"""Convert another tool's checkpoint into ckptkit's: ckptkit against each source's own tool, and the disk's limits.

Two sources, each measured in rounds of its own, one fresh process per operation, the source cold:

**torch DCP**: the reshard phase's DCP source (the same tensors as its ckptkit source:
parameters and both Adam moments, fp32), prepared by that phase or, untimed, by this one.

- ``ckptkit``: the real ``ckptkit convert SRC DST --from dcp --json`` command line, as a child
  process (start-up included, its modules read into the page cache first, untimed); its peak
  RSS is the child's high-water mark.
- ``dcp_to_torch_save``: torch's own conversion,
  ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(src, out.pt)`` (the whole
  checkpoint consolidated in memory, one ``torch.save`` file), then an fsync, as ckptkit's
  files are durable.
- ``disk limit``: a cold sequential read of the source's bytes (every file of the DCP
  directory) plus a durable sequential write of the output's bytes (every tensor's bytes).

**DeepSpeed ZeRO-3**: a real ``engine.save_checkpoint`` directory written by DeepSpeed itself
(untimed, `prepare_deepspeed`): 2 gloo ranks on CPU, fp32, `DS_LAYERS` square ``nn.Linear``
layers (with biases) built under ``deepspeed.zero.Init`` and trained one step with
``torch.optim.AdamW``. Each rank's files hold its flat partition of the fp32 masters and of
both Adam moments, 12 bytes a parameter in all: the hidden size is chosen so that the source
comes to about the state size, as the DCP source does.

- ``ckptkit``: ``ckptkit convert SRC DST --from deepspeed --json`` as above. It writes every
  parameter (derived from its fp32 master: ZeRO-3 saves no module copy), the fp32 masters and
  both Adam moments: 16 bytes a parameter, and reads every rank file.
- ``zero_to_fp32``: DeepSpeed's own conversion,
  ``deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_state_dict(src, outdir,
  safe_serialization=True)``, then an fsync of every file it wrote. It writes the fp32 weights
  only (4 bytes a parameter) and maps the optimizer files, reading only the masters' pages.
- ``disk limit, ckptkit's bytes`` and ``disk limit, zero_to_fp32's bytes``: as for DCP, each
  with the bytes that tool must read and write. The tools write different bytes, so the
  figure that compares them is each tool's time over the limit for its own bytes; the plain
  time ratio between them is reported beside it.

Every tool's run reports ``bytes_read`` (what it read from the disk, as the kernel counts it:
``getrusage`` input blocks) and ``bytes_written`` (the files it left, before they are
deleted); a disk limit's are the bytes it was given.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import socket
import warnings
from collections.abc import Callable
from typing import Any

from .reshards import paths as reshard_paths
from .reshards import timed_command, warm_modules

TOOLS: dict[str, tuple[str, ...]] = {
    "dcp": ("disk limit", "ckptkit", "dcp_to_torch_save"),
    "deepspeed": ("disk limit, ckptkit's bytes", "disk limit, zero_to_fp32's bytes", "ckptkit", "zero_to_fp32"),
}
# The peer each source's ckptkit run is paired with, and the disk limit of each tool's own bytes.
PEERS = {"dcp": "dcp_to_torch_save", "deepspeed": "zero_to_fp32"}
LIMITS = {
    ("dcp", "ckptkit"): "disk limit", ("dcp", "dcp_to_torch_save"): "disk limit",
    ("deepspeed", "ckptkit"): "disk limit, ckptkit's bytes", ("deepspeed", "zero_to_fp32"): "disk limit, zero_to_fp32's bytes",
}
CONVERTER_MODULES = {"dcp": "ckptkit_adapters.dcp.reader", "deepspeed": "ckptkit_adapters.deepspeed.reader"}

DS_RANKS = 2
DS_LAYERS = 4
DS_SOURCE_BYTES_PER_PARAM = 12  # the fp32 master and two Adam moments
DS_CKPTKIT_BYTES_PER_PARAM = 16  # the parameter, the fp32 master and two Adam moments
DS_PEER_BYTES_PER_PARAM = 4  # the fp32 weights
DS_SEED = 20251201


def paths(work: str) -> dict[str, str]:
    base = os.path.join(work, "convert")
    names = ("ds-src", "ckptkit-out", "peer-out", "limit-read", "limit-write")
    return {**{name: os.path.join(base, name) for name in names}, "ds-meta": os.path.join(base, "ds-meta.json")}


def _tree_bytes(path: str) -> int:
    from .cache import files_under

    return sum(os.path.getsize(name) for name in files_under(path))


def source_meta(work: str, source: str) -> dict[str, Any]:
    """The figures of a prepared source: its bytes on disk, the bytes each tool must read and
    write (the disk limits' sizes), its tensors and the largest one (the RSS bound)."""
    if source == "deepspeed":
        with open(paths(work)["ds-meta"]) as f:
            meta: dict[str, Any] = json.load(f)
        return meta
    dcp_src = reshard_paths(work)["dcp-src"]
    with open(os.path.join(reshard_paths(work)["src"], "..", "meta.json")) as f:
        reshard = json.load(f)
    source_bytes = _tree_bytes(dcp_src)
    return {"source_bytes": source_bytes, "tensor_bytes": reshard["state_bytes"], "tensors": reshard["tensors"],
            "largest_tensor_bytes": reshard["largest_tensor_bytes"],
            "reads": {"ckptkit": source_bytes, "dcp_to_torch_save": source_bytes},
            "writes": {"ckptkit": reshard["state_bytes"], "dcp_to_torch_save": reshard["state_bytes"]}}


def ds_hidden(size_mib: int) -> int:
    """The hidden size (a multiple of 64) of `DS_LAYERS` square layers whose fp32 masters and two
    Adam moments come to about `size_mib` MiB."""
    params = size_mib * (1 << 20) / DS_SOURCE_BYTES_PER_PARAM
    return max(64, int(math.sqrt(params / DS_LAYERS)) // 64 * 64)


def ds_config() -> dict[str, Any]:
    """The DeepSpeed config of the source: ZeRO-3, fp32, every parameter partitioned, the client AdamW kept."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
    }


def prepare_deepspeed(work: str, size_mib: int) -> dict[str, Any]:
    """Write the DeepSpeed source (untimed) with DeepSpeed itself and record its figures; return
    them, or ``{"skipped": reason}`` when DeepSpeed cannot be imported."""
    os.environ["DS_ACCELERATOR"] = "cpu"  # before the first import of deepspeed, here and in the ranks
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # ImportError, or DeepSpeed failing at import: either way, no source
        return {"skipped": f"DeepSpeed cannot be imported ({type(exc).__name__}: {exc})"}
    from torch.multiprocessing.spawn import start_processes

    p = paths(work)
    shutil.rmtree(p["ds-src"], ignore_errors=True)
    os.makedirs(os.path.dirname(p["ds-src"]), exist_ok=True)
    hidden = ds_hidden(size_mib)
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_processes(_ds_rank, args=(p["ds-src"], port, hidden), nprocs=DS_RANKS, start_method="spawn")  # type: ignore[no-untyped-call]
    os.sync()
    with open(os.path.join(p["ds-src"], "latest")) as f:
        tag = f.read().strip()
    files = sorted(os.listdir(os.path.join(p["ds-src"], tag)))
    sizes = {name: os.path.getsize(os.path.join(p["ds-src"], tag, name)) for name in files}
    params = DS_LAYERS * (hidden * hidden + hidden)
    model_files = sum(size for name, size in sizes.items() if name.endswith("_model_states.pt"))
    source_bytes = sum(sizes.values())
    meta = {
        "source_bytes": source_bytes, "files": sizes, "tag": tag, "ranks": DS_RANKS, "layers": DS_LAYERS, "hidden": hidden,
        "parameters": params, "tensors": 2 * DS_LAYERS, "largest_tensor_bytes": 4 * hidden * hidden,
        # ckptkit reads every rank file; zero_to_fp32 loads the module files and maps the optimizer
        # files, reading the fp32 masters' pages only.
        "reads": {"ckptkit": source_bytes, "zero_to_fp32": model_files + DS_PEER_BYTES_PER_PARAM * params},
        "writes": {"ckptkit": DS_CKPTKIT_BYTES_PER_PARAM * params, "zero_to_fp32": DS_PEER_BYTES_PER_PARAM * params},
    }
    with open(p["ds-meta"], "w") as f:
        json.dump(meta, f)
    return meta


def _ds_rank(rank: int, directory: str, port: int, hidden: int) -> None:
    """One rank of the DeepSpeed source's training job (a spawned process): build, one step, save."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(DS_RANKS), LOCAL_WORLD_SIZE=str(DS_RANKS))
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        cfg = ds_config()
        torch.manual_seed(DS_SEED)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            layers: list[nn.Module] = []
            for _ in range(DS_LAYERS):
                layers += [nn.Linear(hidden, hidden), nn.Tanh()]
            model = nn.Sequential(*layers[:-1])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        x = torch.randn(2, hidden, generator=torch.Generator().manual_seed(DS_SEED + rank))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        engine.save_checkpoint(directory)
        dist.barrier()
        engine.destroy()
    finally:
        dist.destroy_process_group()


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one measured operation of the convert phase (in a fresh worker process)."""
    source, tool, work = request["source"], request["tool"], request["work"]
    src = reshard_paths(work)["dcp-src"] if source == "dcp" else paths(work)["ds-src"]
    meta = source_meta(work, source)
    figures = {"source_bytes": meta["source_bytes"], "state_bytes": meta["source_bytes"],
               "largest_tensor_bytes": meta["largest_tensor_bytes"]}
    if tool.startswith("disk limit"):
        subject = next(t for (s, t), limit in LIMITS.items() if s == source and limit == tool)
        return {**_disk_limit(work, meta["reads"][subject], meta["writes"][subject]), **figures}
    if tool == "ckptkit":
        return {**_ckptkit(src, paths(work)["ckptkit-out"], source), **figures}
    return {**_peer(src, paths(work)["peer-out"], source), **figures}


def _disk_limit(work: str, read_bytes: int, write_bytes: int) -> dict[str, Any]:
    """A durable sequential write of `write_bytes` plus a cold sequential read of `read_bytes`."""
    from .cache import evict_files
    from .limits import read_limit, write_limit
    from .worker import go_cold

    p = paths(work)
    for key in ("limit-read", "limit-write"):
        shutil.rmtree(p[key], ignore_errors=True)
    write_limit(p["limit-read"], read_bytes)  # the file to read back cold (untimed)
    os.sync()
    write_s = write_limit(p["limit-write"], write_bytes)
    evict_files(p["limit-read"])
    cold = go_cold({"directory": p["limit-read"]})
    read_s = read_limit(p["limit-read"], read_bytes)
    for key in ("limit-read", "limit-write"):
        shutil.rmtree(p[key], ignore_errors=True)
    return {"seconds": write_s + read_s, "write_s": write_s, "read_s": read_s,
            "bytes_read": read_bytes, "bytes_written": write_bytes, **cold}


def _bytes_read(who: int) -> int:
    """The bytes this process (RUSAGE_SELF) or its waited-for children read from the disk so far."""
    return resource.getrusage(who).ru_inblock * 512


def _ckptkit(src: str, out: str, source: str) -> dict[str, Any]:
    """``ckptkit convert SRC OUT --from SOURCE --json`` as a child process, the source cold."""
    from .worker import go_cold

    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    cold = go_cold({"directory": src})
    module = CONVERTER_MODULES[source]
    warm_modules(module)  # before counting the child's reads: the files of its code are not the checkpoint's
    before = _bytes_read(resource.RUSAGE_CHILDREN)
    seconds, report, peak = timed_command(["convert", src, out, "--from", source], module, warm=False)
    read = _bytes_read(resource.RUSAGE_CHILDREN) - before
    written = _tree_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "in_process_s": report["seconds"], "bytes_read": read, "bytes_written": written,
            "payload_bytes_written": report["bytes_written"], "tensors": report["tensors"],
            "skipped": len(report["skipped"]), "rss_peak_abs": peak, **cold}


def _peer(src: str, out: str, source: str) -> dict[str, Any]:
    """The source's own tool in this process, its modules imported first and the source cold,
    then an fsync of every file it wrote; time and peak RSS by `measure`."""
    from .worker import go_cold, measure

    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    convert = _dcp_to_torch_save(src, out) if source == "dcp" else _zero_to_fp32(src, out)
    cold = go_cold({"directory": src})

    def convert_durably() -> None:
        convert()
        _fsync_tree(out)

    before = _bytes_read(resource.RUSAGE_SELF)
    _, figures = measure(convert_durably)
    read = _bytes_read(resource.RUSAGE_SELF) - before
    written = _tree_bytes(out)
    shutil.rmtree(out, ignore_errors=True)
    return {**figures, **cold, "rss_peak_abs": figures["rss_peak"], "bytes_read": read, "bytes_written": written}


def _dcp_to_torch_save(src: str, out: str) -> Callable[[], None]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    def convert() -> None:
        os.makedirs(out)
        dcp_to_torch_save(src, os.path.join(out, "model.pt"))

    return convert


def _zero_to_fp32(src: str, out: str) -> Callable[[], None]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    # What convert_zero_checkpoint_to_state_dict imports when called, imported now: out of the clock.
    import safetensors.torch  # noqa: F401
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
    from huggingface_hub import split_torch_state_dict_into_shards  # noqa: F401

    def convert() -> None:
        convert_zero_checkpoint_to_state_dict(src, out, safe_serialization=True)

    return convert


def _fsync_tree(directory: str) -> None:
    """fsync every file under `directory`, then the directory: the output made durable."""
    from .cache import files_under

    for name in [*files_under(directory), directory]:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
