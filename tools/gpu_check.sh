#!/usr/bin/env bash
# The GPU check (tools/gpu_check.py) on a device machine that has its own CUDA torch and no network.
#   bash tools/gpu_check.sh fetch   # here: the wheels it carries into .gpu-wheels/ (megatron-core 0.16.1
#                                   # and wrapt for CPython 3.11 and 3.12, packaging, megapatch; ~6 MB)
#   bash tools/gpu_check.sh run     # there: a venv over the image's torch, the wheels, then the check;
#                                   # reports in $OUT (the device tool's output folder) or ./gpu_check_out
# With the device tool: run(command="bash tools/gpu_check.sh run", carry=[".gpu-wheels"], timeout_s=540).
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
    venv=/tmp/megapatch-gpu-check-venv
    rm -rf "$venv" && "$python" -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q --no-index --no-deps "$wheels"/megatron_core-*-"$tag"-*.whl \
      "$wheels"/wrapt-*-"$tag"-*.whl "$wheels"/packaging-*.whl "$wheels"/megapatch-*.whl
    out=${OUT:-gpu_check_out}
    "$venv/bin/python" tools/gpu_check.py --out "$out" || echo "gpu_check: a section failed (see $out/gpu_check.md)"
    cat "$out/gpu_check.md" ;;
  *) echo "usage: bash tools/gpu_check.sh fetch|run" >&2; exit 2 ;;
esac
