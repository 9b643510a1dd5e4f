"""Switching megapatch on from a training script (instead of MEGAPATCH_* variables).

Call enable() before or after importing megatron-core, before or after building the model; it
refuses (before the first step) anything it cannot honour.
"""

import megapatch

megapatch.enable(tp_reduce_dtype="fp32")  # every TP reduction sums in FP32, rounds once

import megatron.core  # noqa: E402  (the order does not matter)

print(megapatch.status())  # what was wrapped, upstream versions, what was skipped and why

megapatch.disable()  # every original restored
