"""The GPU benchmark and its check script, where they can be checked without a GPU: the state's
sizing, the ratios and targets from a run's numbers, and a clean exit without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from benchmarks.gpu_state import BYTES_PER_PARAM, DEFAULT_BYTES, SMALL_BYTES, build_state, llama_for, tensors_of

ROOT = Path(__file__).resolve().parents[2]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def test_the_state_comes_near_the_requested_size_with_14_bytes_a_parameter() -> None:
    for target, small in ((DEFAULT_BYTES, False), (SMALL_BYTES, True), (3 * 10**9, False)):
        model = llama_for(target, small=small)
        assert abs(model.state_bytes() - target) / target < 0.06
        assert model.state_bytes() == model.parameter_count() * BYTES_PER_PARAM
    state = build_state(llama_for(1, small=True), "cpu")
    dtypes = {k: {t.dtype for t in tensors_of(v)} for k, v in state.items()}
    assert dtypes == {"model": {torch.bfloat16}, "optimizer": {torch.float32}}
    assert set(state["optimizer"]) == {"master", "exp_avg", "exp_avg_sq"}
    assert sum(t.numel() * t.element_size() for t in tensors_of(state)) == llama_for(1, small=True).state_bytes()


def _results() -> dict:
    stall = {"stall_s": 0.30, "first_stall_s": 2.0, "all_stall_s": [2.0, 0.3], "slowdown": 0.01,
             "host_peak_added_bytes": 10**9, "first_host_peak_added_bytes": 8 * 10**9}
    return {
        "device": "GPU", "torch": "x", "model": {"hidden": 512, "layers": 10}, "state_bytes": 5 * 10**8, "repeats": 2,
        "auto_choice": "snapshot='auto': ...", "copy_host": {"seconds": 0.30}, "copy_device": {"seconds": 0.01},
        "ckptkit_host": {**stall, "stall_s": 0.3075}, "ckptkit_device": {**stall, "stall_s": 0.03, "slowdown": None},
        "dcp defaults": {**stall, "stall_s": 0.9}, "dcp DefaultStager(pinned)": {"error": "RuntimeError: no"},
        "cold_read": {"seconds": 1.0}, "load_pool_bytes": 2 * 10**9,
        "load_ckptkit": {"unavailable": "TypeError: no CUDA targets"}, "load_dcp": {"seconds": 2.0, "host_peak_added_bytes": 10**9},
    }


def test_ratios_and_targets_come_from_the_run_and_missing_sides_are_not_applicable() -> None:
    results = _results()
    results["ratios"] = ratios = gpu.ratios(results)
    assert ratios["host_stall_vs_d2h"] == pytest.approx(1.025) and ratios["device_stall_vs_d2d"] == pytest.approx(3.0)
    assert ratios["host_stall_vs_dcp defaults"] == pytest.approx(0.3075 / 0.9)
    assert ratios["host_stall_vs_dcp DefaultStager(pinned)"] is None and ratios["load_vs_cold_read"] is None
    results["targets"] = targets = gpu.targets(ratios)
    met = {t["target"].split(" <=")[0].split(" >=")[0]: t["met"] for t in targets}
    assert met["host-snapshot stall"] is True and met["device-snapshot stall"] is False and met["load"] is None
    report = gpu.render(results)
    assert "FAILED: RuntimeError: no" in report and "unavailable: TypeError: no CUDA targets" in report
    assert "MISSED" in report and "n/a" in report


@no_cuda
@pytest.mark.parametrize("how", [["benchmarks/gpu.py"], ["-m", "benchmarks.gpu", "--small"]])
def test_the_benchmark_exits_2_with_one_line_without_cuda(how: list[str]) -> None:
    proc = subprocess.run([sys.executable, *how], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1 and "no CUDA device" in proc.stderr


@no_cuda
def test_the_check_script_exits_2_with_one_line_without_cuda(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "WHEELS": str(tmp_path / "none")}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == "" and proc.stdout.splitlines() == [
        "gpu_check: no CUDA device here: nothing checked (the gpu tests skip and the benchmark needs one)"
    ]
    assert not (tmp_path / "out" / "status.txt").exists()


def test_the_benchmark_creates_its_out_folder_and_writes_the_results_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(args: object, say: object, results: dict) -> dict:
        results.update(_results())
        results["ratios"] = gpu.ratios(results)
        results["targets"] = gpu.targets(results["ratios"])
        return results

    monkeypatch.setattr(gpu, "cuda_problem", lambda: None)
    monkeypatch.setattr(gpu, "run", run)
    out = tmp_path / "out" / "small"  # --work elsewhere: nothing makes <out> but the benchmark
    assert gpu.main(["--small", "--out", str(out), "--work", str(tmp_path / "work" / "small")]) == 0
    assert json.loads((out / "gpu-results.json").read_text())["ratios"]["host_stall_vs_d2h"] == pytest.approx(1.025)
    assert "targets:" in capsys.readouterr().out


def test_a_failing_run_still_writes_what_it_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(args: object, say: object, results: dict) -> dict:
        results["copy_host"] = {"seconds": 0.3}
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(gpu, "cuda_problem", lambda: None)
    monkeypatch.setattr(gpu, "run", run)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        gpu.main(["--out", str(out), "--work", str(tmp_path / "work")])
    written = json.loads((out / "gpu-results.json").read_text())
    assert written == {"copy_host": {"seconds": 0.3}, "error": "RuntimeError: CUDA error: out of memory"}


_STOPPED_RUN = """
import sys, time
from benchmarks import gpu

def run(args, say, results):
    results["copy_host"] = {"seconds": 0.3}
    say("[gpu] measured one")
    time.sleep(60)

gpu.cuda_problem = lambda: None
gpu.run = run
sys.exit(gpu.main(["--out", sys.argv[1], "--work", sys.argv[2]]))
"""


def test_a_run_stopped_by_sigterm_exits_143_keeping_what_it_measured(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_RUN, str(out), str(tmp_path / "work")], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    assert proc.stderr.readline() == "[gpu] measured one\n"  # written, then said, once measured
    assert json.loads((out / "gpu-results.json").read_text()) == {"copy_host": {"seconds": 0.3}}
    proc.terminate()  # what a stage's time limit sends
    rest = proc.stderr.read()
    assert proc.wait(timeout=30) == 143, rest
    assert json.loads((out / "gpu-results.json").read_text()) == {"copy_host": {"seconds": 0.3}, "error": "SystemExit: 143"}


def test_the_check_script_refuses_an_unknown_stage_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "tests", "big"], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout.splitlines() == ["gpu_check: unknown stage 'big' (the stages are tests, small and full; none: all three)"]
    assert not (tmp_path / "out").exists()


def test_a_measurement_past_its_deadline_is_reported_with_where_it_stuck_and_the_run_goes_on() -> None:
    from benchmarks import gpu_measure
    from benchmarks.gpu_measure import within

    release = threading.Event()

    def hangs(progress: dict[str, str]) -> dict:
        release.wait(30)
        return {"stall_s": 1.0}

    reached = {"at": "save 2 of 3: staging_completion"}  # where the measurement got to, as it would say
    try:
        assert within(0.2, hangs, reached) == {"error": "did not finish within 0.2 s (stuck at: save 2 of 3: staging_completion)",
                                               "timed_out": True}
        assert gpu_measure.LEFT_BEHIND and gpu_measure.LEFT_BEHIND[-1].is_alive()
    finally:
        release.set()
        gpu_measure.LEFT_BEHIND.clear()
    assert within(30, lambda progress: {"stall_s": 0.5}) == {"stall_s": 0.5}
    assert within(30, lambda progress: 1 / 0) == {"error": "ZeroDivisionError: division by zero"}


def test_the_report_shows_how_long_save_held_the_host_and_the_profiled_save() -> None:
    results = _results()
    results["ckptkit_device"] = {**results["ckptkit_device"], "save_call_s": 0.0061,
                                 "profile": [{"op": "aten::copy_", "calls": 48, "cpu_total_ms": 1.5, "device_total_ms": 4.4}]}
    results["ratios"] = gpu.ratios(results)
    results["targets"] = gpu.targets(results["ratios"])
    report = gpu.render(results)
    assert "save() itself held the host: 0.0061 s (device snapshots, median)" in report
    assert "aten::copy_" in report and "x48" in report and "device    4.400 ms" in report


def test_dcp_variants_after_one_left_running_are_skipped_not_measured_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from argparse import Namespace

    from benchmarks import gpu_measure

    monkeypatch.setattr(gpu_measure, "LEFT_BEHIND", [threading.Thread(target=lambda: None)])
    monkeypatch.setattr(gpu_measure, "measure_dcp", lambda *a, **k: pytest.fail("measured beside a variant left running"))
    results: dict = {}
    said: list[str] = []
    gpu._dcp_saves(Namespace(dcp_deadline=1.0, repeats=1), {}, "/nonexistent", None, results, said.append)
    assert results == {f"dcp {v}": {"error": "skipped: an earlier DCP variant is still running"} for v in gpu_measure.DCP_VARIANTS}
    assert len(said) == len(gpu_measure.DCP_VARIANTS)
