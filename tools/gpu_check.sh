#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py) on a device machine that has its own CUDA torch and no network.
#   bash tools/gpu_check.sh fetch   # here: the wheels it carries into .gpu-wheels/ (megatron-core 0.16.1
#                                   # and wrapt for CPython 3.11 and 3.12, packaging, megapatch; ~6 MB)
#   bash tools/gpu_check.sh run     # there: the wheels on PYTHONPATH over the image's torch, then the check;
#                                   # reports in $OUT (the device tool's output folder) or ./gpu_check_out
# With the device tool: run(command="bash tools/gpu_check.sh run", carry=[".gpu-wheels"], timeout_s=360).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=.gpu-wheels
case "${1:-}" in
  fetch)
    rm -rf "$wheels" && mkdir -p "$wheels"
    for py in 3.11 3.12; do
      pip download -q --no-deps --only-binary=:all: --python-version "$py" --platform manylinux_2_28_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$wheels" \
        megatron-core==0.16.1 "wrapt>=2.0" "packaging>=23"
    done
    pip wheel -q --no-deps -w "$wheels" .
    ls -la "$wheels" ;;
  run)
    python=${PYTHON:-python3}
    tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    "$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    # into a folder on PYTHONPATH, not a venv: the image's python3 is itself a venv, and a venv made
    # from it with --system-site-packages would see the base interpreter's packages, not its torch
    site=/tmp/megapatch-gpu-check-site
    rm -rf "$site" && "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      "$wheels"/megatron_core-*-"$tag"-*.whl "$wheels"/wrapt-*-"$tag"-*.whl "$wheels"/packaging-*.whl \
      "$wheels"/megapatch-*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    out=${OUT:-gpu_check_out}
    mkdir -p "$out"
    PYTHONUNBUFFERED=1 "$python" tools/gpu_check.py --out "$out" "${@:2}" >"$out/gpu_check.log" 2>&1 \
      || echo "gpu_check: a section failed (see $out/gpu_check.md; the whole log: $out/gpu_check.log)"
    grep '^gpu_check:' "$out/gpu_check.log" || tail -40 "$out/gpu_check.log"
    cat "$out/gpu_check.md" ;;
  *) echo "usage: bash tools/gpu_check.sh fetch|run" >&2; exit 2 ;;
esac
