#!/usr/bin/env bash
# benchmarks/gpu_check.py on a GPU machine that has Python 3.12 and torch but no network (issue 22, item 6).
#
# What it needs beyond that machine's packages travels with the working tree, in .gpucarry/ (ignored by git):
# the gguf wheel (pure Python; `pip download`ed here for cp312) and SmolLM2's 98 MB GGUF, which is over the
# 64 MiB a device call carries, so it goes in two halves on two calls to the same warm machine:
#
#   here:        bash benchmarks/gpu_check.sh prepare            # .gpucarry/{whl,gguf-a,gguf-b}, ~100 MB
#   device call: bash benchmarks/gpu_check.sh stage-a            # carry [".gpucarry/gguf-a"]; seconds
#   device call: bash benchmarks/gpu_check.sh run                # carry [".gpucarry/whl", ".gpucarry/gguf-b"],
#                                                                # within the machine's warm window after stage-a
#
# `run` joins the halves (checked against the GGUF's sha256), installs the wheels under /tmp/site with
# --no-index, and runs the check, writing $OUT/gpu_check.json (and its log). Without the first half on the
# machine it runs anyway: the SmolLM2 parity is reported as skipped, and the 1P1D pair uses a random-weight
# SmolLM2-shaped model.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpucarry
STAGE=/tmp/kvbaton-gpucheck
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}

case "${1:-}" in
prepare)
    VENV_PY=${VENV_PY:-.venv/bin/python}
    [ -x "$VENV_PY" ] || VENV_PY=/work/main/.venv/bin/python
    mkdir -p "$CARRY/whl" "$CARRY/gguf-a" "$CARRY/gguf-b"
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$CARRY/whl" gguf==0.19.0
    gguf=$("$VENV_PY" -c "from kvbaton.model.registry import smollm2_gguf_path; print(smollm2_gguf_path())")
    size=$(stat -c %s "$gguf")
    half=$(( (size + 1) / 2 ))
    head -c "$half" "$gguf" > "$CARRY/gguf-a/part"
    tail -c +"$(( half + 1 ))" "$gguf" > "$CARRY/gguf-b/part"
    sha256sum "$gguf" | cut -d' ' -f1 > "$CARRY/gguf-b/sha256"
    du -sh "$CARRY"/*
    ;;
stage-a)
    mkdir -p "$STAGE"
    cp "$CARRY/gguf-a/part" "$STAGE/part-a"
    ls -la "$STAGE"
    ;;
run)
    mkdir -p "$STAGE" "${OUT:-/tmp}"
    gguf_args=()
    if [ -f "$STAGE/part-a" ] && [ -f "$CARRY/gguf-b/part" ]; then
        cat "$STAGE/part-a" "$CARRY/gguf-b/part" > "$STAGE/$GGUF_NAME"
        if [ "$(sha256sum "$STAGE/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat "$CARRY/gguf-b/sha256")" ]; then
            gguf_args=(--smollm2-gguf "$STAGE/$GGUF_NAME")
        else
            echo "gpu_check.sh: the joined GGUF does not match its sha256: SmolLM2 skipped" >&2
        fi
    else
        echo "gpu_check.sh: no first GGUF half on this machine (stage-a not run on it): SmolLM2 skipped" >&2
    fi
    if ! "$PY" -c "import gguf" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$CARRY"/whl/*.whl
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    set -o pipefail
    PYTHONUNBUFFERED=1 timeout 480 "$PY" benchmarks/gpu_check.py "${gguf_args[@]}" --out "${OUT:-/tmp}/gpu_check.json" \
        2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
    ;;
*)
    echo "usage: $0 prepare | stage-a | run" >&2
    exit 2
    ;;
esac
