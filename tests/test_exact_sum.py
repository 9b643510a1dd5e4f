"""megapatch.numerics.exact_sum: the order-independent data-parallel sum of tp_invariant.

Oracle: the definition computed with Python integers and fractions, element by element (each
contribution truncated toward zero on the grid 2**((top - 2) * 16) set by the element's largest
|contribution|, the integers summed, the sum rounded to FP32 once) -- no torch in it. The real
collectives (MAX all-reduce, int64 all-reduce and reduce-scatter) run on gloo ranks.
"""

import math
import random
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megapatch.numerics import exact_sum as es
from megapatch.testing import run_ranks


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).float())


def _oracle_element(contributions):
    """The exact sum's FP32 value for one element, from its Python-float contributions."""
    if any(not math.isfinite(c) for c in contributions):
        return float("nan")
    nonzero = [c for c in contributions if c != 0]
    if not nonzero:
        return 0.0
    top = max((math.frexp(c)[1] - 1) // es.BIN for c in nonzero)  # the leading bit's bin
    unit = Fraction(2) ** ((top - (es.LIMBS - 1)) * es.BIN)
    total = sum(int(Fraction(c) / unit) for c in nonzero)  # int() truncates toward zero
    return _fp32(float(Fraction(total) * unit))


def _oracle(rows):
    columns = zip(*[row.tolist() for row in rows])
    return torch.tensor([_oracle_element(list(c)) for c in columns], dtype=torch.float32)


def _wide(rng: random.Random, n: int, spread: int = 40) -> torch.Tensor:
    """FP32 values over ``2**-spread .. 2**spread`` with random signs, some zeros and subnormals."""
    values = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.1:
            values.append(0.0)
        elif kind < 0.15:
            values.append(rng.choice([-1, 1]) * rng.random() * 2.0 ** -140)  # subnormal
        else:
            values.append(rng.choice([-1, 1]) * rng.random() * 2.0 ** rng.randint(-spread, spread))
    return torch.tensor(values, dtype=torch.float32)


def _summed(rows, order=None, start: int = 0, numel=None):
    acc = es.Accumulator(numel or rows[0].numel() + start)
    for i in order or range(len(rows)):
        acc.add(start, rows[i])
    return acc.total()[start:]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_sum_is_the_truncated_exact_sum_of_its_definition():
    rng = random.Random(7)
    rows = [_wide(rng, 300) for _ in range(9)]
    assert _bits_equal(_summed(rows), _oracle(rows))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10 ** 6), count=st.integers(1, 12), spread=st.integers(0, 60))
def test_any_order_gives_the_same_bits_and_the_definitions_value(seed, count, spread):
    rng = random.Random(seed)
    rows = [_wide(rng, 40, spread) for _ in range(count)]
    order = list(range(count))
    rng.shuffle(order)
    forward, shuffled = _summed(rows), _summed(rows, order)
    assert _bits_equal(forward, shuffled)
    assert _bits_equal(forward, _oracle(rows))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10 ** 6), count=st.integers(1, 12), spread=st.integers(0, 60),
       cut=st.integers(0, 12))
def test_terms_added_in_one_pass_give_the_bits_of_adding_them_one_by_one(seed, count, spread, cut):
    """``add_terms`` (the per-sequence and per-source deposits): a batch of contributions, after
    or before others that raise or keep the elements' grids, gives the definition's value, as the
    same contributions added one at a time do."""
    rng = random.Random(seed)
    rows = [_wide(rng, 40, spread) for _ in range(count)]
    cut = min(cut, count)
    acc = es.Accumulator(40)
    if cut:
        acc.add_terms(0, rows[:cut])
    for row in rows[cut:]:
        acc.add(0, row)
    assert _bits_equal(acc.total(), _oracle(rows))
    assert _bits_equal(acc.total(), _summed(rows))
    assert max(acc.counts.values()) == count


def test_order_matters_for_an_fp32_running_sum_of_the_same_inputs():
    """The precondition: these inputs make a plain FP32 sum order-dependent."""
    rows = [torch.tensor([1.0]), torch.tensor([2.0 ** -24]), torch.tensor([2.0 ** -24])]
    assert (rows[0] + rows[1]) + rows[2] != rows[0] + (rows[1] + rows[2])
    assert _summed(rows).item() == _summed(rows, [1, 2, 0]).item() == _fp32(1 + 2.0 ** -23)


def test_it_is_closer_to_the_exact_sum_than_an_fp32_running_sum():
    rng = random.Random(3)
    rows = [_wide(rng, 500, 20) for _ in range(64)]
    exact = torch.tensor([math.fsum(c) for c in zip(*[r.tolist() for r in rows])], dtype=torch.float64)
    largest = torch.stack(rows).abs().max(0).values.double()
    ours = (_summed(rows).double() - exact).abs()
    running = (functools_sum(rows).double() - exact).abs()
    # truncation error below N * 2**-32 of the largest contribution, plus FP32's final rounding
    bound = len(rows) * 2.0 ** -32 * largest + exact.abs() * 2.0 ** -24
    assert bool((ours <= bound).all())
    assert ours.sum() < running.sum() / 2  # measured: 6.7 vs 29.2 (the final FP32 rounding dominates ours)


def functools_sum(rows):
    total = torch.zeros_like(rows[0])
    for row in rows:
        total = total + row
    return total


def test_a_larger_contribution_drops_exactly_the_bits_every_contribution_loses():
    """Alone, 2**-10 + 2**-33 is kept whole (its top bin's grid is 2**-48); next to 2**13 (grid
    2**-32) its 2**-33 bit falls below the grid and is dropped, in either order."""
    small, large = torch.tensor([2.0 ** -10 + 2.0 ** -33]), torch.tensor([2.0 ** 13])
    assert _summed([small]).item() == 2.0 ** -10 + 2.0 ** -33
    both = _summed([small, large])
    assert both.item() == _summed([large, small]).item() == 2.0 ** 13 + 2.0 ** -10
    assert both.item() == _oracle_element([2.0 ** 13, 2.0 ** -10 + 2.0 ** -33])


def test_nan_and_inf_make_the_element_nan_and_leave_the_others():
    acc = es.Accumulator(4)
    acc.add(0, torch.tensor([1.0, float("nan"), float("inf"), -3.0]))
    acc.add(0, torch.tensor([2.0, 1.0, 1.0, 0.0]))
    out = acc.total()
    assert out[0].item() == 3.0 and out[3].item() == -3.0
    assert math.isnan(out[1].item()) and math.isnan(out[2].item())


def test_bf16_contributions_are_summed_from_their_exact_values():
    x = torch.tensor([1.0, 2.0 ** -9, 3.0], dtype=torch.bfloat16)
    assert _bits_equal(_summed([x, x]), (x.float() * 2))


def test_an_offset_region_leaves_the_rest_of_the_bucket_zero():
    acc = es.Accumulator(10)
    acc.add(3, torch.ones(4) * 1.5)
    acc.add(3, torch.ones(4) * 0.25)
    out = acc.total()
    assert out.tolist() == [0.0] * 3 + [1.75] * 4 + [0.0] * 3
    with pytest.raises(IndexError):
        acc.add(8, torch.ones(4))


def test_reset_forgets_everything():
    acc = es.Accumulator(3)
    acc.add(0, torch.tensor([2.0 ** 30, 1.0, -1.0]))
    acc.reset()
    acc.add(0, torch.tensor([2.0 ** -30, 0.0, 5.0]))
    assert acc.total().tolist() == [2.0 ** -30, 0.0, 5.0]


def test_more_contributions_than_the_int64_can_hold_raise():
    acc = es.Accumulator(1)
    acc.counts[(0, 1)] = es.MAX_CONTRIBUTIONS
    with pytest.raises(OverflowError, match=str(es.MAX_CONTRIBUTIONS)):
        acc.add(0, torch.ones(1))


def test_the_overflow_bound_counts_every_region_an_element_lies_in():
    """Whole-bucket deposits (DDP's hook) and one parameter's per-sequence terms land in regions
    that overlap: an element of the parameter received both."""
    acc = es.Accumulator(10)
    acc.add(0, torch.ones(10))
    acc.add_terms(4, [torch.ones(3)] * 5)
    acc.add(6, torch.ones(4))
    acc.add(7, torch.ones(3))
    assert (acc.bound(), acc.bound(0, 4), acc.bound(8, 10)) == (7, 1, 3)
    assert acc.piece(4, 6).bound() == 6


def test_the_largest_allowed_count_of_full_digit_contributions_does_not_overflow():
    """MAX_CONTRIBUTIONS contributions whose three 16-bit digits are all ones, one sign: every
    int32 limb reaches 32767 x 65535 and the combined int64 about 2**63; the sum stays exact."""
    value = float((2 ** 24 - 1) * 2 ** 24)  # 48-bit integer, top bin 2, 24 one-bits at the top
    acc = es.Accumulator(1)
    one = torch.tensor([value], dtype=torch.float32)
    for _ in range(es.MAX_CONTRIBUTIONS):
        acc.add(0, one)
    assert acc.total().item() == _fp32(value * es.MAX_CONTRIBUTIONS)
    assert int(acc.limbs.abs().max()) > 2 ** 30


def test_scalar_sum_is_correctly_rounded_whatever_the_order():
    rng = random.Random(11)
    values = [rng.choice([-1, 1]) * rng.random() * 2.0 ** rng.randint(-60, 60) for _ in range(500)]
    exact = float(sum(Fraction(v) for v in values))
    for _ in range(5):
        rng.shuffle(values)
        assert es.scalar_sum(values) == exact
    assert math.isnan(es.scalar_sum([1.0, float("inf")]))


def test_partials_are_exact():
    values = [1e300, 1.0, -1e300, 2.0 ** -1000, 3.5]
    assert sum(Fraction(p) for p in es._partials(values)) == sum(Fraction(v) for v in values)


# -- across ranks (gloo) --------------------------------------------------------------------------

def _rows(seed: int, count: int, n: int):
    rng = random.Random(seed)
    return [_wide(rng, n, 30) for _ in range(count)]


def _across_ranks(ctx, seed, count, n, shares):
    """Rank r adds the contributions ``shares[r]`` lists (uneven shares, some ranks none)."""
    rows = _rows(seed, count, n)
    mine = shares[ctx.rank]
    acc = es.Accumulator(n)
    for i in mine:
        acc.add(0, rows[i])
    whole = acc.total(torch.distributed.group.WORLD)
    acc2 = es.Accumulator(n)
    for i in reversed(mine):
        acc2.add(0, rows[i])
    shard = acc2.total(torch.distributed.group.WORLD, shard=(ctx.rank, ctx.world_size))
    scalar = es.scalar_sum([float(rows[i][0]) for i in mine], torch.distributed.group.WORLD)
    # a bucket that does not split into DP pieces (plain DDP pads none): the whole sum's pieces pad
    acc3 = es.Accumulator(n - 1)
    for i in mine:
        acc3.add(0, rows[i][1:])
    uneven = acc3.total(torch.distributed.group.WORLD)
    return (whole.view(torch.int32).tolist(), shard.view(torch.int32).tolist(), scalar,
            uneven.view(torch.int32).tolist())


def test_three_ranks_with_uneven_shares_give_the_single_process_bits():
    seed, count, n = 5, 10, 48  # 48 elements: 16 per rank in the reduce-scatter
    shares = [[0, 7, 3, 9], [], [5, 1, 2, 8, 6, 4]]
    results = run_ranks(_across_ranks, world_size=3, init_megatron=False, args=(seed, count, n, shares))
    rows = _rows(seed, count, n)
    expected = _oracle(rows).view(torch.int32).tolist()
    for whole, shard, scalar, uneven in results:
        assert whole == expected
        assert uneven == expected[1:]
        assert scalar == float(sum(Fraction(float(r[0])) for r in rows))
    assert [v for _, shard, _, _ in results for v in shard] == expected


def _two_stages(ctx, seed, count, n, shares):
    """Ranks 0, 1 one pipeline stage's data-parallel group, ranks 2, 3 the other's; {0, 2} and {1, 3}
    the embedding groups. Each rank holds its share of a tied weight's terms: merged over its
    embedding group, then summed over its data-parallel group (plain and sharded)."""
    groups = {}
    for ranks in ([0, 1], [2, 3], [0, 2], [1, 3]):
        groups[tuple(ranks)] = torch.distributed.new_group(ranks)
    dp = groups[(0, 1)] if ctx.rank < 2 else groups[(2, 3)]
    embd = groups[(0, 2)] if ctx.rank % 2 == 0 else groups[(1, 3)]
    rows = _rows(seed, count, n)
    acc = es.Accumulator(n + 8)
    for i in shares[ctx.rank]:
        acc.add(8, rows[i])
    terms = acc.piece(8, 8 + n)
    terms.merge(embd)
    whole = terms.total(dp)
    shard = terms.total(dp, shard=(ctx.rank % 2, 2))
    unmerged = acc.piece(8, 8 + n).total(dp)
    return whole.view(torch.int32).tolist(), shard.view(torch.int32).tolist(), unmerged.tolist()


def test_terms_merged_across_stages_then_summed_give_the_one_process_bits():
    """The tied-embedding sum at PP > 1 (tp_invariant.data_parallel): every rank of both stages ends
    with the definition's bits over all four ranks' terms, as PP 1 sums them in one accumulator;
    a stage's data-parallel sum alone does not (the precondition), and two stages' FP32 sums
    added (upstream's embedding all-reduce) do not either on these inputs."""
    seed, count, n = 11, 12, 40
    shares = [[0, 5, 9], [2, 11], [1, 3, 4, 10], [6, 7, 8]]
    results = run_ranks(_two_stages, world_size=4, init_megatron=False, args=(seed, count, n, shares))
    rows = _rows(seed, count, n)
    expected = _oracle(rows).view(torch.int32).tolist()
    for whole, _, _ in results:
        assert whole == expected
    assert results[0][1] + results[1][1] == expected and results[2][1] + results[3][1] == expected
    first = torch.tensor(results[0][2], dtype=torch.float32)
    last = torch.tensor(results[2][2], dtype=torch.float32)
    assert first.view(torch.int32).tolist() != expected
    assert (first + last).view(torch.int32).tolist() != expected  # upstream's FP32 add of the stages' sums


def test_ddp_hook_gradients_waiting_in_main_grad_give_the_terms_of_one_deposit_each():
    """tp_invariant.data_parallel's hook copies a gradient into its main_grad and sends a bucket in
    once every parameter has one (or one comes again first, or the sum starts): the accumulator
    must hold exactly the terms one call per gradient gives -- a parameter that gets no gradient,
    one that gets two before the bucket is complete, BF16 and FP32 gradients whose FP32 sum would
    round (1 + 2**-30) -- and main_grad must be zero again afterwards."""
    from types import SimpleNamespace

    from megapatch.patches.tp_invariant import data_parallel as dp

    class Param:  # what the hook reads of a parameter: .grad (any float dtype) and .main_grad
        grad = None

    buffer = torch.zeros(11)
    params = [Param(), Param(), Param()]
    views = [buffer[0:4].view(2, 2), buffer[4:7], buffer[7:11]]
    for p, view in zip(params, views):
        p.main_grad = view
    bucket = SimpleNamespace(grad_data=buffer, params_list=params)
    group = SimpleNamespace(param_to_bucket={p: bucket for p in params})
    grads = [  # (parameter, gradient) in hook order: p0 twice before p1 and p2 arrive; p2 once
        (0, torch.tensor([[1.0, -2.0], [2.0 ** -30, 3.0]]).bfloat16()),
        (0, torch.tensor([[2.0 ** -30, 1.0], [1.0, -3.0]])),
        (1, torch.tensor([0.5, 2.0 ** 20, -1.0])),
        (2, torch.tensor([7.0, 0.0, -2.0 ** -40, 1.5]).bfloat16()),
        (0, torch.tensor([[1.0, 1.0], [1.0, 1.0]])),
        (1, torch.tensor([2.0 ** -24, 1.0, 1.0])),
    ]
    expected = es.Accumulator(11)
    for i, grad in grads:
        params[i].grad = grad
        dp._stage(group, params[i])
        start = views[i].storage_offset()
        expected.add(start, grad)
    dp._flush(bucket)
    got = dp._accumulator(bucket)
    assert torch.equal(got.limbs, expected.limbs) and torch.equal(got.top, expected.top)
    assert _bits_equal(got.total(), expected.total())
    assert not buffer.any()
    assert got.bound() >= expected.bound()
