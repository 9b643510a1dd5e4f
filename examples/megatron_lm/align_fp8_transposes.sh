#!/usr/bin/env bash
# Pipeline-aligned FP8 transposes: interleaved pipeline (PP > 1 with virtual stages), the
# distributed optimizer with overlapped param all-gather (align_param_gather is Megatron-LM's
# default there). On GPUs with Transformer Engine add your FP8 flags, e.g.
#   --transformer-impl transformer_engine --fp8-format hybrid --fp8-param-gather
# On CPU there are no FP8 parameters: the job log says the alignment passes through, and why.
set -euo pipefail
source "$(dirname "$0")/cpu_flags.sh"
MEGAPATCH_ALIGN_FP8_TRANSPOSES=1 \
torchrun --standalone --nproc-per-node 2 -m megapatch.testing.ranks.cpu_launch pretrain_gpt.py \
  "${MODEL[@]}" "${CPU_ONLY[@]}" --pipeline-model-parallel-size 2 \
  --num-layers-per-virtual-pipeline-stage 1 \
  --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce "$@"
