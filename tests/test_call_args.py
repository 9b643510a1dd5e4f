"""Reading and replacing a wrapped call's arguments (megapatch.core.call_args)."""

import pytest

from megapatch.core.call_args import argument, with_argument


def test_an_argument_is_read_by_position_or_keyword_and_a_missing_one_is_named():
    assert argument((1, 2, 3), {}, 2, "c") == 3
    assert argument((1,), {"c": 9}, 2, "c") == 9
    assert argument((1,), {}, 2, "c", None) is None
    with pytest.raises(TypeError, match="'c'"):
        argument((1,), {}, 2, "c")


def test_an_argument_is_replaced_where_the_caller_put_it_and_the_callers_copies_stay():
    args, kwargs = (1, 2, 3, 4), {"d": 5}
    assert with_argument(args, kwargs, 2, "c", "x") == ((1, 2, "x", 4), {"d": 5})
    assert with_argument((1, 2), kwargs, 2, "c", "x") == ((1, 2), {"d": 5, "c": "x"})
    assert with_argument((1, 2), {"c": 3}, 2, "c", "x") == ((1, 2), {"c": "x"})
    assert args == (1, 2, 3, 4) and kwargs == {"d": 5}
