#!/usr/bin/env bash
# Mutation testing of the numerics and consistency code with cosmic-ray (results/mutation.md).
#
#   pip install cosmic-ray==8.7.0        # any interpreter; COSMIC_RAY_PY names it
#   tools/mutation.sh [MODULE ...]       # default: every module below
#
# Each module gets its own session (build/mutation/<name>.sqlite): cosmic-ray writes one mutant at
# a time into a scratch copy of this checkout (build/mutation/tree; your files are never touched)
# and runs tools/mutation_tests.sh MODULE there, whose rank processes import the mutant too.
# Environment:
#   PYTHON            the project's test interpreter (default: python)
#   COSMIC_RAY_PY     the interpreter cosmic-ray is installed in (default: $PYTHON)
#   MUTATION_SAMPLE   run a seeded random sample of this many mutants per module (0: all; default 0)
#   MUTATION_SEED     the sample's seed (default 19)
#   MUTATION_LINES    only mutants starting on these lines ("250-345,351-390"; inclusive), sampled
#                     among themselves; give one module per run (line numbers are per file)
#   MUTATION_SURVIVORS_OF  a directory of earlier sessions: run only the mutants that survived there
#   MUTATION_TIMEOUT  seconds per mutant (default 900; a timeout counts as killed, and is listed)
#   MUTATION_OUT      where sessions and reports go (default build/mutation)
#   MUTATION_SLOW     0: leave out the pretrain_gpt.py tests of tools/mutation_tests.sh (default 1)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
CR_PY=${COSMIC_RAY_PY:-$PYTHON}
out=$(mkdir -p "${MUTATION_OUT:-$root/build/mutation}" && cd "${MUTATION_OUT:-$root/build/mutation}" && pwd)
MODULES=(patches/tp_invariant/_linear_layers.py patches/tp_invariant/_norms.py patches/tp_invariant/_cross_entropy.py patches/tp_invariant/_router.py patches/tp_invariant/_experts.py patches/tp_invariant/_refusal_tables.py patches/tp_invariant/_marks.py patches/tp_invariant/_parallel_state.py patches/tp_invariant/_mode.py patches/tp_invariant/tensor_parallel.py patches/tp_invariant/mlp.py patches/tp_invariant/moe.py patches/tp_invariant/construction.py patches/tp_invariant/distributed_optimizer.py patches/tp_invariant/grad_norm.py
         megapatch/numerics/block_tree.py megapatch/numerics/block_linear.py megapatch/numerics/token_tree.py megapatch/numerics/gradient_terms.py
         patches/logits/_lm_head.py patches/logits/fp32_lm_head.py patches/logits/fp32_lm_head_mamba.py patches/logits/fp32_output_layer.py patches/_common.py patches/tp_reduce/_reduction.py
         patches/tp_reduce/megatron_core.py patches/cross_rank/publish_settings.py megapatch/numerics/fp32_collectives.py
         megapatch/numerics/fp32_gemm.py megapatch/numerics/fp32_output_linear.py megapatch/core/cross_rank.py
         patches/logits/fp32_inference.py patches/fp8/align_transposes.py megapatch/te_check/verdict.py
         megapatch/core/startup.py megapatch/numerics/block_shapes.py megapatch/core/options.py
         patches/tp_reduce/moe.py megapatch/core/engine.py megapatch/core/wrappers.py megapatch/core/surface.py
         megapatch/core/upstream_versions.py megapatch/core/report.py
         megapatch/commands/megatron_lm_flags.py megapatch/commands/doctor.py megapatch/commands/doctor_text.py
         megapatch/commands/upstream_stops.py
         patches/tp_reduce/transformer_engine.py patches/tp_reduce/_te_forward.py patches/tp_reduce/_te_reductions.py megapatch/te_check/wiring.py
         megapatch/te_check/sources.py megapatch/te_check/definitions.py megapatch/te_check/call_sites.py
         megapatch/integrations/nemo_run.py megapatch/core/rank_errors.py
         megapatch/core/registry.py megapatch/core/state.py megapatch/core/call_args.py megapatch/core/scope.py
         megapatch/commands/lock.py megapatch/commands/cli.py megapatch/commands/launcher.py
         megapatch/commands/launcher_site/sitecustomize.py patches/linear/fp32_output.py
         megapatch/commands/demo.py megapatch/__init__.py megapatch/core/errors.py megapatch/_checkout.py
         megapatch/numerics/exact_sum.py patches/tp_invariant/data_parallel.py patches/tp_invariant/loss_scale.py
         patches/tp_invariant/micro_batch.py megapatch/numerics/per_sequence.py
         patches/tp_invariant/moe_micro_batch.py patches/tp_invariant/rl_refit.py
         patches/tp_invariant/attention.py patches/tp_invariant/engine_attention.py megapatch/numerics/attention.py)  # patches/tp_invariant/transformer_engine.py: PYTHON with TE
[ $# -gt 0 ] && MODULES=("$@")

tree=$out/tree  # tracked and untracked-but-not-ignored files of this checkout
rm -rf "$tree" && mkdir -p "$tree"
(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$tree")
export PYTHONPATH=$tree PYTHON  # the copy shadows any installed megapatch, in spawned ranks too
# the Megatron-LM tarballs the pretrain_gpt.py tests read sit beside the checkout, not the copy
export MEGATRON_LM_TARBALLS=${MEGATRON_LM_TARBALLS:-$(cd "$root/.." && pwd)/shared/megatron-lm}

for module in "${MODULES[@]}"; do
  name=$(echo "${module%.py}" | tr / _)
  config=$out/$name.toml session=$out/$name.sqlite
  cat > "$config" <<TOML
[cosmic-ray]
module-path = "$tree/$module"
timeout = ${MUTATION_TIMEOUT:-900}
excluded-modules = []
test-command = "bash $tree/tools/mutation_tests.sh $module"

[cosmic-ray.distributor]
name = "local"
TOML
  rm -f "$session"
  "$CR_PY" -m cosmic_ray.cli init "$config" "$session"
  [ -n "${MUTATION_LINES:-}" ] && "$CR_PY" "$root/tools/mutation_select.py" "$session" lines "$MUTATION_LINES"
  if [ -n "${MUTATION_SURVIVORS_OF:-}" ]; then
    "$CR_PY" "$root/tools/mutation_select.py" "$session" survivors-of "$MUTATION_SURVIVORS_OF/$name.sqlite"
  elif [ "${MUTATION_SAMPLE:-0}" != 0 ]; then
    "$CR_PY" "$root/tools/mutation_select.py" "$session" sample "$MUTATION_SAMPLE" "${MUTATION_SEED:-19}"
  fi
  (cd "$tree" && "$CR_PY" -m cosmic_ray.cli exec "$config" "$session")
  "$CR_PY" "$root/tools/mutation_select.py" "$session" summary ${MUTATION_LINES:+"$MUTATION_LINES"} | tee "$out/$name.txt"
done
