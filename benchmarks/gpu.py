"""GPU benchmark: what saving and loading a model state on a CUDA device costs the training.

Usage: ``python benchmarks/gpu.py [--small | --size-gb 7.5] [--repeats 5] [--step-ms 100] [--out bench-out/gpu] [--work DIR] [--skip-dcp] [--dcp-deadline 90]``
(or ``make bench-gpu``). One process, one CUDA device, every ratio measured in this run from
medians of `--repeats` saves or loads (see `benchmarks.gpu_measure` for what each number is):

- the stall per save of ``CheckpointManager`` host and device snapshots against the pinned
  device-to-host copy and the device-to-device copy of the same state, and against DCP
  ``async_save`` (its defaults, ``BlockingAsyncStager(cache_staged_state_dict=True)`` and a
  pinned ``DefaultStager``; measured last, each within ``--dcp-deadline`` seconds: a variant
  that fails or hangs is reported, not fatal);
- the slowdown of the compute steps run while the save is written in the background;
- a cold ``ckptkit.load`` into CUDA tensors against the cold read of the same bytes and DCP's
  ``load`` into CUDA tensors; the host memory each adds;
- the targets beside the measured ratios.

Prints a table and writes ``<out>/gpu-results.json`` (creating `<out>`); a run that fails part
way still writes the results measured so far there, with its ``error``. Without CUDA it exits
with status 2 and one line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import sys
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_state import DEFAULT_BYTES, SMALL_BYTES, Llama, llama_for  # noqa: E402

NO_CUDA_EXIT = 2
# (name, measured ratio's key, comparison, bound)
TARGETS = (
    ("device-snapshot stall <= 2x the D2D copy", "device_stall_vs_d2d", "<=", 2.0),
    ("host-snapshot stall <= 1.05x the pinned D2H copy", "host_stall_vs_d2h", "<=", 1.05),
    ("load >= 0.9x the cold read (speed)", "load_vs_cold_read", ">=", 0.9),
    # The pool is pinned when the first load allocates it; the reader's block checks and the
    # allocators add a little beside it.
    ("host memory added by the load <= its bounce pool + 64 MiB", "load_host_vs_pool", "<=", 1 + (64 << 20) / (1 << 30)),
    ("compute slowdown during the background write <= 3% (host snapshots)", "host_slowdown", "<=", 0.03),
    ("compute slowdown during the background write <= 3% (device snapshots)", "device_slowdown", "<=", 0.03),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/gpu.py", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help=f"a state of about {SMALL_BYTES / 1e9:.1f} GB (a smaller model)")
    size.add_argument("--size-gb", type=float, help=f"the state's size in GB (default {DEFAULT_BYTES / 1e9:.1f})")
    parser.add_argument("--repeats", type=int, default=5, help="measured saves and loads per tool, medians reported (default 5)")
    parser.add_argument("--step-ms", type=float, default=100.0, help="length of one compute step (default 100)")
    parser.add_argument("--out", default=os.path.join("bench-out", "gpu"), help="scratch and results directory")
    parser.add_argument("--work", help="where the checkpoints are written, deleted at the end (default <out>/work)")
    parser.add_argument("--skip-dcp", action="store_true", help="leave out DCP's async_save and load")
    parser.add_argument("--dcp-deadline", type=float, default=90.0,
                        help="seconds each DCP async_save variant may take, all its saves together (default 90)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def cuda_problem() -> str | None:
    """Why this benchmark cannot run here (no torch, no CUDA device), or None."""
    try:
        import torch
    except ImportError:
        return "benchmarks/gpu.py: torch is not installed; this benchmark needs torch with CUDA and a CUDA device"
    if not torch.cuda.is_available():
        return f"benchmarks/gpu.py: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}); this benchmark needs one"
    return None


def model_for(args: argparse.Namespace) -> Llama:
    if args.small:
        return llama_for(SMALL_BYTES, small=True)
    return llama_for(int((args.size_gb or DEFAULT_BYTES / 1e9) * 1e9))


def run(args: argparse.Namespace, say: Any, results: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every measurement into `results` (a new dict by default, filled as the run goes, so
    that a caller keeps what was measured before a failure); return it, ratios and targets
    included."""
    import torch

    from benchmarks import gpu_measure as m
    from benchmarks.gpu_state import build_state
    from ckptkit.writer.snapshot import choose_snapshot, device_memory

    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work or os.path.join(out, "work"))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.makedirs(out, exist_ok=True)
    model = model_for(args)
    state = build_state(model, "cuda")
    nbytes = model.state_bytes()
    say(f"[gpu] {torch.cuda.get_device_name()}: state of {nbytes / 1e9:.2f} GB ({model.parameter_count() / 1e9:.2f}B parameters)")
    step = m.calibrated_step(args.step_ms / 1000)
    results = {} if results is None else results
    results.update({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": vars(model), "state_bytes": nbytes,
        "repeats": args.repeats, "step_iters": step.iters,
        "auto_choice": choose_snapshot("auto", cuda_bytes=nbytes, memory=device_memory(torch.device("cuda"))).reason,
    })
    for to in ("host", "device"):
        results[f"copy_{to}"] = m.measure_copy(state, to, args.repeats)
        say(f"[gpu] {'pinned D2H' if to == 'host' else 'D2D'} copy: {results[f'copy_{to}']['seconds']:.3f} s")
    # At most three checkpoints of the state are on disk at once: the host manager's last one
    # beside the device manager's two (keep_last=1 writes the next before deleting the last), or
    # beside a DCP one and the next.
    free, need = shutil.disk_usage(work).free, int(3.2 * nbytes)
    if free < need:
        raise SystemExit(f"benchmarks/gpu.py: {work} has {free / 1e9:.1f} GB free, the run needs about {need / 1e9:.1f} GB")
    for kind in ("host", "device"):
        try:
            results[f"ckptkit_{kind}"] = m.measure_manager(state, kind, os.path.join(work, f"ckptkit-{kind}"), step, args.repeats)
        except Exception as exc:  # e.g. a device snapshot that does not fit: reported
            results[f"ckptkit_{kind}"] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        block = results[f"ckptkit_{kind}"]
        held = f" (save() held the host {block['save_call_s']:.4f} s)" if "save_call_s" in block else ""
        say(f"[gpu] ckptkit {kind} snapshot: {_said(block, 'stall_s')}{held}")
    shutil.rmtree(os.path.join(work, "ckptkit-device"), ignore_errors=True)
    root = os.path.join(work, "ckptkit-host")  # its last checkpoint is the one loaded
    results["cold_read"] = m.cold_read(root, args.repeats)
    results["load_pool_bytes"] = m.load_pool_bytes()
    results["load_ckptkit"] = m.measure_load("ckptkit", root, state, args.repeats)
    say(f"[gpu] cold read {results['cold_read']['seconds']:.3f} s; ckptkit load: {_said(results['load_ckptkit'], 'seconds')}")
    if not args.skip_dcp:
        import torch.distributed.checkpoint as dcp

        dcp_path = os.path.join(work, "dcp-load")
        try:
            dcp.save(state, checkpoint_id=dcp_path, no_dist=True)
        except Exception as exc:  # as for the async_save variants: reported, not fatal
            results["load_dcp"] = {"unavailable": f"dcp.save failed: {type(exc).__name__}: {exc}".splitlines()[0]}
        else:
            results["load_dcp"] = m.measure_load("dcp", dcp_path, state, args.repeats)
        finally:
            shutil.rmtree(dcp_path, ignore_errors=True)
        say(f"[gpu] dcp load: {_said(results['load_dcp'], 'seconds')}")
        _dcp_saves(args, state, work, step, results, say)
    results["ratios"] = ratios(results)
    results["targets"] = targets(results["ratios"])
    return results


def _dcp_saves(args: argparse.Namespace, state: dict[str, Any], work: str, step: Any, results: dict[str, Any], say: Any) -> None:
    """DCP's async_save variants, last, each within `args.dcp_deadline`: a stager that hangs (seen
    with torch 2.11) is reported and leaves what was measured before it; the variants after it are
    skipped (it still holds its copies of the state, which would skew them)."""
    from benchmarks import gpu_measure as m

    for i, variant in enumerate(m.DCP_VARIANTS):
        if m.LEFT_BEHIND:
            results[f"dcp {variant}"] = {"error": "skipped: an earlier DCP variant is still running"}
        else:
            measure = functools.partial(m.measure_dcp, state, variant, os.path.join(work, f"dcp-save-{i}"), step, args.repeats)
            results[f"dcp {variant}"] = m.within(args.dcp_deadline, lambda progress, measure=measure: measure(progress=progress))
        say(f"[gpu] dcp async_save, {variant}: {_said(results[f'dcp {variant}'], 'stall_s')}")


def _said(block: dict[str, Any], key: str) -> str:
    if key in block:
        return f"{block[key]:.3f} s"
    return f"FAILED: {block.get('error') or block.get('unavailable')}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(r: dict[str, Any]) -> dict[str, float | None]:
    """Every ratio the report prints, from the medians of one run (None where a side is missing)."""
    d2h, d2d = r["copy_host"]["seconds"], r["copy_device"]["seconds"]
    out: dict[str, float | None] = {}
    for kind in ("host", "device"):
        stall = r[f"ckptkit_{kind}"].get("stall_s")
        out[f"{kind}_stall_vs_d2h"] = _ratio(stall, d2h)
        out[f"{kind}_stall_vs_d2d"] = _ratio(stall, d2d)
        out[f"{kind}_slowdown"] = r[f"ckptkit_{kind}"].get("slowdown")
        for key, block in r.items():
            if key.startswith("dcp "):
                out[f"{kind}_stall_vs_{key}"] = _ratio(stall, block.get("stall_s"))
    load = r["load_ckptkit"].get("seconds")
    out["load_vs_cold_read"] = _ratio(r["cold_read"]["seconds"], load)  # a speed: above 1 is faster than the read
    out["load_vs_dcp_load"] = _ratio(r.get("load_dcp", {}).get("seconds"), load)
    out["load_host_vs_pool"] = _ratio(r["load_ckptkit"].get("host_peak_added_bytes"), r.get("load_pool_bytes"))
    return out


def targets(ratios_: dict[str, float | None]) -> list[dict[str, Any]]:
    out = []
    for name, key, op, bound in TARGETS:
        value = ratios_.get(key)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out.append({"target": name, "measured": value, "met": met})
    return out


def render(r: dict[str, Any]) -> str:
    """The report: the measurements, the ratios, the targets."""
    gb = 1e9
    lines = [
        f"GPU benchmark on {r['device']} (torch {r['torch']}): state {r['state_bytes'] / gb:.2f} GB "
        f"(Llama hidden {r['model']['hidden']}, {r['model']['layers']} layers; bf16 parameters, fp32 masters and Adam moments), "
        f"medians of {r['repeats']}",
        f"snapshot='auto' here: {r['auto_choice']}",
        "",
        f"{'save':<58} {'stall s':>9} {'/D2H':>7} {'/D2D':>7} {'slowdown':>9} {'host +GB':>9}",
        f"{'pinned D2H copy of the state':<58} {r['copy_host']['seconds']:>9.3f}",
        f"{'D2D copy of the state':<58} {r['copy_device']['seconds']:>9.3f}",
    ]
    d2h, d2d = r["copy_host"]["seconds"], r["copy_device"]["seconds"]
    tools = [(f"ckptkit, snapshot='{k}'", r[f"ckptkit_{k}"]) for k in ("host", "device")]
    tools += [(f"dcp async_save, {k[4:]}", v) for k, v in r.items() if k.startswith("dcp ")]
    for name, block in tools:
        if "stall_s" not in block:
            lines.append(f"{name:<58} FAILED: {block.get('error')}")
            continue
        slow = "-" if block["slowdown"] is None else f"{block['slowdown']:+.1%}"
        lines.append(f"{name:<58} {block['stall_s']:>9.3f} {block['stall_s'] / d2h:>7.2f} {block['stall_s'] / d2d:>7.2f} "
                     f"{slow:>9} {block['host_peak_added_bytes'] / gb:>9.2f}")
    lines += _save_calls(r)
    lines += ["", f"{'load into CUDA tensors (cold)':<58} {'seconds':>9} {'speed /read':>11} {'host +GB':>9}",
              f"{'cold read of the same bytes':<58} {r['cold_read']['seconds']:>9.3f}"]
    for name, key in (("ckptkit.load", "load_ckptkit"), ("dcp load", "load_dcp")):
        block = r.get(key)
        if block is None:
            continue
        if "seconds" not in block:
            lines.append(f"{name:<58} unavailable: {block.get('unavailable')}")
            continue
        lines.append(f"{name:<58} {block['seconds']:>9.3f} {r['cold_read']['seconds'] / block['seconds']:>11.2f} "
                     f"{block['host_peak_added_bytes'] / gb:>9.2f}")
    if r.get("load_pool_bytes"):
        lines.append(f"(ckptkit.load's pinned bounce pool: {r['load_pool_bytes'] / gb:.2f} GB)")
    lines += ["", "ratios (this run):"]
    lines += [f"  {k:<60} {'-' if v is None else f'{v:.3f}'}" for k, v in r["ratios"].items()]
    lines += ["", "targets:"]
    for t in r["targets"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "MISSED")
        value = "-" if t["measured"] is None else f"{t['measured']:.3f}"
        lines.append(f"  {t['target']:<70} {value:>8}  {verdict}")
    return "\n".join(lines)


def _save_calls(r: dict[str, Any]) -> list[str]:
    """How long each snapshot kind's save() held the host, and what one device-snapshot save
    spent its host time on (torch.profiler), where measured."""
    lines = []
    for kind in ("host", "device"):
        block = r.get(f"ckptkit_{kind}", {})
        if "save_call_s" in block:
            lines.append(f"  save() itself held the host: {block['save_call_s']:.4f} s ({kind} snapshots, median)")
    profile = r.get("ckptkit_device", {}).get("profile")
    if profile:
        lines.append("  one device-snapshot save, torch.profiler, the operations with the most host time:")
        lines += [f"    {row['op'][:60]:<60} x{row['calls']:<5} host {row['cpu_total_ms']:8.3f} ms  device {row['device_total_ms']:8.3f} ms"
                  for row in profile]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = cuda_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return NO_CUDA_EXIT
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "gpu-results.json")
    results: dict[str, Any] = {}
    work = os.path.abspath(args.work or os.path.join(out, "work"))
    # A stage's time limit ends it with SIGTERM: exit through the handler below, which keeps
    # what was measured. Each measurement is written as it is said, too.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    def say(line: str) -> None:
        _write(path, results)
        print(line, file=sys.stderr, flush=True)

    try:
        run(args, say, results)
    except BaseException as exc:  # keep what was measured, then fail as before
        results["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        _write(path, results)
        print(f"benchmarks/gpu.py: the run failed ({results['error']}); the results so far are in {path}", file=sys.stderr)
        code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        _exit_if_left_behind(code, work)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(work, ignore_errors=True)
    _write(path, results)
    print(render(results))
    print(f"\nresults: {path}")
    _exit_if_left_behind(0, work)
    return 0


def _exit_if_left_behind(status: int, work: str) -> None:
    """End the process now with `status` (its scratch `work` removed) if a measurement was left
    running in a thread (a hung DCP save): its tool's worker threads would keep the interpreter
    from exiting. Everything has been written by then."""
    from benchmarks import gpu_measure

    if gpu_measure.LEFT_BEHIND:
        shutil.rmtree(work, ignore_errors=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _write(path: str, results: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
