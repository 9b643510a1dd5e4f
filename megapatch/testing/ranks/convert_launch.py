"""Run Megatron-LM's unmodified checkpoint converter on a CPU-only machine.

Usage (from the Megatron-LM checkout, one process: the converter forks its own saver)::

    python -m megapatch.testing.ranks.convert_launch tools/checkpoint/convert.py --model-type GPT \\
        --loader llama_mistral --checkpoint-type hf --model-size llama3 \\
        --load-dir HF_DIR --tokenizer-model HF_DIR \\
        --saver core --saver-transformer-impl local --save-dir OUT --target-tensor-parallel-size 2

The script runs as ``__main__`` with ``sys.path[0]`` set to its directory, exactly as ``python
tools/checkpoint/convert.py`` does. Around it, the CUDA-only calls are redirected to the stand-ins of
:mod:`megapatch.testing.stand_ins.cpu_compat`, :mod:`megapatch.testing.stand_ins.megatron_lm_compat` and
:mod:`megapatch.testing.stand_ins.convert_compat` (the converter's own, C1-C11 there) through the same
apply/restore mechanism as :mod:`megapatch.testing.ranks.cpu_launch`. The forked saver inherits them.

One thing the launcher adds on purpose: ``convert.py`` only ``join()``s its saver process
(``tools/checkpoint/convert.py:160-166``), so it exits 0 when the saver dies (e.g. ``ValueError:
num_attention_heads (4) must be a multiple of tensor_model_parallel_size (8)``). The saver's own
traceback is printed as upstream prints it; this launcher then exits 1 with one line naming the
saver's exit code. If the loader is still running :data:`GRACE_S` seconds after the saver died (it
blocks on the full queue when the model is large), the launcher ends the job the same way instead
of hanging. An error raised in the loader (this process) propagates unchanged; the saver is then
stopped so the job does not hang on its queue.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import List, Optional

USAGE = "usage: python -m megapatch.testing.ranks.convert_launch tools/checkpoint/convert.py [convert.py args...]"
PREFIX = "megapatch.testing.ranks.convert_launch"
#: exit code when convert.py returned but a process it started (the saver) failed
SAVER_FAILED = 1
#: seconds the loader may keep running after the saver died before the launcher ends the job
GRACE_S = 30.0


def _failure_line(script: str, failed) -> str:
    codes = ", ".join(f"{p.name} exit code {p.exitcode}" for p in failed)
    return (f"{PREFIX}: {os.path.basename(script)} returned, but a process it started failed "
            f"({codes}; its error is printed above); convert.py itself would exit 0 here "
            f"(it only joins its saver)")


def _watch(script: str, started: list, done) -> None:
    """Ends the job when a started process died and this one is still running after GRACE_S."""
    import time

    died_at = None
    while not done.wait(1.0):
        failed = [p for p in list(started) if p.exitcode not in (0, None)]
        if failed and died_at is None:
            died_at = time.monotonic()
        if died_at is not None and time.monotonic() - died_at > GRACE_S:
            line = _failure_line(script, failed).replace(
                "returned, but", f"was still running {GRACE_S:.0f} s after")
            print(line, file=sys.stderr, flush=True)
            os._exit(SAVER_FAILED)


def main(argv: Optional[List[str]] = None) -> None:
    from megapatch.testing.ranks import rank_server
    from megapatch.testing.ranks.cpu_launch import script_from

    rank_server.forward()  # under $MPTEST_RANK_SERVER: this process's __main__ runs as its child

    script = script_from(argv, USAGE, PREFIX)
    # what validate_args requires for TP > 1 before Blackwell (arguments.py:951), as on a GPU
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    import multiprocessing.process

    from megapatch.testing.stand_ins.convert_compat import CONVERTER_WORKAROUNDS
    from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
    from megapatch.testing.stand_ins.megatron_lm_compat import megatron_lm_workarounds
    from megapatch.testing.stand_ins.replacements import Replacements

    started: list = []

    def recording_start(original):
        def start(self):
            started.append(self)
            return original(self)

        return start

    import threading

    tracking = Replacements()
    tracking.replace(multiprocessing.process.BaseProcess, "start", recording_start)
    done = threading.Event()
    threading.Thread(target=_watch, args=(script, started, done), daemon=True).start()
    try:
        with megatron_lm_workarounds(CONVERTER_WORKAROUNDS), cpu_workarounds():
            try:
                runpy.run_path(script, run_name="__main__")
            except BaseException:
                for process in started:
                    if process.is_alive():
                        process.terminate()
                        process.join(10)
                raise
    finally:
        done.set()
        tracking.restore()

    failed = [p for p in started if p.exitcode not in (0, None)]
    if failed:
        print(_failure_line(script, failed), file=sys.stderr, flush=True)
        raise SystemExit(SAVER_FAILED)


if __name__ == "__main__":
    main()
