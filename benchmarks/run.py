"""Benchmark ckptkit against torch.save, safetensors and DCP, and against the machine's limits.

Usage: ``python -m benchmarks.run [--size-mb 2048] [--repeats 3] [--only save,load,load-warm,verify,scale,scale-131k,scale-ranks,reshard,reshard-plan,export,convert,async,s3,checksums,incremental]``.
Prints a table and writes a JSON document (``<out>/results.json`` unless ``--json``); the
checkpoints it writes under ``<out>/work`` are deleted at the end. See docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import psutil

from . import report
from .loads import MAPPED
from .phases import Runs, Settings, load_phase, run_rounds, run_worker, save_phase, verify_phase
from .state import state_bytes, state_specs
from .table import render

PHASES = ("save", "load", "load-warm", "verify", "scale", "scale-131k", "scale-ranks", "reshard", "reshard-plan", "export", "convert", "async", "s3",
          "checksums", "incremental", "tier")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048, help="state size in MiB of fp32 (default 2048)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every operation, medians reported (default 3)")
    parser.add_argument("--out", default="bench-out", help="scratch and results directory (default ./bench-out)")
    parser.add_argument("--json", dest="json_path", help="where to write the results (default <out>/results.json)")
    parser.add_argument("--only", default=",".join(PHASES), help=f"comma-separated phases among {','.join(PHASES)}")
    parser.add_argument("--dcp-threads", default="1,2,4", help="DCP writer thread counts to try (default 1,2,4)")
    parser.add_argument("--verify-workers", type=int, default=4, help="ckptkit verify worker threads (default 4)")
    parser.add_argument("--scale-tensors", type=int, default=2000)
    parser.add_argument("--scale-ranks", type=int, default=4096)
    parser.add_argument("--scale-dp", type=int, default=64, help="data-parallel ranks of the ZeRO tensors")
    parser.add_argument(
        "--scale-budget-s", type=float, default=120.0,
        help="stop repeating the scale benchmark once it has taken this long (default 120)",
    )
    parser.add_argument("--s3-size-mb", type=int, default=1024, help="state size of the s3 phase in MiB (default 1024)")
    parser.add_argument("--incremental-mb", type=int, default=512, help="state size of the incremental phase in MiB (default 512)")
    parser.add_argument("--incremental-saves", type=int, default=20, help="saves of each incremental scenario (default 20)")
    parser.add_argument("--tier-mb", type=int, default=256, help="state per rank of the tier phase in MiB (default 256)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints under <out>/work")
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"--only: unknown phase(s) {', '.join(sorted(unknown))}; choose among {', '.join(PHASES)}")
    return args


def machine_info(directory: str) -> dict[str, Any]:
    """Describe the machine and the file system the checkpoints are written to."""
    mount = _mount_of(directory)
    versions = {name: _version(name) for name in ("torch", "safetensors", "ckptkit", "pydantic", "xxhash")}
    info = {
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "filesystem": mount,
        "versions": versions,
        "ckptkit_commit": git_commit(),
        "free_page_reporting": free_page_reporting(),
    }
    info["summary"] = (
        f"{info['cpus']} CPUs, {info['memory_bytes'] / (1 << 30):.1f} GiB RAM, Linux {info['kernel']}, "
        f"{mount['type']} on {mount['device']}; torch {versions['torch']}, safetensors {versions['safetensors']}"
    )
    if info["free_page_reporting"]:
        info["summary"] += ("\nmemory: the host takes back freed memory (virtio free page reporting), so memory touched "
                            "for the first time costs up to 20x more (docs/PERFORMANCE.md, \"Memory the host takes back\")")
    return info


VIRTIO_DEVICES = "/sys/bus/virtio/devices"
VIRTIO_BALLOON = 5  # the virtio device id of a memory balloon
BALLOON_F_REPORTING = 5  # its feature bit: freed guest pages are reported to the host, which drops them


def free_page_reporting(devices: str = VIRTIO_DEVICES) -> bool:
    """Whether this machine is a virtual machine whose memory balloon reports freed pages to the
    host (the host then drops them, and the next first touch of such a page waits for the host)."""
    try:
        names = os.listdir(devices)
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                device = int(f.read().strip(), 16)
            with open(os.path.join(devices, name, "features")) as f:
                features = f.read().strip()
        except (OSError, ValueError):
            continue
        if device == VIRTIO_BALLOON and len(features) > BALLOON_F_REPORTING and features[BALLOON_F_REPORTING] == "1":
            return True
    return False


def _mount_of(directory: str) -> dict[str, str]:
    path = os.path.realpath(directory)
    best = {"device": "?", "mount_point": "/", "type": "?"}
    with open("/proc/mounts") as f:
        for line in f:
            device, point, kind = line.split()[:3]
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best["mount_point"]):
                best = {"device": device, "mount_point": point, "type": kind}
    return best


def git_commit() -> str:
    """Return the commit of the checkout being measured, with "+dirty" for local changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "ckptkit"], cwd=root, capture_output=True, text=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def check_space(work: str, nbytes: int, copies: int) -> None:
    """Exit with a message when the disk cannot hold `copies` checkpoints of `nbytes`."""
    os.makedirs(work, exist_ok=True)
    free = shutil.disk_usage(work).free
    needed = nbytes * copies
    if free < needed:
        sys.exit(f"benchmarks: {work} has {free / 1e9:.1f} GB free, the run needs about {needed / 1e9:.1f} GB")


def phase_block(runs: Runs, phase: str, subject: str) -> dict[str, Any]:
    """Return a phase's summary per tool, subject's paired ratios, and the raw runs."""
    tools = report.summarize(runs, phase)
    return {"tools": tools, "ratios": report.ratios(runs, subject), "best_dcp": report.best_dcp(tools), "runs": runs}


def run_io_phases(args: argparse.Namespace, settings: Settings, results: dict[str, Any]) -> None:
    """Run the save, load and verify phases that were asked for, adding their blocks to `results`."""
    phases = args.only.split(",")
    dcp_threads = [int(n) for n in args.dcp_threads.split(",")]
    if "save" in phases:
        results["save"] = phase_block(save_phase(settings, dcp_threads), "save", "ckptkit")
    dcp_source = results.get("save", {}).get("best_dcp") or f"dcp-t{dcp_threads[0]}"  # what `dcp` loads
    if "load" in phases:
        results["load"] = phase_block(load_phase(settings, dcp_source), "load", "ckptkit")
        results["load"]["dcp_source"] = dcp_source
    if "load-warm" in phases:
        results["load_warm"] = phase_block(load_phase(settings, dcp_source, warm=True), "load", "ckptkit")
    for key in ("load", "load_warm"):  # the mapped load against the same limits
        if key in results:
            results[key]["ratios_mapped"] = report.ratios(results[key]["runs"], MAPPED)
    if "verify" in phases:
        block = phase_block(verify_phase(settings, args.verify_workers), "verify", "ckptkit verify")
        block["workers"] = args.verify_workers
        results["verify"] = block


def run_scale_phase(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """Run the manifest-at-scale benchmark up to --repeats times, within --scale-budget-s."""
    request = {
        "kind": "scale", "size_mib": 1, "tensors": args.scale_tensors, "ranks": args.scale_ranks, "dp": args.scale_dp,
    }
    runs: list[dict[str, Any]] = []
    start = time.perf_counter()
    while len(runs) < args.repeats and (not runs or time.perf_counter() - start < args.scale_budget_s):
        result = run_worker(request)
        if "error" in result:
            settings.say(f"[scale] FAILED: {result['error']}")
            return {"error": result["error"], "runs": len(runs) + 1}
        runs.append(result)
        settings.say(f"[scale {len(runs)}] build {result['build_s']:.2f} s, validate {result['validate_s']:.2f} s")
    # Timings are medians; the counts and the JSON size are the same in every run.
    median = {key: statistics.median(r[key] for r in runs) if key.endswith("_s") else runs[0][key] for key in runs[0]}
    median.pop("state_bytes", None)
    return {"runs": len(runs), "median": median, "all": runs}


def run_scale_131k_phase(settings: Settings) -> dict[str, Any]:
    """The 131,072-rank DeepSeek-V3-like save described by its layout, --repeats times (a fresh
    process each, one core); timings are medians over the runs, the sizes the same in each."""
    runs: list[dict[str, Any]] = []
    for repeat in range(settings.repeats):
        result = run_worker({"kind": "scale-131k", "size_mib": 1})
        if "error" in result:
            settings.say(f"[scale-131k] FAILED: {result['error']}")
            return {"error": result["error"]}
        settings.say(f"[scale-131k {repeat + 1}/{settings.repeats}] parse {result['parse_s']:.3f} s, "
                     f"load plan {result['load_plan_ms']:.1f} ms, reshard plan {result['reshard_plan_ms']:.1f} ms")
        runs.append(result)
    median = {k: statistics.median(r[k] for r in runs) if isinstance(runs[0][k], float) else runs[0][k] for k in runs[0]}
    return {"runs": len(runs), "median": median, "all": runs}


def run_reshard_phase(settings: Settings) -> dict[str, Any]:
    """Prepare the reshard source (untimed), then time ckptkit, DCP and the disk limit on it."""
    from .reshards import prepare_request, reshard_tools

    meta = run_worker(prepare_request(settings))
    if "error" in meta:
        settings.say(f"[reshard] prepare FAILED: {meta['error']}")
        return {"error": meta["error"]}
    settings.say(f"[reshard] source of {meta['state_bytes'] / 1e9:.2f} GB, {meta['tensors']} tensors written (untimed)")
    runs = run_rounds(settings, "reshard", reshard_tools(), lambda tool: {"kind": "reshard", "tool": tool, "work": settings.work})
    return {"source": meta, **report.reshard_summary(runs), "runs": runs}


def run_export_phase(settings: Settings, prepared: bool) -> dict[str, Any]:
    """Time ckptkit export, the naive DCP path and the disk limit on the reshard phase's source
    (prepared here, untimed, unless the reshard phase already did)."""
    from .exports import TOOLS, source_meta
    from .reshards import prepare_request

    if not prepared:
        meta = run_worker(prepare_request(settings))
        if "error" in meta:
            settings.say(f"[export] prepare FAILED: {meta['error']}")
            return {"error": meta["error"]}
    source = source_meta(settings.work)
    settings.say(f"[export] source: {source['param_bytes'] / 1e9:.2f} GB of parameters to read")
    runs = run_rounds(settings, "export", list(TOOLS), lambda tool: {"kind": "export", "tool": tool, "work": settings.work})
    return {"source": source, **report.export_summary(runs), "runs": runs}


def run_convert_phase(settings: Settings, prepared: bool) -> dict[str, Any]:
    """Time ckptkit convert, each source's own tool and the disk limits on two sources: the
    reshard phase's DCP source (prepared here, untimed, unless an earlier phase did) and a
    DeepSpeed ZeRO-3 save written here, untimed, by DeepSpeed (skipped, with the reason, where
    DeepSpeed cannot be imported)."""
    from .converts import TOOLS, source_meta
    from .reshards import prepare_request

    def request_for(source: str) -> Callable[[str], dict[str, Any]]:
        return lambda tool: {"kind": "convert", "source": source, "tool": tool, "work": settings.work}

    def measured(source: str) -> dict[str, Any]:
        meta = source_meta(settings.work, source)
        settings.say(f"[convert] {source} source: {meta['source_bytes'] / 1e9:.2f} GB on disk")
        runs = run_rounds(settings, f"convert {source}", list(TOOLS[source]), request_for(source))
        return {"source": meta, **report.convert_summary(runs, source), "runs": runs}

    block: dict[str, Any] = {}
    prepare_error = None if prepared else run_worker(prepare_request(settings)).get("error")
    if prepare_error:
        settings.say(f"[convert] dcp prepare FAILED: {prepare_error}")
        block["dcp"] = {"error": prepare_error}
    else:
        block["dcp"] = measured("dcp")
    meta = run_worker({"kind": "convert-prepare", "work": settings.work, "size_mib": settings.size_mib})
    if "skipped" in meta:
        settings.say(f"[convert] deepspeed SKIPPED: {meta['skipped']}")
        block["deepspeed"] = {"skipped": meta["skipped"]}
    elif "error" in meta:
        settings.say(f"[convert] deepspeed prepare FAILED: {meta['error']}")
        block["deepspeed"] = {"error": meta["error"]}
    else:
        settings.say(f"[convert] deepspeed source of {meta['source_bytes'] / 1e9:.2f} GB, "
                     f"{meta['parameters']} parameters, written by DeepSpeed (untimed)")
        block["deepspeed"] = measured("deepspeed")
    return block


def run_async_phase(settings: Settings) -> dict[str, Any]:
    """Time the blocking part of a save: ckptkit's async save, a plain copy, DCP's async_save."""
    from .asyncs import TOOLS, summary

    runs = run_rounds(settings, "async", list(TOOLS),
                      lambda tool: {"kind": "async", "tool": tool, "directory": os.path.join(settings.work, "async", tool.replace(" ", "-"))})
    return {**summary(runs), "runs": runs}


def run_s3_phase(settings: Settings, size_mib: int) -> dict[str, Any]:
    """Save and load through a local S3 server against boto3 upload_file / download_file of the
    same bytes; then count the bytes a load-time reshard reads from S3."""
    from . import s3s

    try:
        proc, env = s3s.start_server()
    except (FileNotFoundError, RuntimeError) as exc:
        settings.say(f"[s3] server FAILED: {exc}")
        return {"error": f"the S3 server did not start: {exc}"}
    try:
        runs: Runs = {tool: [] for tool in s3s.TOOLS}
        for repeat in range(settings.repeats):
            pairs = [("boto3 upload_file", "ckptkit save"), ("boto3 download_file", "ckptkit load")]
            order = [t for pair in pairs for t in (pair if repeat % 2 == 0 else pair[::-1])]
            for tool in order:
                request = {"kind": "s3", "tool": tool, "size_mib": size_mib, "env": env, "work": settings.work,
                           "name": f"r{repeat}"}
                result = run_worker(request)
                runs[tool].append(result)
                said = f"FAILED: {result['error']}" if "error" in result else f"{result['seconds']:.2f} s"
                settings.say(f"[s3 {repeat + 1}/{settings.repeats}] {tool:<22} {said}")
        reads = s3s.resharding_reads(env)
        settings.say(f"[s3] load-time reshard read {reads['payload_bytes_read']} payload bytes for {reads['box_bytes']} box bytes")
    finally:
        s3s.stop_server(proc)
    return {**s3s.summary(runs), "resharding": reads, "size_mib": size_mib, "runs": runs}


def run_checksums_phase(settings: Settings) -> dict[str, Any]:
    """Time save and cold loads (whole, and as 3 ranks' row blocks) with block checksums as shipped
    and with them patched out, interleaved per repeat; then count the bytes partial loads read."""
    from . import checksums

    source = checksums.source_dir(settings.work)
    prepared = run_worker({"kind": "checksums-prepare", "size_mib": settings.size_mib, "directory": source})
    if "error" in prepared:
        settings.say(f"[checksums] prepare FAILED: {prepared['error']}")
        return {"error": prepared["error"]}
    settings.say(f"[checksums] source checkpoint written (untimed); block hashing alone {prepared['block_hash_s']:.2f} s")

    def request_for(tool: str) -> dict[str, Any]:
        if tool in (checksums.SAVE, checksums.SAVE_UNHASHED):
            return {"kind": "checksums-save", "tool": tool, "directory": checksums.save_dir(settings.work, tool)}
        return {"kind": "checksums", "tool": tool, "directory": source}

    # Saves and loads in rounds of their own: each save then follows a save, each load a load (in
    # one rotation, the save following a cold load ran up to 25% slower than the one following a save).
    saves = [t for t in checksums.TOOLS if t in (checksums.SAVE, checksums.SAVE_UNHASHED)]
    runs = run_rounds(settings, "checksums", saves, request_for)
    runs.update(run_rounds(settings, "checksums", [t for t in checksums.TOOLS if t not in saves], request_for))
    reads = run_worker({"kind": "checksums-reads", "size_mib": settings.size_mib, "directory": source})
    if "error" in reads:
        settings.say(f"[checksums] partial reads FAILED: {reads['error']}")
    else:
        for name, variants in reads["partial"].items():
            settings.say(f"[checksums] partial load, {name}: read / needed "
                         + ", ".join(f"{v} {r['amplification']:.3f}" for v, r in variants.items()))
    return {**checksums.summary(runs, prepared, reads), "runs": runs}


def run_incremental_phase(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """Each scenario's saves, full and incremental interleaved, once per repeat (a fresh process
    each); then the speed of finding changed elements and of a codec. Medians over repeats."""
    from . import incremental

    block: dict[str, Any] = {"size_mib": args.incremental_mb, "saves": args.incremental_saves, "scenarios": {},
                             "compact_after": incremental.COMPACT_AFTER}
    for scenario in incremental.SCENARIOS:
        summaries = []
        for repeat in range(settings.repeats):
            result = run_worker({"kind": "incremental", "scenario": scenario, "work": settings.work, "size_mib": args.incremental_mb,
                                 "saves": args.incremental_saves})
            if "error" in result:
                settings.say(f"[incremental {scenario}] FAILED: {result['error']}")
                summaries = []
                block["scenarios"][scenario] = {"error": result["error"]}
                break
            s = incremental.summary(result)
            settings.say(f"[incremental {scenario} {repeat + 1}/{settings.repeats}] bytes {s['incremental_written'] / 1e6:.1f} MB "
                         f"vs full {s['full_written'] / 1e6:.1f} MB (changed {s['changed_bytes'] / 1e6:.1f} MB); save "
                         f"{s['incremental_s']:.3f} s vs {s['full_s']:.3f} s; restore x{s['restore_vs_full']:.2f}")
            summaries.append(s)
        if summaries:
            block["scenarios"][scenario] = {k: statistics.median(s[k] for s in summaries if s[k] is not None)
                                            if any(s[k] is not None for s in summaries) else None for k in summaries[0]}
    speed = run_worker({"kind": "incremental-speed", "work": settings.work, "size_mib": 1})
    if "error" in speed:
        settings.say(f"[incremental] speed FAILED: {speed['error']}")
    block["encode"], block["codec"] = speed.get("encode"), speed.get("codec")
    return block


def run_reshard_plan_phase(settings: Settings) -> dict[str, Any]:
    """Time reshard planning at scale --repeats times (a fresh process each); report the median run."""
    runs = []
    for repeat in range(settings.repeats):
        result = run_worker({"kind": "reshard-plan", "size_mib": 1})
        if "error" in result:
            settings.say(f"[reshard-plan] FAILED: {result['error']}")
            return result
        settings.say(f"[reshard-plan {repeat + 1}/{settings.repeats}] plan {result['plan_s']:.2f} s + reads {result['reads_s']:.2f} s")
        runs.append(result)
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return {**median, "all_seconds": [r["seconds"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    work = os.path.join(out, "work")
    os.makedirs(out, exist_ok=True)
    specs = state_specs(args.size_mb)
    nbytes = state_bytes(specs)
    settings = Settings(args.size_mb, args.repeats, work, lambda line: print(line, file=sys.stderr, flush=True))
    results: dict[str, Any] = {
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: v for k, v in vars(args).items() if k != "json_path"},
        "state": {"bytes": nbytes, "tensors": len(specs), "largest_bytes": max(s.nbytes for s in specs)},
        "machine": machine_info(out),
    }
    if set(args.only.split(",")) & {"save", "load", "load-warm", "verify"}:
        check_space(work, nbytes, 6 + len(args.dcp_threads.split(",")))
    if "checksums" in args.only.split(","):
        check_space(work, nbytes, 3)
    if "convert" in args.only.split(","):
        # the reshard phase's two sources and the DeepSpeed one, then a tool's output or a disk limit's two files
        check_space(work, nbytes, 6)
    started = time.perf_counter()
    try:
        run_io_phases(args, settings, results)
        if "scale" in args.only.split(","):
            results["scale"] = run_scale_phase(args, settings)
        if "scale-131k" in args.only.split(","):
            results["scale_131k"] = run_scale_131k_phase(settings)
        if "scale-ranks" in args.only.split(","):
            result = run_worker({"kind": "scale-ranks", "size_mib": 1})
            if "error" in result:
                settings.say(f"[scale-ranks] FAILED: {result['error']}")
            results["scale_ranks"] = result
        if "reshard" in args.only.split(","):
            results["reshard"] = run_reshard_phase(settings)
        if "export" in args.only.split(","):
            results["export"] = run_export_phase(settings, "reshard" in results and "error" not in results["reshard"])
        if "convert" in args.only.split(","):
            prepared = any(p in results and "error" not in results[p] for p in ("reshard", "export"))
            results["convert"] = run_convert_phase(settings, prepared)
        if "async" in args.only.split(","):
            results["async"] = run_async_phase(settings)
        if "s3" in args.only.split(","):
            results["s3"] = run_s3_phase(settings, args.s3_size_mb)
        if "reshard-plan" in args.only.split(","):
            results["reshard_plan"] = run_reshard_plan_phase(settings)
        if "checksums" in args.only.split(","):
            results["checksums"] = run_checksums_phase(settings)
        if "incremental" in args.only.split(","):
            results["incremental"] = run_incremental_phase(args, settings)
        if "tier" in args.only.split(","):
            from . import tiers

            results["tier"] = tiers.run(settings, args.tier_mb)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started
    results["targets"] = report.targets(results)
    json_path = args.json_path or os.path.join(out, "results.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    print(render(results))
    print(f"\nresults: {json_path} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
