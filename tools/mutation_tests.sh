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
# the in-process MoE and QK-norm tests, then the planted-oracle file, then every MoE layout
MOE_AND_QK_NORM=(
    "$T/test_tp_invariant_moe.py::test_the_alltoall_combine_restores_the_row_order_whether_hidden_states_come_by_position_or_keyword"
    "$T/test_tp_invariant_moe.py::test_top_k_routing_runs_once_per_token_block_with_the_same_rows_at_every_tp_size"
    "$T/test_tp_invariant_moe.py::test_expert_gemms_run_per_source_data_parallel_rank_and_their_wgrad_adds_the_sources_in_rank_order"
    "$T/test_tp_invariant_moe.py::test_expert_squares_are_added_in_layer_expert_parameter_order"
    "$T/test_tp_invariant_moe.py::test_doctor_refuses_the_moe_flags_the_run_refuses"
    "$T/test_tp_invariant.py::test_a_qk_norm_gradient_sums_its_heads_in_the_same_tree_at_every_tp_size"
    "$T/test_tp_invariant.py::test_a_qk_norm_whose_head_count_the_width_cannot_cut_is_refused_naming_both"
    "$T/test_tp_invariant_mutants.py"
    "$T/test_moe_preflight.py"
    "$T/test_tp_invariant_moe.py")
case $module in
  megapatch/numerics/block_tree.py|megapatch/numerics/block_linear.py|megapatch/numerics/token_tree.py|megapatch/numerics/gradient_terms.py) tests=(
    "$T/test_tp_invariant.py::test_tree_sum_adds_adjacent_pairs_level_by_level"
    "$T/test_tp_invariant.py::test_a_tp_size_that_does_not_divide_the_width_is_refused"
    "$T/test_tp_invariant.py::test_block_gemm_operands_follow_the_device"
    "$T/test_tp_invariant.py::test_fused_layer_norm_runs_without_apex_under_the_mode_against_an_fp64_oracle"
    "$T/test_tp_invariant_moe.py::test_an_expert_rows_forward_bits_do_not_depend_on_how_many_rows_its_source_sent"
    "$T/test_tp_invariant_moe.py::test_a_tp1_model_built_with_sequence_parallelism_runs_a_sequence_the_width_does_not_divide"
    "${MOE_AND_QK_NORM[@]}")
    slow=("${MLM}_sequence_parallel_is_bit_identical_to_tp1[core_v0.16.1-gpt-tps0]"
          "${MLM}_distributed_optimizer_is_tp_independent[core_v0.16.1]"
          "$T/test_megatron_lm.py::test_tp_invariant_first_step_is_the_same_at_data_parallel_sizes_1_and_3_and_micro_batch_sizes_1_2_4[core_v0.16.1]") ;;
  megapatch/numerics/exact_sum.py) tests=(
    "$T/test_exact_sum.py")
    slow=("$T/test_megatron_lm.py::test_tp_invariant_first_step_is_the_same_at_data_parallel_sizes_1_and_3_and_micro_batch_sizes_1_2_4[core_v0.16.1]"
          "${MLM}_steps_are_the_same_at_any_data_parallel_size_pipeline_depth_and_micro_batch_size[core_v0.16.1]") ;;
  patches/tp_invariant/data_parallel.py|patches/tp_invariant/loss_scale.py|patches/tp_invariant/micro_batch.py) tests=(
    "$T/test_quick_loop.py"
    "$T/test_megatron_lm.py::test_tp_invariant_first_step_is_the_same_at_data_parallel_sizes_1_and_3_and_micro_batch_sizes_1_2_4[core_v0.16.1]")
    slow=("${MLM}_steps_are_the_same_at_any_data_parallel_size_pipeline_depth_and_micro_batch_size[core_v0.16.1]") ;;
  megapatch/numerics/per_sequence.py|patches/tp_invariant/moe_micro_batch.py) tests=(
    "$T/test_tp_invariant_mutants.py::test_an_moe_micro_batch_runs_one_sequence_at_a_time_and_each_sequence_deposits_its_own_term"
    "$T/test_tp_invariant.py::test_a_micro_batch_hands_the_exact_sum_one_weight_gradient_term_per_sequence"
    "$T/test_megatron_lm.py::test_tp_invariant_first_step_is_the_same_at_data_parallel_sizes_1_and_3_and_micro_batch_sizes_1_2_4[core_v0.16.1]")
    slow=("${MLM}_moe_steps_are_the_same_at_micro_batch_sizes_and_data_parallel_sizes[core_v0.16.1]") ;;
  patches/tp_invariant/transformer_engine.py) tests=(  # PYTHON: an interpreter with TE (CI's te stage venv)
    "$T/test_tp_invariant_transformer_engine.py")
    slow=("$T/test_megatron_lm_te.py") ;;
  patches/tp_invariant/_*.py|patches/tp_invariant/tensor_parallel.py|patches/tp_invariant/mlp.py|patches/tp_invariant/moe.py|patches/tp_invariant/construction.py|patches/tp_invariant/distributed_optimizer.py|patches/tp_invariant/grad_norm.py) tests=(
    "$T/test_tp_invariant.py::test_several_distributed_optimizer_instances_are_refused_before_it_is_built"
    "$T/test_tp_invariant.py::test_opting_out_of_a_patch_the_guarantee_needs_is_refused"
    "$T/test_tp_invariant.py::test_releases_before_the_verified_one_are_refused_naming_both"
    "$T/test_tp_invariant.py::test_fused_layer_norm_runs_without_apex_under_the_mode_against_an_fp64_oracle"
    "$T/test_layout_refusals.py"
    "$T/test_tp_invariant_attention.py::test_a_tp1_models_norm_uses_its_own_tp_group_not_the_trainers"
    "${MOE_AND_QK_NORM[@]}")
    slow=("${MLM}_sequence_parallel_is_bit_identical_to_tp1[core_v0.16.1-gpt-tps0]"
          "${MLM}_distributed_optimizer_is_tp_independent[core_v0.16.1]") ;;
  patches/logits/_lm_head.py|patches/logits/fp32_lm_head.py|patches/logits/fp32_lm_head_mamba.py|patches/logits/fp32_output_layer.py) tests=(
    "$T/test_logits.py::test_model_construction_refuses_only_under_fp32_logits_and_only_a_model_with_an_output_layer"
    "$T/test_logits.py::test_the_head_path_says_which_device_and_whether_upstream_has_its_own_output_dtype"
    "$T/test_logits.py::test_a_model_logit_dtype_other_than_fp32_is_refused_naming_both_settings"
    "$T/test_logits.py::test_lm_head_holds_a_native_output_dtype_at_none_for_the_call_and_restores_it"
    "$T/test_logits.py::test_an_output_layer_other_than_column_parallel_linear_is_refused_at_construction"
    "$T/test_logits.py::test_a_model_built_with_its_own_bf16_logit_dtype_is_refused_at_construction"
    "$T/test_logits.py::test_gpt_fp32_logits_contract_and_accuracy"
    "$T/test_logits.py::test_an_output_layer_swapped_in_after_construction_is_refused_at_forward"
    "$T/test_logits.py::test_the_marked_layer_must_run_or_the_model_call_fails"
    "$T/test_logits.py::test_mamba_model_forward_returns_fp32_logits"
    "$T/test_logits.py::test_frozen_output_weight_keeps_the_gradient_contract"
    "$T/test_doctor.py::test_the_preflight_leaves_out_patches_the_user_opted_out_of"
    "$T/test_logits_fp32_dynamic_inference.py::test_mtp_draft_logits_are_fp32") ;;
  megapatch/numerics/fp32_gemm.py) tests=(
    "$T/test_logits.py::test_the_fp32_gemm_backends_are_called_as_their_contracts_say_and_return_a_new_fp32_tensor"
    "$T/test_logits.py::test_the_backend_of_a_tensor_follows_its_device_and_the_default_device_follows_cuda"
    "$T/test_logits.py::test_torch_mm_out_dtype_is_probed_on_cuda_only_with_a_square_product"
    "$T/test_logits.py::test_te_general_gemm_is_taken_only_with_the_arguments_it_is_called_with"
    "$T/test_logits.py::test_integer_operands_give_fp32_words_equal_to_the_fp32_reference"
    "$T/test_logits.py::test_frozen_output_weight_keeps_the_gradient_contract"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_logits.py::test_gpt_fp32_logits_contract_and_accuracy") ;;
  megapatch/numerics/fp32_output_linear.py) tests=(
    "$T/test_logits.py::test_the_accumulator_mode_takes_only_a_low_precision_gemm_with_a_2d_weight_of_its_dtype"
    "$T/test_logits.py::test_the_linear_apply_wrapper_asks_for_fp32_only_inside_a_request_and_only_of_low_precision_input"
    "$T/test_logits.py::test_the_fp32_gemm_backends_are_called_as_their_contracts_say_and_return_a_new_fp32_tensor"
    "$T/test_logits.py::test_the_fp32_accumulator_mode_gives_linear_its_bias_by_position_or_by_name"
    "$T/test_logits.py::test_an_upstream_forward_without_exactly_one_low_precision_gemm_is_refused"
    "$T/test_logits.py::test_integer_operands_give_fp32_words_equal_to_the_fp32_reference"
    "$T/test_logits.py::test_frozen_output_weight_keeps_the_gradient_contract"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_logits.py::test_gpt_fp32_logits_contract_and_accuracy") ;;
  megapatch/numerics/fp32_collectives.py|patches/tp_reduce/megatron_core.py) tests=(
    "$T/test_tp_reduce_megatron_core.py::test_an_async_handle_rounds_into_the_callers_tensor_once_after_the_work_and_only_on_wait"
    "$T/test_tp_reduce_megatron_core.py::test_an_unknown_reduction_mode_is_refused_naming_it_and_the_valid_ones"
    "$T/test_tp_reduce_megatron_core.py::test_reduction_mode_checks_the_group_first_and_takes_only_bf16_and_fp16_tensors"
    "$T/test_tp_reduce_megatron_core.py::test_only_a_sum_is_taken_by_the_patched_collectives"
    "$T/test_tp_reduce_megatron_core.py::test_the_patched_collectives_read_torchs_signatures_by_position_by_keyword_and_by_default"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_asks_for_its_fp32_accumulator_only_where_a_reduction_follows"
    "$T/test_tp_reduce_megatron_core.py::test_only_the_tp_layers_reduce_scatter_is_wrapped_not_torchs_function_elsewhere"
    "$T/test_tp_reduce_megatron_core.py::test_status_names_the_wire_and_accumulator_of_each_mode"
    "$T/test_tp_reduce_megatron_core.py::test_every_tp_reduction_equals_the_rank_order_fp32_oracle"
    "$T/test_tp_reduce_megatron_core.py::test_uneven_split_reduce_scatter_keeps_the_callers_dtype_and_equals_the_gathered_sum"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_tp_reduce_megatron_core.py::test_disabled_megapatch_is_bit_identical_to_stock"
    "$T/test_tp_reduce_megatron_core.py::test_a_layer_with_its_own_tp_group_is_reduced_in_fp32_over_that_group"
    "$T/test_tp_reduce_megatron_core.py::test_fp32_reductions_on_a_megatron_core_that_cannot_take_them_are_refused"
    "$T/test_moe.py::test_fp32_keeps_expert_partials_fp32_into_the_dispatcher_and_rounds_once_at_the_layer"
    "$T/test_moe.py::test_fp32_moe_at_tp4_with_sp_and_outlier_channels_is_as_close_to_tp1_as_tp2_on_unflipped_tokens"
    "$T/test_lifecycle.py") ;;
  patches/_common.py|patches/tp_reduce/_reduction.py) tests=(
    "$T/test_tp_reduce_megatron_core.py::test_a_patch_serving_an_option_applies_exactly_when_the_option_has_that_value"
    "$T/test_tp_reduce_megatron_core.py::test_reduction_mode_checks_the_group_first_and_takes_only_bf16_and_fp16_tensors"
    "$T/test_cross_rank.py::test_different_settings_in_one_tp_group_are_refused"
    "$T/test_tp_reduce_megatron_core.py::test_row_parallel_hands_its_fp32_accumulator_to_the_reduction"
    "$T/test_tp_reduce_megatron_core.py::test_every_tp_reduction_equals_the_rank_order_fp32_oracle"
    "$T/test_tp_reduce_megatron_core.py::test_a_layer_with_its_own_tp_group_is_reduced_in_fp32_over_that_group"
    "$T/test_lifecycle.py") ;;
  megapatch/core/cross_rank.py) tests=(
    "$T/test_cross_rank.py::test_a_wrapper_called_before_any_configuration_runs_no_settings_check"
    "$T/test_cross_rank.py::test_the_check_returns_at_once_when_every_entry_agrees_and_waits_for_a_late_one"
    "$T/test_cross_rank.py::test_a_rank_that_never_publishes_is_named_after_the_check_timeout_not_before"
    "$T/test_cross_rank.py::test_a_difference_is_refused_after_the_grace_period_or_the_timeout_whichever_is_first"
    "$T/test_cross_rank.py::test_a_peer_that_comes_to_agree_within_the_grace_period_is_not_refused"
    "$T/test_cross_rank.py::test_a_difference_is_named_before_a_missing_rank_and_a_switched_off_rank_by_its_kill_switch"
    "$T/test_cross_rank.py::test_the_job_wide_check_says_how_the_job_is_compared"
    "$T/test_cross_rank.py::test_no_check_runs_before_torch_distributed_is_initialised_or_megatron_built_its_groups"
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
  patches/cross_rank/publish_settings.py) tests=(
    "$T/test_doctor_agrees_with_run.py::test_transformer_engine_counts_as_missing_where_megatron_cores_layer_specs_could_not_import_it"
    "$T/test_doctor_agrees_with_run.py::test_transformer_engine_missing_stops_the_run_in_the_doctors_words_only_where_megapatch_is_active"
    "$T/test_doctor.py::test_transformer_engine_missing_is_said_first_before_any_megapatch_reason"
    "$T/test_cross_rank.py") ;;
  patches/logits/fp32_rl_logprobs.py|patches/tp_invariant/rl_logprobs.py|patches/tp_invariant/rl_refit.py) tests=(
    "$T/test_train_rl.py") ;;
  patches/tp_invariant/attention.py|patches/tp_invariant/engine_attention.py|megapatch/numerics/attention.py) tests=(
    "$T/test_tp_invariant_attention.py" "$T/test_tp_invariant_attention_blocks.py"
    "$T/test_tp_invariant_fidelity.py" "$T/test_tp_invariant_fidelity_layers.py") ;;
  patches/logits/fp32_inference.py) tests=(
    "$T/test_logits_fp32_inference.py::test_the_pipeline_forward_returns_the_models_fp32_logits_of_every_micro_batch_in_order"
    "$T/test_logits_fp32_inference.py::test_the_logits_broadcast_is_asked_for_fp32_with_every_other_argument_passed_on"
    "$T/test_logits_fp32_inference.py::test_the_dynamic_engines_logits_buffers_are_reallocated_in_fp32_only_when_low_precision"
    "$T/test_logits_fp32_inference.py::test_the_buffer_probe_reads_which_attributes_are_allocated_in_the_models_dtype"
    "$T/test_logits_fp32_inference.py::test_the_probe_says_what_it_cannot_read_or_does_not_know"
    "$T/test_logits_fp32_dynamic_inference.py::test_a_logits_buffer_allocated_in_params_dtype_becomes_fp32"
    "$T/test_logits_fp32_dynamic_inference.py::test_an_unknown_logits_buffer_is_refused_at_enable"
    "$T/test_logits_fp32_inference.py"
    "$T/test_logits_fp32_dynamic_inference.py::test_fp32_logits_reach_the_dynamic_engines_sampler_and_log_probs"
    "$T/test_logits_fp32_dynamic_inference.py::test_mtp_draft_logits_are_fp32"
    "$T/test_logits_fp32_dynamic_inference.py::test_upstreams_dynamic_inference_example_runs_on_cpu_ranks_with_fp32_logits") ;;
  patches/fp8/align_transposes.py) tests=(
    "$T/test_fp8_align_transposes.py::test_each_reason_to_pass_through_is_found_on_any_chunk_and_named"
    "$T/test_fp8_align_transposes.py::test_a_te_before_2_10_is_named_where_megatron_dispatches_its_processing_to_nothing"
    "$T/test_fp8_align_transposes.py::test_a_chunks_ddp_is_found_through_up_to_four_module_wrappers"
    "$T/test_fp8_align_transposes.py::test_the_pipeline_rank_is_read_from_the_communicator_then_the_process_groups_then_megatrons_state"
    "$T/test_fp8_align_transposes.py::test_quantized_parameters_are_recognised_by_each_releases_own_test_and_counted_once_per_dispatch"
    "$T/test_fp8_align_transposes.py::test_the_backend_says_the_last_decision"
    "$T/test_fp8_align_transposes.py::test_the_probe_names_each_piece_of_the_bucket_group_it_relies_on"
    "$T/test_fp8_align_transposes.py::test_a_forward_step_beyond_the_schedule_table_stops_aligning_instead_of_failing"
    "$T/test_fp8_align_transposes.py::test_before_any_schedule_call_the_decision_says_nothing_was_aligned"
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
    "$T/test_opt_outs_and_rank_lines.py::test_megatron_imported_before_the_startup_hook_with_wrapt_missing_stops_the_process"
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
  patches/tp_reduce/moe.py) tests=(
    "$T/test_moe.py::test_the_probabilities_are_swapped_for_fp32_only_around_an_fp32_sum_of_low_precision_probabilities"
    "$T/test_moe.py::test_the_moe_layer_rounds_its_fp32_sum_once_to_its_input_dtype_and_refuses_a_rounded_one"
    "$T/test_moe.py::test_construction_refuses_before_upstream_builds_and_marks_after_and_only_under_fp32"
    "$T/test_moe.py::test_the_preflight_names_each_moe_path_fp32_does_not_reach_and_nothing_for_a_dense_model"
    "$T/test_moe.py::test_every_fc2_of_the_experts_and_shared_experts_is_marked_and_nothing_else"
    "$T/test_moe.py::test_the_moe_patch_is_installed_for_fp32_only"
    "$T/test_moe.py::test_the_dispatcher_wrappers_read_the_expert_outputs_by_position_or_keyword"
    "$T/test_moe.py::test_the_probe_refuses_a_dispatcher_that_no_longer_casts_by_the_swapped_attribute"
    "$T/test_moe.py::test_status_names_the_moe_paths_covered_and_refused"
    "$T/test_moe.py::test_te_routed_experts_are_marked_and_what_fp32_does_not_reach_is_refused_naming_it"
    "$T/test_hardening_engine.py::test_skip_patches_argument_removes_an_installed_patch"
    "$T/test_hardening_engine.py::test_opting_out_every_patch_of_a_requested_option_is_refused"
    "$T/test_moe.py::test_moe_paths_fp32_does_not_reach_are_refused_at_construction_naming_the_flag"
    "$T/test_moe.py::test_fp32_keeps_expert_partials_fp32_into_the_dispatcher_and_rounds_once_at_the_layer"
    "$T/test_moe.py::test_doctor_says_which_moe_flags_fp32_refuses_as_the_run_does"
    "$T/test_moe.py::test_fp32_moe_sums_make_tp_and_ep_sizes_agree_and_keep_every_expert_choice"
    "$T/test_moe.py::test_fp32_moe_at_tp4_with_sp_and_outlier_channels_is_as_close_to_tp1_as_tp2_on_unflipped_tokens"
    "$T/test_logits_fp32_inference.py::test_fp32_logits_survive_every_inference_path_of_an_moe_model"
    "$T/test_logits_fp32_dynamic_inference.py::test_fp32_logits_reach_the_dynamic_engines_sampler_and_log_probs[moe-tp2]") ;;
  megapatch/core/engine.py) tests=(
    "$T/test_hardening_engine.py::test_a_wrapper_that_cannot_be_installed_takes_the_patchs_earlier_targets_out_again"
    "$T/test_hardening_engine.py::test_a_check_or_probe_that_raises_is_a_reason_not_a_crash_and_the_probe_waits_for_the_surface"
    "$T/test_hardening_engine.py::test_status_of_a_patch_says_why_it_is_not_active_and_survives_a_backend_that_raises"
    "$T/test_hardening_engine.py::test_an_optional_target_is_installed_where_present_and_left_out_where_absent"
    "$T/test_hardening_engine.py::test_stopping_the_kill_switchs_announcements_takes_their_wrappers_out"
    "$T/test_hardening_engine.py::test_a_rollback_that_cannot_reinstall_a_patch_says_so_and_restores_the_rest"
    "$T/test_hardening_engine.py"
    "$T/test_lifecycle.py"
    "$T/test_tp_invariant.py::test_opting_out_of_a_patch_the_guarantee_needs_is_refused"
    "$T/test_versions.py::test_status_shows_each_patchs_range"
    "$T/test_rank_errors.py::test_enable_installs_the_hook_and_disable_restores_the_one_before"
    "$T/test_cross_rank.py::test_reconfigured_forgets_verified_groups_and_arms_the_first_call_check"
    "$T/test_doctor.py::test_doctor_exit_1_when_a_requested_patch_cannot_apply"
    "$T/test_doctor.py::test_an_exception_from_a_probe_becomes_a_row"
    "$T/test_doctor.py::test_an_exception_from_a_backend_probe_or_applies_becomes_a_row"
    "$T/test_doctor.py::test_the_preflight_leaves_out_patches_the_user_opted_out_of"
    "$T/test_opt_outs_and_rank_lines.py"
    "$T/test_activation.py::test_disable_variable_wins_over_requests"
    "$T/test_activation.py::test_explicit_enable_in_the_script_wins_over_the_environment"
    "$T/test_cross_rank.py::test_disable_then_enable_the_same_settings_is_no_mismatch"
    "$T/test_cross_rank.py::test_a_native_or_switched_off_rank_is_named_at_once_in_the_megatron_lm_order") ;;
  megapatch/core/wrappers.py) tests=(
    "$T/test_hardening_engine.py::test_aliases_are_found_in_every_module_but_the_skipped_packages_and_put_back_everywhere"
    "$T/test_hardening_engine.py::test_an_inherited_method_is_removed_again_not_left_as_an_own_attribute"
    "$T/test_hardening_engine.py::test_a_proxy_whose_wrapped_attribute_raises_ends_the_search_and_unreachable_functions_do_not_pickle"
    "$T/test_hardening_engine.py::test_a_wrapped_method_bound_to_an_instance_copies_and_pickles_like_a_bound_method"
    "$T/test_hardening_engine.py::test_an_alias_in_a_module_no_longer_in_sys_modules_is_put_back_from_the_install_record"
    "$T/test_cross_rank.py::test_a_wrapper_called_before_any_configuration_runs_no_settings_check"
    "$T/test_hardening_engine.py::test_wrapped_functions_pickle_and_copy_like_stock"
    "$T/test_hardening_engine.py::test_third_party_wrapper_on_top_of_ours_survives_disable_and_enable"
    "$T/test_hardening_engine.py::test_torch_collective_alias_taken_while_enabled_is_restored_by_disable"
    "$T/test_lifecycle.py"
    "$T/test_hardening_engine.py"
    "$T/test_tp_reduce_megatron_core.py::test_only_the_tp_layers_reduce_scatter_is_wrapped_not_torchs_function_elsewhere"
    "$T/test_logits_fp32_inference.py::test_only_the_controllers_logits_broadcast_is_wrapped_not_the_shared_function"
    "$T/test_cross_rank.py::test_reconfigured_forgets_verified_groups_and_arms_the_first_call_check"
    "$T/test_cross_rank.py::test_different_settings_in_one_tp_group_are_refused"
    "$T/test_cross_rank.py::test_disable_then_enable_the_same_settings_is_no_mismatch"
    "$T/test_activation.py::test_disable_variable_wins_over_requests") ;;
  megapatch/core/surface.py) tests=(
    "$T/test_surface.py"
    "$T/test_lifecycle.py::test_changed_upstream_surface_is_refused_in_strict_mode"
    "$T/test_lifecycle.py::test_changed_upstream_surface_is_skipped_with_a_warning_when_not_strict"
    "$T/test_lifecycle.py::test_missing_upstream_symbol_names_the_path"
    "$T/test_surface_lock.py"
    "$T/test_lifecycle.py"
    "$T/test_hardening_engine.py"
    "$T/test_doctor.py::test_doctor_exit_1_when_a_requested_patch_cannot_apply"
    "$T/test_doctor.py::test_doctor_reports_and_exits_1_when_strict_activation_meets_a_changed_upstream"
    "$T/test_doctor.py::test_doctor_json_and_status_json_on_a_changed_upstream") ;;
  megapatch/core/upstream_versions.py) tests=(
    "$T/test_versions.py"
    "$T/test_bridge.py::test_a_bridge_version_outside_the_tested_range_warns_once_naming_both"
    "$T/test_tp_invariant.py::test_releases_before_the_verified_one_are_refused_naming_both"
    "$T/test_integrations_nemo_run.py::test_the_installed_nemo_run_is_a_tested_version"
    "$T/test_integrations_nemo_run.py::test_an_untested_nemo_run_version_warns_once_naming_both"
    "$T/test_surface_lock.py::test_installed_megatron_core_matches_its_lock"
    "$T/test_lifecycle.py::test_status_prints_a_table_and_serialises"
    "$T/test_hardening_engine.py::test_one_activation_line_with_settings_sources_and_patches"
    "$T/test_doctor.py::test_doctor_reports_versions_and_patches"
    "$T/test_install.py::test_versions_are_those_of_the_modules_in_use"
    "$T/test_install.py::test_doctor_reports_the_megatron_core_of_the_checkout") ;;
  megapatch/core/report.py) tests=(
    "$T/test_hardening_engine.py::test_one_activation_line_with_settings_sources_and_patches"
    "$T/test_hardening_engine.py::test_activation_line_only_on_rank_zero"
    "$T/test_hardening_engine.py::test_fp8_pass_through_is_logged_once"
    "$T/test_hardening_engine.py::test_misspelled_variables_are_reported_with_the_closest_name"
    "$T/test_hardening_engine.py::test_status_serialises_with_the_new_options"
    "$T/test_hardening_engine.py::test_a_rank_variable_that_is_not_a_number_counts_as_rank_zero"
    "$T/test_hardening_engine.py::test_the_activation_line_gives_each_patch_that_is_not_active_its_reason"
    "$T/test_lifecycle.py::test_status_prints_a_table_and_serialises"
    "$T/test_lifecycle.py::test_status_and_its_patch_reports_are_snapshots_that_cannot_be_assigned_to"
    "$T/test_lifecycle.py::test_changed_upstream_surface_is_skipped_with_a_warning_when_not_strict"
    "$T/test_versions.py::test_status_shows_each_patchs_range"
    "$T/test_rank_errors.py"
    "$T/test_opt_outs_and_rank_lines.py"
    "$T/test_hardening_engine.py::test_activation_line_reaches_stderr_without_any_logging_configuration"
    "$T/test_hardening_engine.py::test_activation_line_goes_to_the_applications_handlers_once_it_has_some"
    "$T/test_hardening_engine.py::test_the_level_megapatch_set_is_undone_once_the_application_configures_logging"
    "$T/test_doctor.py::test_status_and_doctor_do_not_print_the_activation_line"
    "$T/test_doctor.py::test_doctor_reports_versions_and_patches"
    "$T/test_worker_processes.py") ;;
  megapatch/commands/megatron_lm_flags.py) tests=(
    "$T/test_doctor.py::test_flags_translate_to_the_config_fields_megatron_lm_builds"
    "$T/test_layout_refusals.py"
    "$T/test_doctor.py::test_a_flag_given_twice_counts_at_its_last_occurrence_as_argparse_takes_it"
    "$T/test_doctor.py::test_a_flag_left_without_its_value_at_the_end_is_ignored_not_an_index_error"
    "$T/test_doctor.py::test_the_padded_vocabulary_refusal_names_it_and_the_flags_that_padded_it"
    "$T/test_doctor.py::test_the_fused_activation_refusal_names_the_one_flag_of_the_models_activation"
    "$T/test_doctor.py::test_transformer_engine_missing_is_said_first_before_any_megapatch_reason"
    "$T/test_doctor.py::test_doctor_with_flags_the_mode_covers_says_so"
    "$T/test_doctor.py::test_doctor_with_flags_names_every_refusal_its_flag_and_the_source"
    "$T/test_doctor.py::test_doctor_refuses_transformer_engine_layers_by_default_and_arguments_without_the_separator"
    "$T/test_doctor_agrees_with_run.py::test_the_doctor_refuses_what_the_run_refuses_at_construction"
    "$T/test_doctor_agrees_with_run.py::test_a_megatron_lm_sequence_w_does_not_divide_is_refused_at_construction_with_sequence_parallelism"
    "$T/test_doctor_agrees_with_run.py::test_transformer_engine_missing_stops_the_run_in_the_doctors_words_only_where_megapatch_is_active"
    "$T/test_moe.py::test_doctor_says_which_moe_flags_fp32_refuses_as_the_run_does"
    "$T/test_megatron_lm.py::test_doctor_reads_flags_as_megatron_lm_parses_them"
    "$T/test_megatron_lm.py::test_doctor_refuses_several_distributed_optimizer_instances_for_the_mode") ;;
  megapatch/commands/doctor.py|megapatch/commands/doctor_text.py|megapatch/commands/upstream_stops.py) tests=(
    "$T/test_doctor.py"
    "$T/test_cli.py::test_help_documents_exit_codes"
    "$T/test_bridge.py::test_doctor_names_both_logit_dtype_settings_and_exits_1"
    "$T/test_doctor_agrees_with_run.py::test_the_doctor_refuses_what_the_run_refuses_at_construction"
    "$T/test_doctor_agrees_with_run.py::test_transformer_engine_missing_stops_the_run_in_the_doctors_words_only_where_megapatch_is_active"
    "$T/test_moe.py::test_doctor_says_which_moe_flags_fp32_refuses_as_the_run_does"
    "$T/test_megatron_lm.py::test_doctor_refuses_several_distributed_optimizer_instances_for_the_mode"
    "$T/test_install.py::test_doctor_reports_the_megatron_core_of_the_checkout") ;;
  patches/tp_reduce/transformer_engine.py|patches/tp_reduce/_te_forward.py|patches/tp_reduce/_te_reductions.py) tests=(
    "$T/test_tp_reduce_transformer_engine_wiring.py"
    "$T/test_tp_reduce_transformer_engine_oracles.py"
    "$T/test_te_verdict.py"
    "$T/test_hardening_engine.py::test_skip_patches_opts_one_patch_out_and_says_so"
    "$T/test_hardening_engine.py::test_skip_patches_argument_removes_an_installed_patch"
    "$T/test_doctor.py::test_doctor_reports_versions_and_patches") ;;
  megapatch/te_check/wiring.py|megapatch/te_check/sources.py|megapatch/te_check/definitions.py|megapatch/te_check/call_sites.py) tests=(
    "$T/test_tp_reduce_transformer_engine_wiring.py::test_check_reports_broken_wiring"
    "$T/test_tp_reduce_transformer_engine_wiring.py::test_release_is_wired_as_the_patch_relies_on"
    "$T/test_tp_reduce_transformer_engine_wiring.py::test_every_target_is_checked_in_every_release"
    "$T/test_tp_reduce_transformer_engine_wiring.py::test_declared_wiring_and_targets_agree"
    "$T/test_tp_reduce_transformer_engine_wiring.py"
    "$T/test_te_verdict.py") ;;
  megapatch/integrations/nemo_run.py) tests=(
    "$T/test_integrations_nemo_run.py") ;;
  megapatch/core/rank_errors.py) tests=(
    "$T/test_rank_errors.py") ;;
  megapatch/core/registry.py) tests=(
    "$T/test_lifecycle.py"
    "$T/test_hardening_engine.py"
    "$T/test_surface_lock.py"
    "$T/test_versions.py"
    "$T/test_tp_invariant.py::test_opting_out_of_a_patch_the_guarantee_needs_is_refused"
    "$T/test_doctor.py") ;;
  megapatch/core/state.py) tests=(
    "$T/test_options.py"
    "$T/test_hardening_engine.py"
    "$T/test_launcher.py::test_messages_name_the_flag_that_set_a_variable"
    "$T/test_lifecycle.py") ;;
  megapatch/core/call_args.py) tests=(
    "$T/test_tp_reduce_megatron_core.py"
    "$T/test_logits_fp32_inference.py"
    "$T/test_tp_reduce_transformer_engine_wiring.py"
    "$T/test_tp_invariant_mutants.py"
    "$T/test_moe.py") ;;
  megapatch/core/scope.py) tests=(
    "$T/test_logits.py"
    "$T/test_tp_reduce_megatron_core.py"
    "$T/test_logits_fp32_inference.py") ;;
  megapatch/commands/lock.py) tests=(
    "$T/test_surface_lock.py"
    "$T/test_matrix.py"
    "$T/test_cli.py") ;;
  megapatch/commands/cli.py) tests=(
    "$T/test_cli.py"
    "$T/test_doctor.py"
    "$T/test_hardening_engine.py"
    "$T/test_surface_lock.py"
    "$T/test_demo.py") ;;
  megapatch/commands/launcher.py) tests=(
    "$T/test_launcher.py"
    "$T/test_integrations_nemo_run.py"
    "$T/test_install.py::test_target_install_activates_through_the_launcher") ;;
  megapatch/commands/launcher_site/sitecustomize.py) tests=(
    "$T/test_launcher.py"
    "$T/test_startup_hook.py"
    "$T/test_install.py::test_target_install_activates_through_the_launcher") ;;
  patches/linear/fp32_output.py) tests=(
    "$T/test_tp_reduce_megatron_core.py"
    "$T/test_logits.py"
    "$T/test_lifecycle.py"
    "$T/test_surface_lock.py"
    "$T/test_hardening_engine.py") ;;
  megapatch/commands/demo.py) tests=(
    "$T/test_demo.py"
    "$T/test_cli.py") ;;
  megapatch/__init__.py|megapatch/core/errors.py|megapatch/_checkout.py) tests=(
    "$T/test_package.py"
    "$T/test_lifecycle.py"
    "$T/test_hardening_engine.py"
    "$T/test_doctor.py"
    "$T/test_startup_hook.py"
    "$T/test_install.py") ;;
  *) echo "no tests listed for $module in $0" >&2; exit 2 ;;
esac
"$PYTHON" -m pytest -x -q -p no:cacheprovider --timeout=600 "${tests[@]}" || exit
[ ${#slow[@]} -eq 0 ] || [ "${MUTATION_SLOW:-1}" = 0 ] && exit 0
exec "$PYTHON" -m pytest -x -q -p no:cacheprovider --timeout=600 "${slow[@]}"
