"""FP32 tensor-parallel reductions in megatron-core's local layers, on real megatron-core over gloo.

Every rank holds different inputs; numerics are compared against independent oracles (exact
integer sums, all-gather + plain FP32 matmul, an FP32 TP=1 model with the same weights).
"""

import pytest
import torch

from megapatch.testing import run_ranks

MODES = ("fp32", "fp32-accumulate")
PLANTED = (256.0, 1.0, 1.0, -256.0)  # exact sum 2; BF16 partial sums lose the 1s


def _linear_config(sequence_parallel=False):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=8,
                             tensor_model_parallel_size=torch.distributed.get_world_size(),
                             sequence_parallel=sequence_parallel, params_dtype=torch.bfloat16,
                             bf16=True, use_cpu_initialization=True, perform_initialization=False,
                             gradient_accumulation_fusion=False)


def _column_dgrad(c, sequence_parallel=False, frozen=False):
    """dgrad of a column-parallel layer whose rank-local partial dgrad is exactly ``c``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    tp = torch.distributed.get_world_size()
    layer = ColumnParallelLinear(8, tp, config=_linear_config(sequence_parallel), init_method=None,
                                 bias=False, gather_output=False)
    with torch.no_grad():
        layer.weight.fill_(c)
    layer.weight.requires_grad_(not frozen)
    rows = 2 if sequence_parallel else 2 * tp  # SP: this rank's sequence shard
    x = torch.full((rows, 1, 8), 1.0 / 8, dtype=torch.bfloat16, requires_grad=True)
    out, _ = layer(x)
    out.backward(torch.ones_like(out))
    return x.grad.float().flatten().tolist()


def _every_reduction_path(ctx):
    import megapatch
    from megatron.core.tensor_parallel import mappings

    c = PLANTED[ctx.rank]
    group = ctx.tp_group
    by_mode = {}
    for mode in ("native",) + MODES:
        megapatch.enable(tp_reduce_dtype=mode)
        found = by_mode[mode] = {}
        found["forward all-reduce"] = mappings.reduce_from_tensor_model_parallel_region(
            torch.full((16,), c, dtype=torch.bfloat16), group=group).float().tolist()
        x = torch.zeros(16, dtype=torch.bfloat16, requires_grad=True)
        mappings.copy_to_tensor_model_parallel_region(x, group=group).backward(
            torch.full((16,), c, dtype=torch.bfloat16))
        found["backward all-reduce (copy_to)"] = x.grad.float().tolist()
        found["SP reduce-scatter"] = mappings.reduce_scatter_to_sequence_parallel_region(
            torch.full((16, 3), c, dtype=torch.bfloat16), group=group).float().flatten().tolist()
        x = torch.zeros(4, 3, dtype=torch.bfloat16, requires_grad=True)
        mappings.gather_from_sequence_parallel_region(x, group=group).backward(
            torch.full((16, 3), c, dtype=torch.bfloat16))
        found["SP gather backward reduce-scatter"] = x.grad.float().flatten().tolist()
        found["column dgrad async all-reduce"] = _column_dgrad(c)
        found["column dgrad async reduce-scatter (SP)"] = _column_dgrad(c, sequence_parallel=True)
        found["frozen-weight dgrad all-reduce"] = _column_dgrad(c, frozen=True)
        found["int64 all-reduce untouched"] = mappings.reduce_from_tensor_model_parallel_region(
            torch.full((4,), ctx.rank + 1, dtype=torch.int64), group=group).tolist()
    megapatch.disable()
    return by_mode


@pytest.fixture(scope="module")
def reduction_paths():
    return run_ranks(_every_reduction_path, world_size=4, tp=4, timeout=300)


@pytest.mark.parametrize("mode", MODES)
def test_every_tp_reduction_sums_exactly_in_fp32(reduction_paths, mode):
    for rank, by_mode in enumerate(reduction_paths):
        for path, values in by_mode[mode].items():
            expected = 10 if path.startswith("int64") else 2.0
            assert values and all(v == expected for v in values), (mode, rank, path, values)


def test_native_gloo_bf16_sums_are_not_exact(reduction_paths):
    """The oracle above can fail: natively gloo sums BF16 in BF16 and loses the 1s somewhere."""
    wrong = {path for by_mode in reduction_paths for path, values in by_mode["native"].items()
             if any(v != 2.0 for v in values) and not path.startswith("int64")}
    assert "forward all-reduce" in wrong and len(wrong) >= 2, wrong


def _integer_tensor(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=generator).to(torch.bfloat16)


def _row_parallel_vs_oracle(ctx, mode, k_total=512, n_out=16, tokens=6):
    import megapatch
    from megatron.core.tensor_parallel import RowParallelLinear
    from megapatch.testing import gather_tp_logits

    if mode != "native":
        megapatch.enable(tp_reduce_dtype=mode)
    tp = ctx.tp_size
    layer = RowParallelLinear(k_total, n_out, config=_linear_config(), init_method=None, bias=True,
                              input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        layer.weight.copy_(_integer_tensor((n_out, k_total // tp), seed=100 + ctx.rank))
        layer.bias.copy_(_integer_tensor((n_out,), seed=7))
    x = _integer_tensor((tokens, 1, k_total // tp), seed=200 + ctx.rank).requires_grad_()
    out, _ = layer(x)
    grad = _integer_tensor(out.shape, seed=300)
    out.backward(grad)
    # oracle: all-gather the shards, plain FP32 matmul (integers: every partial sum is exact)
    full_x = gather_tp_logits(x.detach(), ctx).float()
    full_w = gather_tp_logits(layer.weight.detach(), ctx).float()
    oracle = (full_x @ full_w.t() + layer.bias.detach().float()).to(torch.bfloat16)
    megapatch.disable()
    return {"out": out.detach().float(), "oracle": oracle.float(), "dtype": str(out.dtype),
            "x_grad": x.grad.float(), "w_grad": layer.weight.grad.float()}


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_hands_its_fp32_accumulator_to_the_reduction(tp):
    native = run_ranks(_row_parallel_vs_oracle, world_size=tp, tp=tp, args=("native",))
    fp32 = run_ranks(_row_parallel_vs_oracle, world_size=tp, tp=tp, args=("fp32",))
    for rank in range(tp):
        assert fp32[rank]["dtype"] == "torch.bfloat16"
        # one rounding of the exact sum: bit-identical to the oracle
        assert torch.equal(fp32[rank]["out"], fp32[rank]["oracle"]), rank
        # natively each rank's partial sum is rounded to BF16 first: the oracle catches it
        assert not torch.equal(native[rank]["out"], native[rank]["oracle"]), rank
        # the backward is upstream's: same BF16 gradient in, bit-identical grads out
        assert torch.equal(fp32[rank]["x_grad"], native[rank]["x_grad"])
        assert torch.equal(fp32[rank]["w_grad"], native[rank]["w_grad"])


def _tiny_gpt_step(ctx, mode, sequence_parallel, enable_then_disable=False):
    import megapatch
    from megapatch.testing import build_tiny_gpt, gather_tp_logits, make_batch, tiny_gpt_config

    if enable_then_disable:
        megapatch.enable(tp_reduce_dtype="fp32")
        megapatch.disable()
    elif mode != "native":
        megapatch.enable(tp_reduce_dtype=mode)
    config = tiny_gpt_config(tp=ctx.tp_size, sequence_parallel=sequence_parallel)
    model = build_tiny_gpt(config, vocab_size=128, seq_len=16, seed=1234)
    batch = make_batch(seed=5, batch=2, seq_len=16, vocab=128)
    logits = model(batch.tokens, batch.position_ids, batch.attention_mask)
    logits.float().sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    result = {"logits": gather_tp_logits(logits, ctx).float(), "grads": grads,
              "active": megapatch.status().active}
    megapatch.disable()
    return result


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_disabled_megapatch_is_bit_identical_to_stock(sequence_parallel):
    stock = run_ranks(_tiny_gpt_step, world_size=2, tp=2, args=("native", sequence_parallel))
    toggled = run_ranks(_tiny_gpt_step, world_size=2, tp=2, args=("native", sequence_parallel, True))
    for a, b in zip(stock, toggled):
        assert b["active"] == []
        assert torch.equal(a["logits"], b["logits"])
        assert a["grads"].keys() == b["grads"].keys()
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), name


def _fp32_reference_logits(ctx):
    """The same tiny GPT (same seed, hence the same BF16-rounded weights) run in FP32 at TP=1."""
    from megapatch.testing import build_tiny_gpt, make_batch, reinit_model_parallel, tiny_gpt_config

    reinit_model_parallel(ctx, tp=1)
    bf16_model = build_tiny_gpt(tiny_gpt_config(tp=1), vocab_size=128, seq_len=16, seed=1234)
    fp32_config = tiny_gpt_config(tp=1, params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False)
    model = build_tiny_gpt(fp32_config, vocab_size=128, seq_len=16, seed=1234)
    model.load_state_dict(bf16_model.state_dict())  # the BF16 weights, held in FP32
    batch = make_batch(seed=5, batch=2, seq_len=16, vocab=128)
    with torch.no_grad():
        return model(batch.tokens, batch.position_ids, batch.attention_mask).float()


def _drift(ctx, sequence_parallel):
    logits = {mode: _tiny_gpt_step(ctx, mode, sequence_parallel)["logits"]
              for mode in ("native",) + MODES}
    reference = _fp32_reference_logits(ctx)
    return {mode: (value - reference).abs().mean().item() for mode, value in logits.items()}


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (4, False), (4, True)])
def test_fp32_reductions_bring_tiny_gpt_closer_to_fp32_reference(tp, sequence_parallel):
    errors = run_ranks(_drift, world_size=tp, tp=tp, args=(sequence_parallel,))[0]
    assert errors["fp32"] < errors["native"], errors
    assert errors["fp32-accumulate"] <= errors["native"], errors
