#!/usr/bin/env bash
# The GPU check, in one run on a machine with torch+CUDA: the tests marked gpu, then the GPU
# benchmark with a small state, then with the full one. Outputs go under $OUT (default
# bench-out/gpu-check): pytest.log, small.txt, small/gpu-results.json, full.txt,
# full/gpu-results.json, status.txt (each stage's exit status and wall time), import.log: at most
# seven files (those of the stages run), no log over 4 MiB (a longer one keeps its last 4 MiB;
# the JSON files are a few KB), small enough to copy back from a remote machine. Exit status: 0 when every stage passed, 1 when
# one failed, 2 without a CUDA device (nothing run).
#
# The GPU machine has torch but not all of ckptkit's dependencies, and no package index:
#   here, once:   benchmarks/gpu_check.sh --fetch-wheels   (downloads them into .whl/, git-ignored)
#   there:        bash benchmarks/gpu_check.sh             (with .whl carried beside the tree)
# Stages: `bash benchmarks/gpu_check.sh [tests] [small] [full]` runs those named (none: all
# three, about 570 s at their limits). Where GPU time is short, run `tests small` (at most
# about 250 s) in one command and `full` in another, so that a failed first one leaves time to
# run it again.
# Settings (environment): PYTHON (python3), OUT, WHEELS (.whl), WORK (scratch for checkpoints,
# /tmp/ckptkit-gpu-work), TESTS_S, SMALL_S, FULL_S (time limits of the stages: 120, 120, 300; 540 s in all, under
# ten minutes), FULL_ARGS (--repeats 2 --skip-dcp).
# The full stage measures 3 saves per snapshot kind and 2 cold reads and loads of the ~7.5 GB
# state, and leaves DCP out: with DCP (12 more saves of 7.5 GB) and 3 repeats it needs well over
# 300 s. DCP is compared in the small stage; for DCP at the full size, run
# `python benchmarks/gpu.py --repeats 2` on its own, in a run of its own.
set -u
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench-out/gpu-check}
WHEELS=${WHEELS:-.whl}
WORK=${WORK:-/tmp/ckptkit-gpu-work}
# ckptkit's dependencies that the GPU machine's image lacks (it has torch, numpy, ml_dtypes,
# click, xxhash, safetensors, psutil, pytest), at the versions of the development environment.
MISSING="pydantic pydantic_core annotated_types typing_inspection typing_extensions"

fetch_wheels() {
    local py=${FETCH_PYTHON:-.venv/bin/python} specs="" name version
    for name in $MISSING; do
        version=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name") || {
            echo "gpu_check: $name is not installed in $py: cannot pin its version"; return 1; }
        specs="$specs $name==$version"
    done
    mkdir -p "$WHEELS"
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >>"$exclude"
    # shellcheck disable=SC2086
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $specs && echo "gpu_check: wheels in $WHEELS/:$specs"
}

if [ "${1:-}" = "--fetch-wheels" ]; then
    fetch_wheels
    exit $?
fi
STAGES=${*:-all}
for name in $STAGES; do
    case $name in
        all | tests | small | full) ;;
        *) echo "gpu_check: unknown stage '$name' (the stages are tests, small and full; none: all three)"; exit 2 ;;
    esac
done

mkdir -p "$OUT"
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu_check: $PYTHON has no torch: nothing checked (the check needs torch with CUDA and a CUDA device)"
    exit 2
fi
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 2)"; then
    echo "gpu_check: no CUDA device here: nothing checked (the gpu tests skip and the benchmark needs one)"
    exit 2
fi
export PYTHONPATH="$ROOT:$ROOT/converters${PYTHONPATH:+:$PYTHONPATH}"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ckptkit-site \
        "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels of $WHEELS/ failed"; exit 1; }
    export PYTHONPATH="/tmp/ckptkit-site:$PYTHONPATH"
fi
if ! "$PYTHON" -c "import torch, ckptkit.writer.manager" 2>"$OUT/import.log"; then
    echo "gpu_check: ckptkit does not import with $PYTHON ($(tail -n 1 "$OUT/import.log")); run benchmarks/gpu_check.sh --fetch-wheels where pip works and carry $WHEELS"
    exit 1
fi

export PYTHONUNBUFFERED=1
failed=0
stage() {  # stage NAME LIMIT_S LOG COMMAND...: run one stage, record its status
    local name=$1 limit=$2 log=$3 rc start=$SECONDS
    shift 3
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    echo "$name: exit $rc$([ $rc = 124 ] && echo " (over its ${limit}s limit)") in $((SECONDS - start)) s" | tee -a "$OUT/status.txt"
    [ $rc = 0 ] || failed=1
    shrink "$log"
}
shrink() {  # shrink FILE: keep the last 4 MiB of a longer file (remote runs may copy back only small files)
    local size
    size=$(wc -c <"$1" 2>/dev/null) || return 0
    [ "$size" -le $((4 << 20)) ] && return 0
    { echo "[gpu_check: $size bytes; only the last 4 MiB kept]"; tail -c $((4 << 20)) "$1"; } >"$1.tmp" && mv "$1.tmp" "$1"
}
: >"$OUT/status.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$OUT/status.txt" 2>&1
# The test files with gpu tests, so that no other file's missing dependency stops the collection.
mapfile -t gpu_tests < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include='*.py' | sort)
wants() { [ "$STAGES" = all ] || [[ " $STAGES " == *" $1 "* ]]; }
if wants tests; then
    stage "pytest -m gpu" "${TESTS_S:-120}" "$OUT/pytest.log" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider --tb=short "${gpu_tests[@]}"
fi
rm -rf "$WORK"
if wants small; then
    stage "benchmark --small" "${SMALL_S:-120}" "$OUT/small.txt" "$PYTHON" benchmarks/gpu.py --small --repeats 3 --dcp-deadline 25 --out "$OUT/small" --work "$WORK/small"
fi
rm -rf "$WORK"
if wants full; then
    # shellcheck disable=SC2086
    stage "benchmark (full)" "${FULL_S:-300}" "$OUT/full.txt" "$PYTHON" benchmarks/gpu.py ${FULL_ARGS:---repeats 2 --skip-dcp} --out "$OUT/full" --work "$WORK/full"
fi
rm -rf "$WORK"
exit $failed
