"""Fidelity, not only agreement (issue 48 item 7): what ``tp_invariant`` computes against an oracle
that is not the mode's own code -- upstream's native module on the same inputs (megatron-core's
``DotProductAttention`` and ``forward_step_calc_loss`` with the mode off), an FP64 reference, or the
exact (``Fraction``) value -- within a BF16 bound or bit for bit, over the flags that change the
function (masks, padded rows, sliding windows, NaN/Inf on one rank, overlap-grad-reduce).

Each test names the audit survivor of issue 48 it kills (N04, N05, N16: attention; N02: the scalar
sum; N08: expert-gradient terms; N10: the overlapped grad reduce; N12: the loss report). The
Transformer Engine survivors (N24, N25) are killed in tests/test_tp_invariant_fidelity_te.py."""

from __future__ import annotations

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from megapatch.testing import run_ranks
from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
from tests.conftest import bare_module

# -- core attention against upstream's DotProductAttention -----------------------------------------

SEQ, BATCH, HEADS, GROUPS, DIM = 64, 2, 4, 2, 32
#: a BF16 bound for attention outputs of magnitude ~1 computed in other orders: a few BF16 ulps
BF16_BOUND = 2 ** -6


def _qkv(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(SEQ, BATCH, HEADS, DIM, generator=gen).bfloat16()
    k = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=gen).bfloat16()
    v = torch.randn(SEQ, BATCH, GROUPS, DIM, generator=gen).bfloat16()
    return q, k, v


def _module(heads: int, groups: int, dim: int, mask_type: str = "causal", window=None):
    """megatron-core's local ``DotProductAttention`` built bare, as upstream configures it for BF16
    (also tests/test_tp_invariant_attention_blocks.py's)."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()
    kind = getattr(AttnMaskType, mask_type)
    attention = bare_module(DotProductAttention)
    attention.config = SimpleNamespace(sequence_parallel=True)  # upstream: no RNG-tracker fork around (p=0) dropout
    attention.attn_mask_type = kind
    attention.num_attention_heads_per_partition, attention.num_query_groups_per_partition = heads, groups
    attention.hidden_size_per_partition = heads * dim
    attention.softmax_scale = 1.0 / math.sqrt(dim)
    attention.softmax_offset = None
    attention.attention_dropout = torch.nn.Dropout(0.0)
    attention.scale_mask_softmax = FusedScaleMaskSoftmax(
        input_in_fp16=False, input_in_bf16=True, attn_mask_type=kind, scaled_masked_softmax_fusion=False,
        mask_func=attention_mask_func, softmax_in_fp32=True, scale=None, window_size=window)
    attention.eval()
    return attention


def _attention(q, k, v, mode: bool, mask=None, mask_type="causal", window=None):
    """megatron-core's local ``DotProductAttention.forward`` through the patch's wrapper, the mode on
    (the mode's attention) or off (upstream's own forward): context [s, b, heads, dim]."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megapatch.core import options, state
    from megapatch.patches.tp_invariant import attention as patch

    attention = _module(q.shape[2], k.shape[2], q.shape[3], mask_type, window)
    saved = state._current
    state._current = options.Settings(tp_invariant=mode)
    try:
        with cpu_workarounds():  # upstream's attention buffer (and SWA mask) are CUDA allocations
            context = patch._local_attention(DotProductAttention.forward.__get__(attention), attention,
                                             (q, k, v, mask), {})
    finally:
        state._current = saved
    return context.view(q.shape)


def _fp64_attention(q, k, v, masked):
    """softmax(q kᵀ / √d with masked scores at upstream's -10000) v in FP64; ``masked`` [b, 1|np, sq, sk]
    True where masked. Grouped keys repeated per head. Returns [s, b, heads, dim] in FP64."""
    heads, dim = q.shape[2], q.shape[3]
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, np, s, d]
    scores = (qd @ kd.transpose(-1, -2)) / math.sqrt(dim)
    scores = scores.masked_fill(masked, -10000.0)
    return (scores.softmax(-1) @ vd).permute(2, 0, 1, 3)


def _causal(sq, sk):
    return torch.ones(sq, sk, dtype=torch.bool).triu(1)


def test_causal_attention_is_upstreams_function_bit_for_bit_at_tp1_and_per_tp_rank():
    """N05 (probabilities not rounded to the activation dtype as upstream's BF16 softmax rounds
    them: 2,967 of 8,192 outputs differ): the mode's attention against upstream's own local attention
    on the same inputs -- at TP 1 and with a TP 2 rank's heads -- differs in (almost) no output, and
    both are within a BF16 bound of FP64."""
    q, k, v = _qkv(0)
    mode, upstream = _attention(q, k, v, True), _attention(q, k, v, False)
    differ = (mode != upstream).sum().item()
    assert differ <= mode.numel() // 100, f"{differ} of {mode.numel()} outputs differ from upstream's"
    oracle = _fp64_attention(q, k, v, _causal(SEQ, SEQ))
    assert (mode.double() - oracle).abs().max() < BF16_BOUND
    # a TP-2 rank: half the heads and half the KV groups, against upstream at TP 1
    rank1 = _attention(q[:, :, 2:].contiguous(), k[:, :, 1:].contiguous(), v[:, :, 1:].contiguous(), True)
    assert (rank1 != upstream[:, :, 2:]).sum().item() <= rank1.numel() // 100


def test_a_padded_query_row_that_sees_no_key_averages_the_values_as_upstream():
    """N04 (masked keys at -inf instead of upstream's -10000: NaN in a row that sees no key): a
    padding mask whose last rows see no key at all -- upstream's softmax over -10000 everywhere
    averages the values; the mode must give the same, not NaN."""
    q, k, v = _qkv(1)
    mask = torch.zeros(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    mask[:, :, :, 40:] = True   # padded keys
    mask[:, :, 50:, :] = True   # padded query rows: no key visible
    mode = _attention(q, k, v, True, mask, "padding")
    upstream = _attention(q, k, v, False, mask, "padding")
    assert not mode.isnan().any()
    oracle = _fp64_attention(q, k, v, mask)
    assert (mode.double() - oracle).abs().max() < BF16_BOUND
    assert (mode != upstream).sum().item() <= mode.numel() // 100
    # the rows that see nothing: the values' mean over every key (upstream's function), per head
    mean = v.double().repeat_interleave(HEADS // GROUPS, dim=2).mean(0)  # [b, np, d]
    assert (mode[50:].double() - mean).abs().max() < BF16_BOUND


def test_sliding_window_attention_is_upstreams_windowed_attention():
    """N16 (the ``window_size`` condition dropped: the window runs as full causal attention, max
    |diff| 1.74): with a window the mode leaves core attention to upstream's windowed softmax; the
    result is within a BF16 bound of an FP64 windowed reference and far from full causal attention."""
    q, k, v = _qkv(2)
    window = (8, 0)
    mode = _attention(q, k, v, True, window=window)
    upstream = _attention(q, k, v, False, window=window)
    outside = ~(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(-window[0]).tril(window[1]))
    oracle = _fp64_attention(q, k, v, outside)
    assert (upstream.double() - oracle).abs().max() < BF16_BOUND  # the oracle is upstream's function
    assert (mode.double() - oracle).abs().max() < BF16_BOUND
    assert (mode != upstream).sum().item() <= mode.numel() // 100
    assert (_attention(q, k, v, False).double() - oracle).abs().max() > 0.5  # the window matters here


# -- expert-gradient terms (gradient_terms.source_terms) --------------------------------------------

def test_each_sources_expert_gradient_is_a_term_rounded_as_a_dense_micro_batch_gradient(monkeypatch):
    """N08 (each source's FP32 partial deposited unrounded: an expert's gradient at EP 2 is
    [2.0009765625, 2.0] against [2.0, 2.0] at EP 1): the terms handed to the exact data-parallel sum
    are each source's partial rounded to the gradient dtype -- what the source's data-parallel rank
    computes at EP 1 for the same tokens -- so their exact sum is the EP-1 sum."""
    from megapatch.core import options, state
    from megapatch.numerics import gradient_terms

    monkeypatch.setattr(state, "_current", options.Settings(tp_invariant=True))
    ep1 = [torch.tensor([1.0 + 2 ** -10, 1.0]), torch.tensor([1.0 + 2 ** -10, 1.0])]  # not BF16 values
    deposited = []
    param = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    setattr(param, gradient_terms.SEQUENCE_TERMS, deposited.extend)
    sources = gradient_terms.TokenSources(counts=(3, 5), leaves=(0, 1), group=None, total=2)
    returned = gradient_terms.source_terms(param, ep1, sources, torch.bfloat16)
    terms = [returned, *deposited]
    assert len(terms) == 2 and all(t.dtype == torch.bfloat16 for t in terms)
    # EP 1: each data-parallel rank's own expert gradient is its partial in BF16
    for term, partial in zip(terms, ep1):
        assert torch.equal(term, partial.bfloat16())
    assert sum(t.double() for t in terms).tolist() == [2.0, 2.0]


# -- the loss report (tp_invariant.loss_scale) against the exact sums ---------------------------------

def test_the_loss_report_sums_are_exact_in_any_micro_batch_order(monkeypatch):
    """N12 (the report handed on in FP32: its sums depend on the order of micro-batches and ranks,
    1.0 vs 1.0000001): upstream's ``forward_step_calc_loss`` through the patch's wrapper hands each
    micro-batch's ``[loss sum, tokens]`` on; Megatron-LM sums them over micro-batches (``vstack``,
    ``sum``) and DP ranks. Those sums must be the exact value whatever the order."""
    from megatron.core.pipeline_parallel import schedules

    from megapatch.core import options, state
    from megapatch.patches.tp_invariant import loss_scale

    monkeypatch.setattr(state, "_current", options.Settings(tp_invariant=True))
    monkeypatch.setattr(loss_scale, "_data_parallel_size", lambda: 1)
    config = SimpleNamespace(grad_scale_func=None, calculate_per_token_loss=False, timers=None)
    sums = [1.0, 2.0 ** -24, 2.0 ** -24, 3.0 * 2 ** -25]  # FP32 values whose FP32 sums follow the order
    reports = []
    for value in sums:
        def loss_func(output, value=value):
            loss = output.sum() * 0 + value
            tokens = torch.tensor(4, dtype=torch.int)
            return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.float().view(1)])}

        output = torch.zeros(3, requires_grad=True)
        loss_scale._forward_step_calc_loss(
            schedules.forward_step_calc_loss, None,
            (SimpleNamespace(), output, loss_func, config, None, False, len(sums), reports, 1, True), {})
    exact = float(sum(Fraction(v) for v in sums))
    for order in (reports, reports[::-1], reports[1:] + reports[:1]):
        total = torch.vstack([r["lm loss"].view(-1) for r in order]).sum(dim=0)
        assert total[0].item() == exact and total[1].item() == 4.0 * len(sums), (total.dtype, total.tolist())
    assert float(torch.tensor(sums, dtype=torch.float32).sum()) != exact  # FP32 would round here


# -- across ranks: the scalar sum with NaN/Inf on one rank, the overlapped data-parallel reduce --------

def _ranks_job(ctx):
    import megapatch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megapatch.numerics import exact_sum

    out = {}
    # N02: an Inf on rank 1 only, finite values on rank 0
    values = [1.0, 2.0] if ctx.rank == 0 else [10.0, float("inf")]
    out["scalar_inf"] = exact_sum.scalar_sum(values, torch.distributed.group.WORLD)
    out["scalar"] = exact_sum.scalar_sum([1.0, 2.0 ** -60] if ctx.rank == 0 else [-1.0, 3.0],
                                         torch.distributed.group.WORLD)
    # N10: megatron-core's DDP with --overlap-grad-reduce under the mode
    megapatch.enable(tp_invariant=True)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(4, 2))
    local = [p.detach().clone().double().requires_grad_() for p in module.parameters()]
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True), module)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 + ctx.rank))
    ddp(x).square().sum().backward()
    try:
        ddp.finish_grad_sync()
        out["finish"] = None
    except Exception as exc:  # noqa: BLE001 -- the test names it (the N02 check above stays independent)
        out["finish"] = f"{type(exc).__name__}: {exc}"
    out["grads"] = [p.main_grad.clone() for p in ddp.module.parameters()]
    # the oracle: each rank's own gradient in FP64, summed over the ranks in FP64
    h = x.double() @ local[0].t()
    (h @ local[1].t() + local[2]).square().sum().backward()
    mine = torch.cat([p.grad.view(-1) for p in local])
    every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(every, mine)
    out["oracle"] = sum(every)
    megapatch.disable()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_ranks_job, world_size=2, timeout=240)


def test_an_inf_on_one_rank_gives_nan_on_every_rank(two_ranks):
    """N02 (``scalar_sum`` reads only its own rank's NaN/Inf flag: rank 0 NaN, rank 1 a finite sum):
    every rank must get NaN (the grad norm, clipping and the skip decision are the same on all)."""
    assert all(math.isnan(out["scalar_inf"]) for out in two_ranks), [o["scalar_inf"] for o in two_ranks]
    assert all(out["scalar"] == 3.0 + 2.0 ** -60 for out in two_ranks)  # exact (FP64 would drop 2**-60)


def test_the_overlapped_grad_reduce_is_waited_on_and_gives_the_fp64_sum(two_ranks):
    """N10 (no grad-reduce handle under ``--overlap-grad-reduce``: upstream's ``finish_grad_sync``
    raises an AssertionError): megatron-core's DDP with ``overlap_grad_reduce=True`` under the mode
    finishes its sync, and each parameter's gradient is the data-parallel sum of the ranks' own
    gradients (the mode leaves DDP's 1/DP to the loss seed) within FP32 rounding of FP64."""
    for out in two_ranks:
        assert out["finish"] is None, out["finish"]
        got = torch.cat([g.view(-1) for g in out["grads"]]).double()
        assert torch.allclose(got, out["oracle"], rtol=1e-5, atol=1e-5), (got, out["oracle"])
