#!/usr/bin/env bash
# FP32 tensor-parallel reductions: needs TP > 1 (--tensor-model-parallel-size). On GPUs add
# --sequence-parallel if you use it (its reduce-scatters are covered too; on CPU the local layer
# spec refuses it with torch's LayerNorm).
# MEGAPATCH_TP_REDUCE_DTYPE: native | fp32 | fp32-accumulate
set -euo pipefail
source "$(dirname "$0")/cpu_flags.sh"
MEGAPATCH_TP_REDUCE_DTYPE="${MEGAPATCH_TP_REDUCE_DTYPE:-fp32}" \
torchrun --standalone --nproc-per-node 2 -m megapatch.testing.ranks.cpu_launch pretrain_gpt.py \
  "${MODEL[@]}" "${CPU_ONLY[@]}" --tensor-model-parallel-size 2 "$@"
