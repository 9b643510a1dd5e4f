"""tp_invariant=True on CUDA: the tiny GPT's logits, loss, gradients and parameters after 3 clipped
AdamW steps (megatron-core's BF16 optimizer) are bit-identical at every TP size the GPUs allow
(TP 1, 2, 4, 8 dividing W=8; NCCL, one GPU per rank, world = the largest power of two <= the GPU
count, data-parallel replicas at smaller TP sizes); native reductions are not (precondition).

Also, on one GPU: a fixed-shape block GEMM gives the same bits whatever tensor the block was cut
from (the property the design relies on for cuBLAS). Run: ``pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import pytest
import torch

from megapatch.testing import run_ranks

STEPS = 3
CLIP = 0.05
SHAPE = dict(config=dict(num_attention_heads=8), vocab=128, seq=16)


def _world() -> int:
    count = min(8, torch.cuda.device_count()) if torch.cuda.is_available() else 0
    world = 1
    while world * 2 <= count:
        world *= 2
    return world


pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(_world() < 2, reason="needs 2+ CUDA GPUs (one per TP rank, NCCL)")


@needs_cuda
def test_block_gemm_bits_do_not_depend_on_the_surrounding_tensor():
    from megapatch.numerics.block_tree import f32

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 512, device="cuda", generator=gen).to(torch.bfloat16)
    w = torch.randn(1024, 512, device="cuda", generator=gen).to(torch.bfloat16)
    block = slice(128, 256)  # one of 8 blocks of N
    from_full = f32(x) @ f32(w[block]).t()
    from_half = f32(x) @ f32(w[:512][block]).t()  # the same block cut from TP=2's shard
    assert torch.equal(from_full, from_half)
    kblock = slice(64, 128)  # one of 8 blocks of K
    assert torch.equal(f32(x[:, kblock]) @ f32(w[:, kblock]).t(),
                       f32(x[:, :256][:, kblock]) @ f32(w[:, :256][:, kblock]).t())
    # the mode's CUDA path: BF16 operands, one FP32-output GEMM per block (operand / product)
    from megapatch.numerics.block_tree import operand, product

    assert operand(w[block]).dtype == torch.bfloat16
    full = product(operand(x), operand(w[block]).t())
    assert full.dtype == torch.float32
    assert torch.equal(full, product(operand(x), operand(w[:512][block]).t()))
    assert torch.equal(product(operand(x[:, kblock]), operand(w[:, kblock]).t()),
                       product(operand(x[:, :256][:, kblock]), operand(w[:, :256][:, kblock]).t()))


def _run(tp, mode):
    import megapatch
    from megatron.core import parallel_state
    from megapatch.testing import build_tiny_gpt, gather_full_weights, make_batch, tiny_gpt_config
    from megapatch.testing.models.tiny_gpt import build_bf16_optimizer, gather_full_grads, gather_tp_logits

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    megapatch.enable(tp_invariant=True) if mode == "invariant" else megapatch.disable()
    config = tiny_gpt_config(tp=tp, **SHAPE["config"])
    model = build_tiny_gpt(config, vocab_size=SHAPE["vocab"], seq_len=SHAPE["seq"]).cuda()
    optimizer = build_bf16_optimizer(model, clip_grad=CLIP)
    result, norms = {}, []
    for step in range(STEPS):
        batch = [t.cuda() for t in make_batch(seed=5 + step, batch=2, seq_len=SHAPE["seq"],
                                              vocab=SHAPE["vocab"])]
        tokens, position_ids, labels, mask = batch
        optimizer.zero_grad()
        if step == 0:
            with torch.no_grad():
                result["logits"] = gather_tp_logits(model(tokens, position_ids, mask)).float().cpu()
        loss = model(tokens, position_ids, mask, labels=labels)
        loss.float().mean().backward()
        if step == 0:
            result["loss"] = loss.detach().float().cpu()
            result["grads"] = {n: g.cpu() for n, g in gather_full_grads(model).items()}
        ok, norm, _ = optimizer.step()
        norms.append(norm)
    result["norms"] = norms
    result["params"] = {n: p.float().cpu() for n, p in gather_full_weights(model).items()}
    megapatch.disable()
    return result


def _all_runs(ctx):
    results = {}
    tp = 1
    while tp <= ctx.world_size:
        for mode in ("invariant", "native"):
            results[(mode, tp)] = _run(tp, mode)
        tp *= 2
    return results


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_all_runs, _world(), init_megatron=False, backend="nccl", timeout=900)[0]


def _differing(a, b):
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


@needs_two
def test_bit_identical_at_every_tp_size(runs):
    base = runs[("invariant", 1)]
    assert all(norm > CLIP for norm in base["norms"])
    tps = sorted(tp for mode, tp in runs if mode == "invariant" and tp > 1)
    assert tps
    for tp in tps:
        here = runs[("invariant", tp)]
        assert torch.equal(here["logits"], base["logits"]), tp
        assert torch.equal(here["loss"], base["loss"]), tp
        assert _differing(base["grads"], here["grads"]) == [], tp
        assert here["norms"] == base["norms"], tp
        assert _differing(base["params"], here["params"]) == [], tp


@needs_two
def test_precondition_native_is_not_bit_identical(runs):
    base = runs[("native", 1)]
    tps = sorted(tp for mode, tp in runs if mode == "native" and tp > 1)
    assert any(_differing(base["grads"], runs[("native", tp)]["grads"]) for tp in tps)
