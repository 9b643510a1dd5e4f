"""(stand-in, for ``te_runtime``) Every ``transformer_engine_torch``
(``tex``) function the CPU runtime implements, by name (:data:`KERNELS`); the runtime installs
them in place of TE's and refuses every other one."""

from __future__ import annotations

from typing import Callable, Dict

from megapatch.testing.stand_ins.te_cpu_activations import (_ACTIVATIONS, _GATED, _activation,
                                                            _activation_backward, _gated, _gated_backward)
from megapatch.testing.stand_ins.te_cpu_attention import (get_cudnn_version, get_fused_attn_backend,
                                                          scaled_masked_softmax_backward,
                                                          scaled_masked_softmax_forward, scaled_softmax_backward,
                                                          scaled_softmax_forward)
from megapatch.testing.stand_ins.te_cpu_gemm import generic_gemm, te_general_grouped_gemm
from megapatch.testing.stand_ins.te_cpu_norms import layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd
from megapatch.testing.stand_ins.te_cpu_optimizer import multi_tensor_adam, multi_tensor_l2norm, multi_tensor_scale

#: every tex function the runtime implements, by name
KERNELS: Dict[str, Callable] = {
    "get_cudnn_version": get_cudnn_version,
    "get_fused_attn_backend": get_fused_attn_backend,
    "scaled_softmax_forward": scaled_softmax_forward,
    "scaled_softmax_backward": scaled_softmax_backward,
    "scaled_masked_softmax_forward": scaled_masked_softmax_forward,
    "scaled_masked_softmax_backward": scaled_masked_softmax_backward,
    "multi_tensor_adam": multi_tensor_adam,
    "multi_tensor_scale": multi_tensor_scale,
    "multi_tensor_l2norm": multi_tensor_l2norm,
    "generic_gemm": generic_gemm,
    "te_general_grouped_gemm": te_general_grouped_gemm,
    "layernorm_fwd": layernorm_fwd,
    "layernorm_bwd": layernorm_bwd,
    "rmsnorm_fwd": rmsnorm_fwd,
    "rmsnorm_bwd": rmsnorm_bwd,
    **{name: _activation(name) for name in _ACTIVATIONS},
    **{f"d{name}": _activation_backward(name) for name in _ACTIVATIONS},
    **{name: _gated(name) for name in _GATED},
    **{f"d{name}": _gated_backward(name) for name in _GATED},
}
