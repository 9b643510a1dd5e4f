"""Ranks of one TP group with different megapatch settings stop with a clear error."""

import pytest
import torch

from megapatch.errors import CrossRankMismatchError
from megapatch.testing import RankFailure, run_ranks


def _reduce_once(ctx, per_rank_mode):
    import megapatch
    from megatron.core.tensor_parallel import mappings

    mode = per_rank_mode[ctx.rank]
    if mode is not None:
        megapatch.enable(tp_reduce_dtype=mode)
    x = torch.ones(8, dtype=torch.bfloat16)
    return mappings.reduce_from_tensor_model_parallel_region(x, group=ctx.tp_group).tolist()


def test_different_settings_in_one_tp_group_are_refused():
    with pytest.raises(RankFailure) as err:
        run_ranks(_reduce_once, world_size=2, tp=2, args=(["fp32", "fp32-accumulate"],), timeout=120)
    text = str(err.value)
    assert "CrossRankMismatchError" in text
    assert "megapatch settings differ across tensor-parallel group [0, 1]" in text
    assert "tp_reduce_dtype=fp32;" in text and "tp_reduce_dtype=fp32-accumulate;" in text


def test_a_peer_without_megapatch_is_named_after_the_timeout():
    with pytest.raises(RankFailure) as err:
        run_ranks(_reduce_once, world_size=2, tp=2, args=(["fp32", None],), timeout=120,
                  env={"MEGAPATCH_CHECK_TIMEOUT": "3"})
    text = str(err.value)
    assert "rank(s) [1] of tensor-parallel group [0, 1] published no megapatch settings" in text


def test_same_settings_pass_and_reduce():
    out = run_ranks(_reduce_once, world_size=2, tp=2, args=(["fp32", "fp32"],), timeout=120)
    assert out == [[2.0] * 8, [2.0] * 8]


def test_error_type_is_public():
    assert issubclass(CrossRankMismatchError, RuntimeError)
