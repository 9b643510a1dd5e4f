"""(stand-in, for ``te_runtime``) Transformer Engine's multi-tensor
kernels on CPU, which megatron-core's gradient clipping and BF16 optimizer and TE's ``FusedAdam``
(Megatron-LM's optimizer where TE is installed) call: ``tex.multi_tensor_scale``,
``tex.multi_tensor_l2norm`` and ``tex.multi_tensor_adam``, in FP32."""

from __future__ import annotations

import functools

import torch


# -- the optimizer's multi-tensor kernels (megatron-core's gradient clipping and FP16 copies bind
#    them from transformer_engine.pytorch.optimizers when TE is installed) -------------------------

def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``out[i] = in[i] * scale`` for ``tensor_lists = [inputs, outputs]``, the product in FP32
    (TE's kernel computes in float) written in the output's dtype; a non-finite input sets
    ``noop_flag`` to 1."""
    inputs, outputs = tensor_lists[0], tensor_lists[1]
    for source, target in zip(inputs, outputs):
        product = source.float() * scale
        if not torch.isfinite(source).all():
            noop_flag.fill_(1)
        target.copy_(product.to(target.dtype))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """``(total, per_tensor_norms)``: the FP32 L2 norm of all of ``tensor_lists[0]`` together (a
    one-element FP32 tensor) and, with ``per_tensor``, each tensor's; summed in torch's order (the
    CUDA kernel's is per chunk, then across chunks: the figures may differ in the last bits)."""
    tensors = tensor_lists[0]
    norms = torch.stack([t.float().norm() for t in tensors]) if tensors else torch.zeros(0)
    if tensors and not torch.isfinite(norms).all():
        noop_flag.fill_(1)
    total = norms.norm().reshape(1) if tensors else torch.zeros(1)
    return total, (norms if per_tensor else torch.zeros(0))


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
                      bias_correction, weight_decay):
    """TE's ``FusedAdam`` step (``multi_tensor_adam.cu``'s ``AdamFunctor``) on ``tensor_lists = [grads,
    params, exp_avgs, exp_avg_sqs]`` (with a fifth, FP32 master params: the update runs on them and
    the params get it rounded): in FP32, ``mode`` 1 AdamW (decoupled weight decay added to the update),
    0 Adam with L2 (decay added to the gradient); the bias corrections ``1 - beta^step`` as the host
    computes them. Each tensor is updated in place."""
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists[:4]
    masters = tensor_lists[4] if len(tensor_lists) > 4 else params
    c1 = float(1 - beta1 ** step) if bias_correction else 1.0
    c2 = float(1 - beta2 ** step) if bias_correction else 1.0
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    lr_, b1, b2, eps_, decay, c1_, c2_ = (f32(v) for v in (lr, beta1, beta2, eps, weight_decay, c1, c2))
    for g, p, m, v, master in zip(grads, params, exp_avgs, exp_avg_sqs, masters):
        r_g, r_p, r_m, r_v = g.float(), master.float(), m.float(), v.float()
        if not torch.isfinite(r_g).all():
            noop_flag.fill_(1)
        if mode == 0:
            r_g = r_g + decay * r_p
        r_m = b1 * r_m + (1 - b1) * r_g
        r_v = b2 * r_v + (1 - b2) * r_g * r_g
        update = (r_m / c1_) / (torch.sqrt(r_v / c2_) + eps_)
        if mode != 0:
            update = update + decay * r_p
        r_p = r_p - lr_ * update
        m.copy_(r_m.to(m.dtype))
        v.copy_(r_v.to(v.dtype))
        master.copy_(r_p.to(master.dtype))
        if master is not p:
            p.copy_(r_p.to(p.dtype))
