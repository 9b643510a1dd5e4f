#!/usr/bin/env bash
# FP32 LM-head logits into Megatron-LM's own loss_func: the default output layer
# (megatron-core's ColumnParallelLinear); any TP size, tied or untied embeddings.
set -euo pipefail
source "$(dirname "$0")/cpu_flags.sh"
MEGAPATCH_LOGITS_DTYPE=fp32 \
torchrun --standalone --nproc-per-node 2 -m megapatch.testing.ranks.cpu_launch pretrain_gpt.py \
  "${MODEL[@]}" "${CPU_ONLY[@]}" --tensor-model-parallel-size 2 "$@"
