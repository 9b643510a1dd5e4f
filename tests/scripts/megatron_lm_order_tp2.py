"""Megatron-LM's order on one rank of a TP-2 job: megatron is imported before the process group
exists, then torch.distributed and model parallelism are initialised, then one TP reduction runs.
The script never calls megapatch: it is active from the MEGAPATCH_* variables the test sets per
rank (through the installed startup hook).

Launched by tests/test_cross_rank.py with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.
Prints ``FAILED after <s> s: <error>`` (exit 3) when model-parallel initialisation raises, else
``REDUCED <values>``.
"""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import megatron.core  # noqa: F401 -- megapatch activates here, before any process group
from megatron.core import parallel_state


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    start = time.monotonic()
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    except Exception as exc:  # noqa: BLE001 -- reported to the test
        print(f"FAILED after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        os._exit(3)
    from megatron.core.tensor_parallel import mappings

    out = mappings.reduce_from_tensor_model_parallel_region(torch.ones(8, dtype=torch.bfloat16))
    print("REDUCED", out.tolist(), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
