#!/usr/bin/env bash
# benchmarks/gpu_check.py on a GPU machine that has Python 3.12 and torch but no network (issue 22, item 6).
#
# What it needs beyond that machine's packages travels with the working tree, in .gpucarry/ (ignored by git):
# the gguf wheel (pure Python; `pip download`ed here for cp312) and SmolLM2's 98 MB GGUF, which is over the
# 64 MiB a device call carries (the tracked tree counts too), so it goes in two halves on two calls to the same
# warm machine:
#
#   here:        bash benchmarks/gpu_check.sh prepare            # .gpucarry/{whl,gguf-a,gguf-b}, ~100 MB; then
#                                                                # `sizes`: each call's payload under 64 MiB
#   device call: bash benchmarks/gpu_check.sh stage-a            # carry [".gpucarry/gguf-a"]; seconds
#   device call: bash benchmarks/gpu_check.sh run                # carry [".gpucarry/whl", ".gpucarry/gguf-b"],
#                                                                # within the machine's warm window after stage-a
#
# stage-a copies the first half out of the tree (to $GPUCHECK_STAGE, /tmp/kvbaton-gpucheck), where the second call
# finds it on the same machine whatever that call carries. `run [ARGS]` joins the halves (`join`: checked against
# the GGUF's sha256), installs the wheels under /tmp/site with --no-index where gguf is missing, and runs the check
# with ARGS, writing $OUT/gpu_check.json (and its log). Without the first half on the machine (a fresh machine: the
# warm window missed) it runs anyway: the SmolLM2 parity is reported as skipped, and the 1P1D pair uses a
# random-weight SmolLM2-shaped model. tests/bench/test_gpu_check_carry.py plays both calls here, on the CPU.
#
# Settings (environment): GPUCARRY (the carry folder, default .gpucarry), GPUCHECK_STAGE, GGUF (the file
# prepare-gguf splits, default the installed SmolLM2), PYTHON (the interpreter `run` uses, default python3).
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
CARRY=${GPUCARRY:-.gpucarry}
STAGE=${GPUCHECK_STAGE:-/tmp/kvbaton-gpucheck}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
CARRY_LIMIT=$(( 64 * 1024 * 1024 ))  # what one device call carries: tracked + untracked-not-ignored + carried
PY=${PYTHON:-python3}
VENV_PY=${VENV_PY:-.venv/bin/python}
[ -x "$VENV_PY" ] || VENV_PY=/work/main/.venv/bin/python

bytes_of() {  # the bytes of the files under each path given (0 for a path that is not there)
    { find "$@" -type f -printf '%s\n' 2>/dev/null || true; } | awk '{ s += $1 } END { print s + 0 }'
}

tree_bytes() {  # what every call sends: the tracked files and the untracked ones git does not ignore
    { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null || true; } \
        | awk '{ s += $1 } END { print s + 0 }'
}

join_gguf() {  # prints the joined GGUF's path, or nothing (and why, on stderr)
    if [ ! -f "$STAGE/part-a" ]; then
        echo "gpu_check.sh: no first GGUF half on this machine (stage-a not run on it): SmolLM2 skipped" >&2
        return 0
    fi
    if [ ! -f "$CARRY/gguf-b/part" ] || [ ! -f "$CARRY/gguf-b/sha256" ]; then
        echo "gpu_check.sh: no second GGUF half carried ($CARRY/gguf-b): SmolLM2 skipped" >&2
        return 0
    fi
    cat "$STAGE/part-a" "$CARRY/gguf-b/part" > "$STAGE/$GGUF_NAME"
    if [ "$(sha256sum "$STAGE/$GGUF_NAME" | cut -d' ' -f1)" != "$(cat "$CARRY/gguf-b/sha256")" ]; then
        echo "gpu_check.sh: the joined GGUF does not match its sha256: SmolLM2 skipped" >&2
        rm -f "$STAGE/$GGUF_NAME"
        return 0
    fi
    echo "$STAGE/$GGUF_NAME"
}

case "${1:-}" in
prepare)
    bash "$SELF" prepare-wheel
    bash "$SELF" prepare-gguf
    ;;
prepare-wheel)
    mkdir -p "$CARRY/whl"
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$CARRY/whl" gguf==0.19.0
    ;;
prepare-gguf)
    mkdir -p "$CARRY/gguf-a" "$CARRY/gguf-b"
    gguf=${GGUF:-$("$VENV_PY" -c "from kvbaton.model.registry import smollm2_gguf_path; print(smollm2_gguf_path())")}
    size=$(stat -c %s "$gguf")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$gguf" > "$CARRY/gguf-a/part"
    tail -c +"$(( half + 1 ))" "$gguf" > "$CARRY/gguf-b/part"
    sha256sum "$gguf" | cut -d' ' -f1 > "$CARRY/gguf-b/sha256"
    bash "$SELF" sizes
    ;;
sizes)
    tree=$(tree_bytes)
    status=0
    for call in "stage-a:$CARRY/gguf-a" "run:$CARRY/whl $CARRY/gguf-b"; do
        name=${call%%:*}
        # shellcheck disable=SC2086 # the carried paths, split on purpose
        total=$(( tree + $(bytes_of ${call#*:}) ))
        verdict=ok
        [ "$total" -le "$CARRY_LIMIT" ] || { verdict=OVER; status=1; }
        echo "gpu_check.sh: the $name call carries $total bytes of $CARRY_LIMIT ($verdict; tree $tree)"
    done
    exit "$status"
    ;;
stage-a)
    mkdir -p "$STAGE"
    cp "$CARRY/gguf-a/part" "$STAGE/part-a"
    ls -la "$STAGE"
    ;;
join)
    join_gguf
    ;;
run)
    shift
    mkdir -p "$STAGE" "${OUT:-/tmp}"
    gguf=$(join_gguf)
    gguf_args=()
    [ -z "$gguf" ] || gguf_args=(--smollm2-gguf "$gguf")
    if ! "$PY" -c "import gguf" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$CARRY"/whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
    PYTHONUNBUFFERED=1 timeout 480 "$PY" benchmarks/gpu_check.py "${gguf_args[@]}" "$@" \
        --out "${OUT:-/tmp}/gpu_check.json" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
    ;;
*)
    echo "usage: $0 prepare | prepare-wheel | prepare-gguf | sizes | stage-a | join | run [gpu_check.py ARGS]" >&2
    exit 2
    ;;
esac
