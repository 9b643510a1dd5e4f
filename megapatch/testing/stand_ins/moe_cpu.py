"""Stand-ins that let megatron-core's mixture-of-experts layers run on CPU (gloo), registered in
:data:`megapatch.testing.stand_ins.cpu_compat.WORKAROUNDS` (labelled ``(stand-in)`` there).

Read in core_v0.16.1's ``transformer/moe`` and ``tensor_parallel/mappings.py``; each keeps the
contract of what it replaces and changes no arithmetic:

* ``moe_utils.te_general_gemm`` is bound only when Transformer Engine imports, yet
  ``RouterGatingLinearFunction`` tests it against None: without TE every MoE forward raises
  ``NameError``. The stand-in is the None that check expects (the router's torch.mm path).
* The alltoall dispatcher creates a ``torch.cuda.Stream`` for its device-to-host copies of the
  split sizes and synchronises on an event recorded there: ``cpu_streams.CpuSideStream`` (shared
  with the dynamic inference engine's stand-ins).
* ``maybe_move_tensor_to_cpu(as_numpy=True)`` hands the all-to-all its split sizes as numpy
  arrays, but only for CUDA tensors; on CPU the split sizes stay tensors, which gloo's
  ``all_to_all_single`` rejects. The stand-in converts CPU tensors as upstream converts CUDA ones.
* ``mappings._gather_along_first_dim`` with ``output_split_sizes`` all-gathers tensors of
  different lengths, which gloo rejects; the stand-in pads every part to the longest, gathers
  and trims: the same rows in the same order.
"""

from __future__ import annotations

TOKEN_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MAPPINGS = "megatron.core.tensor_parallel.mappings"


def no_te_general_gemm(original):
    return original  # None when the module lacked the name (TE missing); TE's own function otherwise


def split_sizes_to_numpy(original):
    import functools

    import torch

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def padded_uneven_all_gather(original):
    import functools

    import torch
    import torch.distributed as dist

    @functools.wraps(original)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)

    return _gather_along_first_dim
