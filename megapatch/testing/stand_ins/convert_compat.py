"""CPU stand-ins for Megatron-LM's checkpoint converter (``tools/checkpoint/convert.py``), on top of
:mod:`megapatch.testing.stand_ins.megatron_lm_compat` and :mod:`megapatch.testing.stand_ins.cpu_compat`.

Used by :mod:`megapatch.testing.ranks.convert_launch` to run the unmodified converter of the pinned
Megatron-LM (``core_v0.16.1``: ``--loader llama_mistral --checkpoint-type hf --saver core
--saver-transformer-impl local``) on a CPU-only torch without Transformer Engine. Same contract as
the other stand-in modules: nothing in Megatron-LM's files is edited, the converted weights are the
converter's own (no stand-in touches a tensor), and every replacement is a :class:`Workaround`
record in :data:`CONVERTER_WORKAROUNDS` naming the upstream call it replaces. The converter never
initialises ``torch.distributed`` (``saver_base.py:163-175`` installs a fake TP group instead), so
the group stand-ins below act only while it is uninitialised, i.e. only inside the converter.

What the converter meets on CPU, and where each is answered (upstream file:line in core_v0.16.1):

=====  =================================================================  =========================
C1     ``tools/checkpoint/saver_base.py:43`` asserts                      ``saver_base`` record
       ``version("transformer-engine") >= 0.12`` (``PackageNotFoundError``  below (only when TE is
       without TE) before putting Megatron-LM on ``sys.path``             not installed)
C2     ``megatron/legacy/fused_kernels/__init__.py:21`` runs              ``megatron_lm_compat``
       ``CUDA_HOME + "/bin/nvcc -V"`` (``TypeError`` with no CUDA)         (``fused_kernels.load``)
C3/C4  the converter's hard-coded Megatron argv                           ``validate_args`` record
       (``loader_llama_mistral.py:437-451``, ``saver_base.py:220-247``)     below
       leaves ``apply_rope_fusion`` (``transformer_config.py``: "apply_rope_fusion is not available.
       Please install TE >= 1.4.") and ``gradient_accumulation_fusion`` (``tensor_parallel/
       layers.py``: "fused_weight_gradient_mlp_cuda module is not found") on
C5     ``rotary_pos_embedding.py:78`` ``torch.cuda.current_device()``   ``cpu_compat``
       (the legacy model the loader builds passes no                      (``current_device``)
       ``use_cpu_initialization``)
C6     ``megatron/legacy/model/utils.py:70,72`` reads                     ``validate_args`` record
       ``args.apply_layernorm_1p``, whose flag now has dest                 below (an upstream bug,
       ``layernorm_zero_centered_gamma`` (``AttributeError``)               not CPU-specific)
C7     ``core/process_groups_config.py:211-216`` asks                     ``parallel_state``
       ``get_data_parallel_group()`` without ``check_initialized=False``   records below
       ("data parallel group with context parallel combined is not initialized")
C8     ``megatron/training/checkpointing.py:535`` ``save_checkpoint`` asks  same
       ``get_pipeline_model_parallel_group()`` (not initialized)
C9     ``checkpointing.py:343`` ``torch.cuda.get_rng_state()``             ``megatron_lm_compat``
       even with ``--no-save-rng``                                          (``get_rng_state``)
C10    ``megatron/training/utils.py:448`` ``get_device_arch_version``       ``megatron_lm_compat``
       (TP > 1, from ``arguments.py:928``)                                 + ``CUDA_DEVICE_MAX_
                                                                           CONNECTIONS=1``
C11    ``core/utils.py:518-530`` ``get_pg_size`` answers 1 while            ``megatron.core.utils``
       ``torch.distributed`` is uninitialised, ignoring the converter's     records below
       ``_ConverterFakeProcessGroup(size=TP)``; ``core/utils.py:489-497``
       ``get_tensor_model_parallel_group_if_none`` drops it. Without them the TP > 1 saver builds
       unpartitioned layers and dies ("The size of tensor a (1024) must match the size of tensor
       b (512)", ``schema_base.py:50``). ``get_pg_rank`` (same lines) is left alone: it only
       places the random initial values the saver overwrites (shards verified bit-identical)
=====  =================================================================  =========================

Not stand-ins but what a user of the converter meets (written down in ``results/llama_hf.md``):
``convert.py:160-166`` exits 0 when the saver process dies (the launcher checks the saver's exit
code); the loader needs transformers 4.31 <= v < 5 (``loader_llama_mistral.py:46-48``) and
accelerate (``device_map="cpu"``, ``:392``); ``rope_theta``, ``rope_scaling`` and ``rms_norm_eps``
are not carried into the checkpoint's args (pass ``--rotary-base``, ``--use-rope-scaling
--rope-scaling-factor``, ``--norm-epsilon`` when loading).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from typing import Tuple

from megapatch.testing.stand_ins.replacements import Workaround

__all__ = ["CONVERTER_WORKAROUNDS", "FORCED_OFF"]

#: converter-built args forced off on a CPU-only torch (C3, C4): kernels that need CUDA/TE
FORCED_OFF = ("apply_rope_fusion", "gradient_accumulation_fusion")


def _path_without_te_check(original):
    # C1: keep what the method does besides the TE version assertion (the Megatron-LM root and
    # --megatron-path on sys.path); only when TE is absent, so a TE installation is still checked
    if importlib.util.find_spec("transformer_engine") is not None:
        return original
    saver_base = sys.modules[original.__module__]

    @functools.wraps(original)
    def insert_megatron_path_and_check_te(self):
        sys.path.append(os.path.abspath(os.path.join(os.path.dirname(saver_base.__file__),
                                                     os.path.pardir, os.path.pardir)))
        if self.args.megatron_path is not None:
            sys.path.insert(0, self.args.megatron_path)

    return insert_megatron_path_and_check_te


def _cpu_converter_args(original):
    # C3, C4 (CPU-only torch) and C6 (every machine: the alias the legacy model still reads)
    import torch

    forced = () if torch.cuda.is_available() else FORCED_OFF

    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        for name in forced:
            if getattr(args, name, False):
                setattr(args, name, False)
        out = original(args, *rest, **kwargs)
        out = args if out is None else out
        if not hasattr(out, "apply_layernorm_1p"):
            out.apply_layernorm_1p = bool(getattr(out, "layernorm_zero_centered_gamma", False))
        return out

    return validate_args


def _none_while_uninitialised(original):
    # C7, C8: what the getters answer with check_initialized=False, but only while
    # torch.distributed is uninitialised (the converter); a training job still gets the assertion
    import torch

    @functools.wraps(original)
    def getter(*args, **kwargs):
        if torch.distributed.is_initialized():
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        except AssertionError:
            return None

    return getter


def _is_converter_group(group) -> bool:
    return type(group).__name__ == "_ConverterFakeProcessGroup"


def _fake_group_size(original):
    @functools.wraps(original)
    def get_pg_size(group=None):
        return group.size() if _is_converter_group(group) else original(group)

    return get_pg_size


def _fake_tp_group_if_none(original):
    import torch

    @functools.wraps(original)
    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        if torch.distributed.is_initialized():
            return original(tp_group, is_expert=is_expert, check_initialized=check_initialized)
        if tp_group is not None:
            return tp_group
        from megatron.core import parallel_state

        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=False)

    return get_tensor_model_parallel_group_if_none


_PS = "megatron.core.parallel_state"
_UTILS = "megatron.core.utils"

CONVERTER_WORKAROUNDS: Tuple[Workaround, ...] = (
    Workaround("saver_base", "MegatronCheckpointSaverBase.insert_megatron_path_and_check_te",
               "tools/checkpoint/saver_base.py:43 version('transformer-engine') >= 0.12 assertion",
               _path_without_te_check),
    Workaround("megatron.training.arguments", "validate_args",
               "apply_rope_fusion / gradient_accumulation_fusion left on by the converter's argv "
               "(loader_llama_mistral.py:437-451, saver_base.py:220-247); args.apply_layernorm_1p "
               "read by megatron/legacy/model/utils.py:70,72", _cpu_converter_args),
    Workaround(_PS, "get_data_parallel_group",
               "core/process_groups_config.py:211-216 without check_initialized=False",
               _none_while_uninitialised),
    Workaround(_PS, "get_pipeline_model_parallel_group",
               "megatron/training/checkpointing.py:535 in save_checkpoint", _none_while_uninitialised),
    Workaround(_UTILS, "get_pg_size", "core/utils.py:518-530 ignores _ConverterFakeProcessGroup",
               _fake_group_size),
    Workaround(_UTILS, "get_tensor_model_parallel_group_if_none",
               "core/utils.py:489-497 returns None while torch.distributed is uninitialised",
               _fake_tp_group_if_none),
)
