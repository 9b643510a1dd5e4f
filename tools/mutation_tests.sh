#!/usr/bin/env bash
# The tests cosmic-ray runs against one mutated module (tools/mutation.sh): the tests that exercise
# it, fastest and most direct first, stopping at the first failure (-x). Exit 0 = the mutant
# survived. Run from the tree being mutated; PYTHON is the project's test interpreter.
# Modules with code only a Megatron-LM run reaches (sequence parallelism, the distributed
# optimizer) then run those pretrain_gpt.py tests (a few minutes; only a mutant that survived the
# rest gets there); MUTATION_SLOW=0 leaves them out (a survivor then still needs those, or a test).
set -u
module=$1
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
T=tests
slow=()
MLM="$T/test_megatron_lm.py::test_tp_invariant"
case $module in
  megapatch/numerics/block_tree.py) tests=(
    "$T/test_tp_invariant.py::test_tree_sum_adds_adjacent_pairs_level_by_level"
    "$T/test_tp_invariant.py::test_a_tp_size_that_does_not_divide_the_width_is_refused"
    "$T/test_tp_invariant.py::test_block_gemm_operands_follow_the_device"
    "$T/test_tp_invariant.py::test_fused_layer_norm_runs_without_apex_under_the_mode_against_an_fp64_oracle"
    "$T/test_tp_invariant_mutants.py")
    slow=("${MLM}_sequence_parallel_is_bit_identical_to_tp1[core_v0.16.1-gpt-tps0]"
          "${MLM}_distributed_optimizer_is_tp_independent[core_v0.16.1]") ;;
  patches/tp_invariant.py) tests=(
    "$T/test_tp_invariant.py::test_several_distributed_optimizer_instances_are_refused_before_it_is_built"
    "$T/test_tp_invariant.py::test_opting_out_of_a_patch_the_guarantee_needs_is_refused"
    "$T/test_tp_invariant.py::test_releases_before_the_verified_one_are_refused_naming_both"
    "$T/test_tp_invariant.py::test_fused_layer_norm_runs_without_apex_under_the_mode_against_an_fp64_oracle"
    "$T/test_tp_invariant_mutants.py")
    slow=("${MLM}_sequence_parallel_is_bit_identical_to_tp1[core_v0.16.1-gpt-tps0]"
          "${MLM}_distributed_optimizer_is_tp_independent[core_v0.16.1]") ;;
  patches/logits.py) tests=(
    "$T/test_logits.py::test_lm_head_holds_a_native_output_dtype_at_none_for_the_call_and_restores_it"
    "$T/test_logits.py::test_an_output_layer_other_than_column_parallel_linear_is_refused_at_construction"
    "$T/test_logits.py::test_a_model_built_with_its_own_bf16_logit_dtype_is_refused_at_construction"
    "$T/test_logits.py::test_gpt_fp32_logits_contract_and_accuracy"
    "$T/test_logits.py::test_an_output_layer_swapped_in_after_construction_is_refused_at_forward"
    "$T/test_logits.py::test_the_marked_layer_must_run_or_the_model_call_fails"
    "$T/test_logits.py::test_mamba_model_forward_returns_fp32_logits"
    "$T/test_logits.py::test_frozen_output_weight_keeps_the_gradient_contract") ;;
  megapatch/numerics/fp32_gemm.py) tests=(
    "$T/test_logits.py::test_torch_mm_out_dtype_is_probed_on_cuda_only_with_a_square_product"
    "$T/test_logits.py::test_te_general_gemm_is_taken_only_with_the_arguments_it_is_called_with"
    "$T/test_logits.py::test_integer_operands_give_fp32_words_equal_to_the_fp32_reference"
    "$T/test_logits.py::test_frozen_output_weight_keeps_the_gradient_contract"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_logits.py::test_gpt_fp32_logits_contract_and_accuracy") ;;
  megapatch/numerics/fp32_output_linear.py) tests=(
    "$T/test_logits.py::test_the_fp32_accumulator_mode_gives_linear_its_bias_by_position_or_by_name"
    "$T/test_logits.py::test_an_upstream_forward_without_exactly_one_low_precision_gemm_is_refused"
    "$T/test_logits.py::test_integer_operands_give_fp32_words_equal_to_the_fp32_reference"
    "$T/test_logits.py::test_frozen_output_weight_keeps_the_gradient_contract"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_logits.py::test_gpt_fp32_logits_contract_and_accuracy") ;;
  megapatch/numerics/fp32_collectives.py|patches/tp_reduce_megatron_core.py) tests=(
    "$T/test_tp_reduce_megatron_core.py::test_only_the_tp_layers_reduce_scatter_is_wrapped_not_torchs_function_elsewhere"
    "$T/test_tp_reduce_megatron_core.py::test_status_names_the_wire_and_accumulator_of_each_mode"
    "$T/test_tp_reduce_megatron_core.py::test_every_tp_reduction_equals_the_rank_order_fp32_oracle"
    "$T/test_tp_reduce_megatron_core.py::test_uneven_split_reduce_scatter_keeps_the_callers_dtype_and_equals_the_gathered_sum"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_tp_reduce_megatron_core.py::test_disabled_megapatch_is_bit_identical_to_stock") ;;
  patches/_common.py) tests=(
    "$T/test_cross_rank.py::test_different_settings_in_one_tp_group_are_refused"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_tp_reduce_megatron_core.py::test_every_tp_reduction_equals_the_rank_order_fp32_oracle"
    "$T/test_tp_reduce_megatron_core.py::test_a_layer_with_its_own_tp_group_is_reduced_in_fp32_over_that_group"
    "$T/test_lifecycle.py") ;;
  megapatch/core/cross_rank.py) tests=(
    "$T/test_cross_rank.py::test_reconfigured_forgets_verified_groups_and_arms_the_first_call_check"
    "$T/test_cross_rank.py::test_differences_name_each_differing_option_with_both_values"
    "$T/test_cross_rank.py::test_job_check_reads_every_rank_on_rank_0_and_rank_0_elsewhere"
    "$T/test_cross_rank.py::test_different_settings_in_one_tp_group_are_refused"
    "$T/test_cross_rank.py::test_same_settings_pass_and_reduce"
    "$T/test_cross_rank.py::test_ranks_differing_in_tp_invariant_or_its_width_are_refused"
    "$T/test_cross_rank.py::test_a_reconfiguration_to_other_settings_is_checked_again_not_hung"
    "$T/test_cross_rank.py::test_different_logits_dtype_in_one_tp_group_is_refused"
    "$T/test_cross_rank.py::test_a_peer_without_megapatch_is_named_after_the_timeout"
    "$T/test_cross_rank.py::test_data_parallel_replicas_with_different_settings_are_refused"
    "$T/test_cross_rank.py::test_data_parallel_replicas_at_tp1_with_different_settings_are_refused"
    "$T/test_cross_rank.py::test_disable_then_enable_the_same_settings_is_no_mismatch") ;;
  patches/cross_rank.py) tests=("$T/test_cross_rank.py") ;;
  patches/logits_fp32_inference.py) tests=(
    "$T/test_logits_fp32_dynamic_inference.py::test_a_logits_buffer_allocated_in_params_dtype_becomes_fp32"
    "$T/test_logits_fp32_dynamic_inference.py::test_an_unknown_logits_buffer_is_refused_at_enable"
    "$T/test_logits_fp32_inference.py"
    "$T/test_logits_fp32_dynamic_inference.py::test_fp32_logits_reach_the_dynamic_engines_sampler_and_log_probs"
    "$T/test_logits_fp32_dynamic_inference.py::test_mtp_draft_logits_are_fp32"
    "$T/test_logits_fp32_dynamic_inference.py::test_upstreams_dynamic_inference_example_runs_on_cpu_ranks_with_fp32_logits") ;;
  patches/fp8_align_transposes.py) tests=(
    "$T/test_fp8_align_transposes.py::test_chunk_order_helper_matches_upstream_schedule_table_for_uneven_groups"
    "$T/test_fp8_align_transposes.py::test_a_model_with_any_per_tensor_fp8_parameter_is_aligned"
    "$T/test_fp8_align_transposes.py::test_only_a_model_whose_quantized_parameters_are_all_mxfp8_passes_through"
    "$T/test_fp8_align_transposes.py::test_status_reports_the_patch_without_a_call"
    "$T/test_fp8_align_transposes.py"
    "$T/test_hardening_engine.py::test_fp8_pass_through_is_logged_once") ;;
  megapatch/te_check/verdict.py) tests=(
    "$T/test_te_verdict.py"
    "$T/test_doctor.py::test_doctor_reports_versions_and_patches") ;;
  megapatch/core/startup.py) tests=(
    "$T/test_startup_hook.py"
    "$T/test_worker_processes.py"
    "$T/test_activation.py"
    "$T/test_hardening_engine.py::test_environment_activation_with_a_bad_kill_switch_stops_the_megatron_process"
    "$T/test_launcher.py::test_activates_once_where_pth_and_sitecustomize_both_run") ;;
  megapatch/numerics/block_shapes.py) tests=(
    "$T/test_tp_invariant_mutants.py::test_each_uncovered_config_field_is_refused_alone"
    "$T/test_tp_invariant_mutants.py::test_kv_groups_equal_to_the_tp_size_and_heads_as_groups_are_accepted"
    "$T/test_doctor.py::test_the_padded_vocabulary_refusal_names_it_and_the_flags_that_padded_it"
    "$T/test_doctor.py::test_a_flag_given_twice_counts_at_its_last_occurrence_as_argparse_takes_it"
    "$T/test_tp_invariant.py::test_a_tp_size_that_does_not_divide_the_width_is_refused"
    "$T/test_tp_invariant.py::test_invalid_widths_are_refused_naming_the_variable_and_choices"
    "$T/test_doctor.py::test_doctor_with_flags_names_every_refusal_its_flag_and_the_source"
    "$T/test_doctor_agrees_with_run.py::test_the_doctor_refuses_what_the_run_refuses_at_construction"
    "$T/test_megatron_lm.py::test_doctor_reads_flags_as_megatron_lm_parses_them"
    "$T/test_megatron_lm.py::test_the_launcher_warns_when_the_padded_vocabulary_depends_on_the_tp_size")
    slow=("$T/test_doctor_agrees_with_run.py::test_pretrain_gpt_refuses_the_padded_vocabulary_at_construction_in_the_doctors_words") ;;
  megapatch/core/options.py) tests=(
    "$T/test_options.py"
    "$T/test_hardening_engine.py::test_bad_check_timeout_is_refused_naming_variable_value_and_range"
    "$T/test_hardening_engine.py::test_check_timeout_is_resolved_and_reaches_the_settings"
    "$T/test_hardening_engine.py::test_unknown_kill_switch_spelling_is_an_error"
    "$T/test_hardening_engine.py::test_resolve_refuses_a_bad_kill_switch_so_doctor_does_too"
    "$T/test_hardening_engine.py::test_true_kill_switch_spellings_disable"
    "$T/test_hardening_engine.py::test_an_empty_value_is_an_error_for_every_variable"
    "$T/test_hardening_engine.py::test_a_huge_invalid_value_is_not_echoed_whole"
    "$T/test_hardening_engine.py::test_misspelled_variables_are_reported_with_the_closest_name"
    "$T/test_hardening_engine.py::test_reconfigure_keeps_earlier_explicit_values"
    "$T/test_hardening_engine.py::test_skip_patches_opts_one_patch_out_and_says_so"
    "$T/test_hardening_engine.py::test_unknown_patch_name_is_refused_with_the_valid_names"
    "$T/test_hardening_engine.py::test_status_serialises_with_the_new_options"
    "$T/test_tp_invariant.py::test_combining_with_fp32_reductions_is_refused"
    "$T/test_tp_invariant.py::test_invalid_widths_are_refused_naming_the_variable_and_choices"
    "$T/test_cross_rank.py::test_differences_name_each_differing_option_with_both_values"
    "$T/test_launcher.py::test_every_option_has_a_flag_that_sets_its_variable"
    "$T/test_launcher.py::test_messages_name_the_flag_that_set_a_variable"
    "$T/test_launcher.py::test_a_refusal_through_the_launcher_names_its_flags"
    "$T/test_integrations_nemo_run.py::test_every_option_is_a_field"
    "$T/test_integrations_nemo_run.py::test_setup_adds_the_variables_and_keeps_the_executors_own"
    "$T/test_integrations_nemo_run.py::test_invalid_value_fails_when_the_plugin_is_built"
    "$T/test_startup_hook.py") ;;
  *) echo "no tests listed for $module in $0" >&2; exit 2 ;;
esac
"$PYTHON" -m pytest -x -q -p no:cacheprovider --timeout=600 "${tests[@]}" || exit
[ ${#slow[@]} -eq 0 ] || [ "${MUTATION_SLOW:-1}" = 0 ] && exit 0
exec "$PYTHON" -m pytest -x -q -p no:cacheprovider --timeout=600 "${slow[@]}"
