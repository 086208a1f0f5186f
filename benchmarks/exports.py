"""Export to bf16 Hugging Face shards: ckptkit against the naive DCP path, and the disk's limits.

The source is the reshard phase's Llama-shaped checkpoint (parameters and both Adam moments,
fp32, saved as ranks of (tp 4, pp 2, dp 2, ZeRO 1) would) and the same tensors as a DCP
checkpoint. Three tools, one fresh process each, the source cold:

- ``ckptkit``: the real ``ckptkit export SRC DST --format hf --dtype bf16`` command line, as a
  child process (start-up included, its modules read into the page cache first, untimed); its
  peak RSS is the child's high-water mark.
- ``dcp consolidate+save_file``: the naive path. DCP's format utilities consolidate the whole
  DCP checkpoint in memory (``_load_state_dict`` with ``_EmptyStateDictLoadPlanner``, as
  ``dcp_to_torch_save`` does), the parameters are renamed and converted to bf16, and
  safetensors ``save_file`` writes them (then an fsync, as ckptkit's files are durable).
- ``disk limit``: a cold sequential read of the parameter bytes (what an export must read)
  plus a durable sequential write of the output bytes (``benchmarks.limits``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from .reshards import paths as reshard_paths
from .reshards import timed_command

TOOLS = ("disk limit", "ckptkit", "dcp consolidate+save_file")


def paths(work: str) -> dict[str, str]:
    base = os.path.join(work, "export")
    return {"ckptkit-out": os.path.join(base, "ckptkit-out"), "naive-out": os.path.join(base, "naive-out"),
            "limit-read": os.path.join(base, "limit-read"), "limit-write": os.path.join(base, "limit-write")}


def source_meta(work: str) -> dict[str, Any]:
    """The figures of the prepared source: parameter bytes (fp32 read) and output bytes (bf16)."""
    src = reshard_paths(work)["src"]
    import ckptkit

    manifest = ckptkit.read_manifest(src)
    params = {k: e for k, e in manifest.tensors.items() if e.kind == "param"}
    numel = {k: _numel(e.shape) for k, e in params.items()}
    return {"param_bytes": 4 * sum(numel.values()), "output_bytes": 2 * sum(numel.values()),
            "largest_tensor_bytes": 4 * max(numel.values()), "tensors": len(params)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one measured operation of the export phase (in a fresh worker process)."""
    from .cache import evict_files
    from .worker import go_cold, measure

    src, dcp_src = reshard_paths(request["work"])["src"], reshard_paths(request["work"])["dcp-src"]
    p = paths(request["work"])
    meta = source_meta(request["work"])
    tool = request["tool"]
    if tool == "disk limit":
        from .limits import read_limit, write_limit

        for key in ("limit-read", "limit-write"):
            shutil.rmtree(p[key], ignore_errors=True)
        write_limit(p["limit-read"], meta["param_bytes"])  # the file to read back cold (untimed)
        os.sync()
        write_s = write_limit(p["limit-write"], meta["output_bytes"])
        evict_files(p["limit-read"])
        cold = go_cold({"directory": p["limit-read"]})
        read_s = read_limit(p["limit-read"], meta["param_bytes"])
        for key in ("limit-read", "limit-write"):
            shutil.rmtree(p[key], ignore_errors=True)
        return {"seconds": write_s + read_s, "write_s": write_s, "read_s": read_s, **meta, **cold}
    if tool == "ckptkit":
        shutil.rmtree(p["ckptkit-out"], ignore_errors=True)
        os.sync()
        cold = go_cold({"directory": src})
        return {**_ckptkit(src, p["ckptkit-out"]), **cold, **meta}
    shutil.rmtree(p["naive-out"], ignore_errors=True)
    os.sync()
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ckptkit import read_manifest
    from ckptkit_adapters.hf.mapping import hf_runs
    from ckptkit.layouts import layout_for
    from ckptkit.models.reference import model_of

    manifest = read_manifest(src)  # the Hugging Face names of the reference Llama's tensors (a rename)
    spec, view = model_of(layout_for(manifest))
    hf_name = {rs[0].fqn: name for name, rs in hf_runs(manifest.tensors, spec, view).items()}
    cold = go_cold({"directory": dcp_src})

    def consolidate_and_save() -> None:
        state: dict[str, Any] = {}
        _load_state_dict(state, storage_reader=FileSystemReader(dcp_src), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        out = {hf_name[k]: v.to(torch.bfloat16) for k, v in state.items() if k.startswith("model/")}
        os.makedirs(p["naive-out"])
        path = os.path.join(p["naive-out"], "model.safetensors")
        save_file(out, path, metadata={"format": "pt"})  # type: ignore[arg-type]
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    _, figures = measure(consolidate_and_save)
    written = os.path.getsize(os.path.join(p["naive-out"], "model.safetensors"))
    shutil.rmtree(p["naive-out"], ignore_errors=True)
    return {**figures, **cold, **meta, "rss_peak_abs": figures["rss_peak"], "bytes_written": written}


def _ckptkit(src: str, out: str) -> dict[str, Any]:
    seconds, report, peak = timed_command(["export", src, out, "--format", "hf", "--dtype", "bf16"],
                                        "ckptkit.exports.run, ckptkit_adapters.hf.writer")
    written = sum(f["size"] for f in report["file_list"])
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": seconds, "in_process_s": report["seconds"], "bytes_written": written, "rss_peak_abs": peak}
