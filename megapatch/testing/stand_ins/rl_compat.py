"""CPU stand-ins that let Megatron-LM's ``train_rl.py`` (``megatron/rl``: GRPO, rollouts on the
dynamic engine, refit into the inference model) run unmodified on CPU ranks.

Applied by ``torchrun -m megapatch.testing.ranks.rl_launch train_rl.py ...`` as Megatron-LM's own
CPU stand-ins are (:mod:`megapatch.testing.stand_ins.megatron_lm_compat`: when ``megatron.rl``'s modules
are imported), inside the dynamic engine's (:mod:`megapatch.testing.stand_ins.dynamic_inference_compat`). Each replacement names the upstream call it stands in
for; no numerics change and no Megatron-LM file is edited.

- ``megatron.rl.sequence_packing_utils.get_default_packed_seq_params``: without
  ``--rl-use-sequence-packing`` the trainer still hands every forward a THD ``PackedSeqParams`` that
  describes each row as one sequence spanning the whole length (a no-op, by its docstring, kept for
  CUDA-graph signature stability). megatron-core's local ``DotProductAttention`` (the only attention
  on CPU; TE's needs CUDA) refuses packed parameters; ``None`` is the same attention for these rows.
  ``train_rl.py`` from-imports the function, so it is replaced before the script runs.
- ``GPTModel.forward``: Megatron-LM main builds that default inline (``PackedSeqParams(qkv_format=
  'thd', cu_seqlens=[0, seq])`` in ``train_rl.forward_step`` and ``get_logprobs``); a forward handed
  exactly that gets ``None`` instead, any other packing is passed on untouched.

And two records that are not stand-ins: on Megatron-LM main, whose environments name their agent
from an allowlist (``megatron.rl.agent.registry.AGENT_REGISTRY``), the labelled synthetic countdown
agent is registered there by name, as a user registers an environment of their own. And one recorder: the second record of :data:`WORKAROUNDS` wraps
``megatron.rl.rl_utils.maybe_log_training_metrics`` -- the call that hands Megatron RL's rollout
statistics to its W&B / TensorBoard writers every step -- and appends the statistics it is handed
(among them upstream's own train-vs-inference mismatch, ``update_inference_logprobs_group_stats``)
as one JSON line per call to ``$MPTEST_RL_STATS``, then calls upstream's function. The
figures are upstream's, computed by its code; the recorder only writes down what would be logged.
"""

from __future__ import annotations

import json
import os
from typing import Tuple

from megapatch.testing.stand_ins.replacements import Workaround

__all__ = ["WORKAROUNDS", "STATS_ENV", "STATS_FIELDS", "read_rollout_stats"]

STATS_ENV = "MPTEST_RL_STATS"
# RolloutStats fields recorded per step (upstream's names): the train-vs-inference mismatch that
# update_inference_logprobs_group_stats fills, and the rollouts' own summary
STATS_FIELDS = ("min_piold_to_inf_prob", "max_piold_to_inf_prob", "mean_piold_to_inf_prob",
                "min_inf_train_prob_abs_diff", "max_inf_train_prob_abs_diff", "mean_inf_train_prob_abs_diff",
                "min_inf_prob", "max_inf_prob", "mean_inf_prob", "mean_reward", "mean_length", "rewards",
                "advantages")


def _unpacked_default(_original):
    # Replaces get_default_packed_seq_params(seq_length=, max_sequences_per_bin=, device=) as
    # train_rl.forward_step (and get_logprobs with sequence_packing) call it: one sequence per row.
    return lambda *args, **kwargs: None


def _single_sequence_thd(params, tokens) -> bool:
    """``params`` is Megatron RL's no-op default: THD, one sequence spanning a row's whole length."""
    import torch

    if params is None or getattr(params, "qkv_format", None) != "thd" or tokens is None or tokens.dim() != 2:
        return False
    whole = torch.tensor([0, tokens.shape[1]], dtype=torch.int32)
    return all(getattr(params, name) is not None and torch.equal(getattr(params, name).cpu().int(), whole)
               for name in ("cu_seqlens_q", "cu_seqlens_kv"))


def _unpacked_forward(original):
    # Replaces GPTModel.forward as Megatron-LM main's train_rl.forward_step and rl_utils.get_logprobs
    # call it without --rl-use-sequence-packing: both build the no-op THD default inline
    # (PackedSeqParams(qkv_format='thd', cu_seqlens=[0, seq])) for CUDA-graph signature stability;
    # local attention and RoPE on CPU take the rows unpacked (None), which is the same attention.
    def forward(self, input_ids, *args, **kwargs):
        if _single_sequence_thd(kwargs.get("packed_seq_params"), input_ids):
            kwargs["packed_seq_params"] = None
        return original(self, input_ids, *args, **kwargs)

    return forward


def _recording(original):
    def maybe_log_training_metrics(*args, **kwargs):
        path = os.environ.get(STATS_ENV)
        if path:
            import torch

            stats = kwargs.get("group_stats", args[0] if args else None)
            record = {name: getattr(stats, name, None) for name in STATS_FIELDS}
            record.update(iteration=kwargs.get("current_iteration"),
                          rank=torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return original(*args, **kwargs)

    return maybe_log_training_metrics


def _registered(original):
    # Megatron-LM main resolves an environment's agent_type through an allowlist of names
    # (megatron/rl/agent/registry.py: AGENT_REGISTRY, read at each lookup); the labelled synthetic
    # countdown agent is added under its name, as a user registers an environment of their own.
    return {**original, AGENT_NAME: AGENT_TARGET}


AGENT_NAME = "SyntheticCountdownAgent"
AGENT_TARGET = "megapatch.testing.scenarios.rl_countdown:SyntheticCountdownAgent"
SEQUENCE_PACKING = "megatron.rl.sequence_packing_utils"

WORKAROUNDS: Tuple[Workaround, ...] = (
    Workaround(SEQUENCE_PACKING, "get_default_packed_seq_params",
               "the trainer's no-op THD PackedSeqParams, which local DotProductAttention refuses",
               _unpacked_default),
    Workaround("megatron.rl.rl_utils", "maybe_log_training_metrics",
               "nothing: records the rollout statistics upstream hands its W&B/TensorBoard writers",
               _recording),
    Workaround("megatron.core.models.gpt.gpt_model", "GPTModel.forward",
               "the same no-op THD default built inline (Megatron-LM main's train_rl.py and get_logprobs)",
               _unpacked_forward),
    Workaround("megatron.rl.agent.registry", "AGENT_REGISTRY",
               "nothing: the test fixture's agent registered by name (Megatron-LM main's allowlist)",
               _registered, optional=True),
)


def read_rollout_stats(path, rank: int = 0) -> list:
    """The recorded statistics of one rank, a dict per step, in step order."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if row["rank"] == rank]
