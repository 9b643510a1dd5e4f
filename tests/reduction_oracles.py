"""Test data and oracles for tensor-parallel reductions (shared by the megatron-core and TE tests).

Each rank's partial is a pure function of (kind, shape, TP rank, DP rank), so every rank can build
the oracle of its group locally, without any collective under test.
"""

import torch

BIG = 2.0 ** 24
ORDER_PLANTED = (BIG, 1.0, 1.0, -BIG)  # the FP32 sum of these depends on the order of the adds


def partial(kind, shape, tp_rank, dp_rank, tp_size):
    """This rank's BF16 partial sum.

    ``exact``: integers in [-256, 256] that differ by position, TP rank and DP rank: every FP32
    sum is exact in any order, BF16 running sums beyond 256 are not. ``order``: position-rotated
    (2^24, 1, 1, -2^24) times 1..3: the FP32 sum depends on the order of the adds (TP = 4)."""
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.int64)
    if kind == "exact":
        values = ((i * 37 + tp_rank * 101 + dp_rank * 53) % 513 - 256).double()
    elif kind == "order":
        assert tp_size == 4, tp_size
        planted = torch.tensor(ORDER_PLANTED, dtype=torch.float64)
        values = planted[(i + tp_rank) % 4] * (1 + i % 3)
    else:
        raise ValueError(kind)
    out = values.to(torch.bfloat16)
    assert torch.equal(out.double(), values)  # every partial is a BF16 value
    return out.view(shape)


def rank_order_sum(parts):
    """FP32 sum of the BF16 partials in rank order, rounded once to BF16."""
    acc = torch.zeros(parts[0].shape, dtype=torch.float32)
    for p in parts:
        acc = acc + p.float()  # one FP32 rounding per add, in rank order
    return acc.to(torch.bfloat16)


# -- tp_invariant's fixed tree: planted values and an independent oracle ---------------------------

#: +-2^24 beside small integers: FP32 sums of these depend on the order of addition
PLANTED = (BIG, -BIG, 2.0 ** 12, -(2.0 ** 12), 1.0, -1.0, 3.0, -3.0)


def planted(shape, seed):
    """Values drawn from ``PLANTED``, position-dependent, reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.tensor(PLANTED)[torch.randint(0, len(PLANTED), shape, generator=generator)]


def signs(shape, seed):
    """+-1, position-dependent, reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, shape, generator=generator).float() * 2 - 1


def pairwise_tree_bf16(products):
    """Independent FP32 oracle of a row-parallel sum in 2-wide blocks (the last dimension): pairs
    summed, then adjacent pairs level by level, rounded once to BF16."""
    parts = list((products[..., 0::2] + products[..., 1::2]).unbind(-1))
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0].to(torch.bfloat16).float()
