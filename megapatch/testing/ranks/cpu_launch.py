"""Run an unmodified Megatron-LM training script on CPU ranks (gloo).

Usage (one process per rank, as on GPUs)::

    CUDA_DEVICE_MAX_CONNECTIONS=1 MEGAPATCH_TP_REDUCE_DTYPE=fp32 \\
    torchrun --nproc-per-node 2 -m megapatch.testing.ranks.cpu_launch pretrain_gpt.py \\
        --distributed-backend gloo --use-cpu-initialization --transformer-impl local ... 

The script runs as ``__main__`` with ``sys.path[0]`` set to its directory, exactly as
``python pretrain_gpt.py`` does, so ``megatron`` is the checkout's, not an installed wheel's.
Around it, the CUDA-only calls of megatron-core (:mod:`megapatch.testing.stand_ins.cpu_compat`) and of
Megatron-LM's ``megatron/training`` (:mod:`megapatch.testing.stand_ins.megatron_lm_compat`) are redirected to
CPU stand-ins; each is listed with the upstream call it replaces in those modules' docstrings and
``WORKAROUNDS`` tables. No Megatron-LM file is edited. With ``--te``, Transformer Engine's kernels run as
torch stand-ins (:mod:`megapatch.testing.stand_ins.te_runtime`): TE's CUDA numerics are not reproduced.

The launcher never enables megapatch itself: ``MEGAPATCH_*`` variables activate it through the
installed startup hook, as in any other launch. It sets ``MEGAPATCH_LAUNCH`` (``cpu``, or ``cpu-te``
with ``--te``) in its ranks' environment: ``megapatch doctor`` run there knows what answers upstream's
CUDA checks (the variable asks megapatch for nothing).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from typing import List, Optional

USAGE = ("usage: torchrun [torchrun options] -m megapatch.testing.ranks.cpu_launch [--bridge | --te] SCRIPT.py "
         "[script args...]\n  --bridge: a Megatron-Bridge script (its training loop's CUDA stand-ins, "
         "megapatch.testing.stand_ins.bridge_compat; Bridge imported without Transformer Engine)\n"
         "  --te: with Transformer Engine installed, its kernels on CPU (megapatch.testing.stand_ins.te_runtime): "
         "--transformer-impl transformer_engine in every mode (TE's attention on its unfused backend)")


def _banner(script: str, bridge: bool = False, te: bool = False) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    from megapatch.testing.stand_ins import cpu_compat, megatron_lm_compat

    count = len(cpu_compat.WORKAROUNDS) + len(megatron_lm_compat.WORKAROUNDS) + 2
    modules = "megapatch.testing.stand_ins.cpu_compat, megatron_lm_compat"
    if bridge:
        from megapatch.testing.stand_ins import bridge_compat

        count += len(bridge_compat.TRAINING_WORKAROUNDS)
        modules += ", bridge_compat; TE and nvidia-resiliency-ext as scoped import stand-ins"
    arithmetic = "the arithmetic is torch's CPU kernels"
    if te:
        modules += "; te_runtime"
        arithmetic = "Transformer Engine's kernels are torch stand-ins, not TE's CUDA numerics"
    print(f"megapatch.testing.ranks.cpu_launch: running {script} on CPU ranks with {count} CUDA "
          f"stand-ins ({modules}); {arithmetic}", file=sys.stderr, flush=True)


def _flag(argv: List[str], name: str, default: Optional[str] = None) -> Optional[str]:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return default


def padding_warning(argv: List[str]) -> Optional[str]:
    """A warning when this job's padded vocabulary differs from the one at another TP size it
    would be compared with: Megatron-LM pads NullTokenizer's ``--vocab-size`` + 1 (EOD) to a
    multiple of ``--make-vocab-size-divisible-by`` x TP, so runs at different TP sizes would train
    different models (more output rows). Compared: this job's TP with TP=1, and a TP=1 job with
    TP=2 (``--vocab-size 511`` pads to 512 at TP 1, 2 and 4: no warning there, one at TP 8)."""
    if _flag(argv, "--tokenizer-type") != "NullTokenizer" or _flag(argv, "--vocab-size") is None:
        return None
    try:
        rows = int(_flag(argv, "--vocab-size")) + 1
        divisible = int(_flag(argv, "--make-vocab-size-divisible-by", "128"))
        tp = int(_flag(argv, "--tensor-model-parallel-size", "1"))
    except ValueError:
        return None
    padded = {t: -(-rows // (divisible * t)) * divisible * t for t in (1, 2, 4, 8)}
    here = -(-rows // (divisible * tp)) * divisible * tp
    if here == padded[2 if tp == 1 else 1]:
        return None
    sizes = ", ".join(f"TP={t}: {p}" for t, p in padded.items())
    return (f"megapatch.testing.ranks.cpu_launch: warning: the padded vocabulary depends on the TP size "
            f"(--vocab-size {rows - 1} + EOD padded to a multiple of {divisible} x TP: {sizes}; this "
            f"job, TP={tp}: {here}), so runs at different TP sizes train different models. For TP "
            f"comparisons use --vocab-size {padded[8] - 1} (pads to {padded[8]} at every TP size up to 8).")


def script_from(argv: Optional[List[str]], usage: str, prefix: str) -> str:
    """The script of a launcher's command line, set up as ``python SCRIPT.py args...`` would be:
    its own argv, its directory first on ``sys.path``. ``--help`` and a missing script exit."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, file=sys.stderr)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        print(f"{prefix}: script not found: {argv[0]}\n{usage}", file=sys.stderr)
        raise SystemExit(2)
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    return script


def main(argv: Optional[List[str]] = None, extra: tuple = ()) -> None:
    """``extra``: more :class:`~megapatch.testing.stand_ins.replacements.Workaround` s, applied as
    Megatron-LM's own are (when their module is imported), e.g. Megatron RL's
    (:mod:`megapatch.testing.ranks.rl_launch`)."""
    from megapatch.testing.ranks import rank_server

    rank_server.forward()  # under $MPTEST_RANK_SERVER: this process's __main__ runs as its child
    argv = list(sys.argv[1:] if argv is None else argv)
    bridge = bool(argv) and argv[0] == "--bridge"
    te = bool(argv) and argv[0] == "--te"
    if bridge or te:
        argv = argv[1:]
    script = script_from(argv, USAGE, "megapatch.testing.ranks.cpu_launch")
    from megapatch.core.options import LAUNCH_ENV

    os.environ[LAUNCH_ENV] = "cpu-te" if te else "cpu"  # for the doctor: what answers CUDA's questions here
    _banner(script, bridge, te)
    warning = padding_warning(sys.argv[1:])
    if warning and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)

    from megapatch.testing.stand_ins.cpu_compat import cpu_workarounds
    from megapatch.testing.stand_ins.megatron_lm_compat import megatron_lm_workarounds

    scope = contextlib.nullcontext()
    if bridge:
        from megapatch.testing.stand_ins import bridge_compat

        extra, scope = (*extra, *bridge_compat.TRAINING_WORKAROUNDS), bridge_compat.bridge_without_te()
    if te:
        import torch  # noqa: F401 -- before TE: a CPU build of TE finds NCCL through torch
        from megapatch.testing.stand_ins.te_runtime import te_cpu_runtime

        scope = te_cpu_runtime()
    try:
        with scope, megatron_lm_workarounds(extra), cpu_workarounds():
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    except BaseException:  # noqa: BLE001 -- end this rank now: its peers may wait in a collective
        # An exception unwinding normally can leave the interpreter waiting at exit on gloo's
        # threads, so torchrun never sees the rank fail and the whole job hangs (seen with
        # --save --ckpt-format torch_dist and psutil missing); exit at once, torchrun stops the rest.
        # megapatch's own errors read as one line per rank (megapatch.core.rank_errors)
        sys.excepthook(*sys.exc_info())
        _leave(1)
    # The script finished: leave without interpreter finalisation. Destroying torch's and gloo's
    # C++ objects at exit can meet a still-joinable thread and std::terminate the rank ("terminate
    # called without an active exception", SIGABRT, exit -6) after "[after training is done]" --
    # intermittently, on Megatron-LM main at TP=2 in CI. Every result is written by now.
    _leave(0)


def _leave(code: int) -> None:
    """Exit now, but first end this rank's multiprocessing children, which interpreter exit would
    have ended: ``--ckpt-format torch_dist`` starts a ``Manager`` server process per rank
    (``filesystem_async._get_write_results_queue``) that would outlive the rank, hold torchrun's
    output pipe open and hang whoever reads the job's log."""
    import multiprocessing

    sys.stdout.flush()
    sys.stderr.flush()
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=10)
    for child in children:  # one that ignores SIGTERM (Megatron RL's inference coordinator, a zmq loop)
        if child.is_alive():
            child.kill()
    os._exit(code)


if __name__ == "__main__":
    main()
