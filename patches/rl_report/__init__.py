"""``rl_report``: what Megatron RL computes about its rollouts, in the job log (rank 0), under any
megapatch settings (native ones included: ``MEGAPATCH_LOGITS_DTYPE=native`` enables megapatch and
changes nothing else). Reporting only: no upstream value changes.

======================  ===========================================================================
record module           what it reports
======================  ===========================================================================
mismatch                each RL step's train-vs-rollout log-prob mismatch, one line: upstream's own
                        figures (``update_inference_logprobs_group_stats``) and the share of
                        bit-identical log-probs
======================  ===========================================================================
"""
