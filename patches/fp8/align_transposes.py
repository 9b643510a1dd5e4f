"""Pipeline-aligned FP8 weight transposes for the interleaved (virtual-pipeline) schedule.

With FP8 parameters (``fp8_param_gather``), the distributed optimizer and ``overlap_param_gather``,
megatron-core (>= 0.16) finishes each model chunk's param all-gather lazily, in the DDP forward
pre-hook of the chunk's first microbatch, and there runs the post-all-gather processing
(TE >= 2.10 ``post_all_gather_processing``: FP8 transpose / columnwise copy). Pipeline stage r meets
that first microbatch r slots later than stage 0, so the transpose cost lands at a different
wall-clock moment on every stage and the others idle (NeMo PR #9481).

With ``align_fp8_transposes=True`` this patch wraps
``schedules.forward_backward_pipelining_with_interleaving`` for the duration of one training call:

* ``config.param_sync_func`` (Megatron-LM: ``[chunk.start_param_sync for chunk in model]``) is
  replaced by per-index wrappers: entry i first does upstream's dispatch of chunk i, then (i >= 1)
  finishes chunk i-1's in-flight gathers with upstream's own
  ``_ParamAndGradBucketGroup.finish_param_sync(skip_next_bucket_dispatch=<what the pre-hook
  passes>)`` over the chunk's dense and expert bucket groups (wait + upstream processing);
* ``forward_step_func`` is wrapped by a forward-step counter that finishes the last chunk (for which
  the schedule never calls ``param_sync_func[N]``) before the local forward step at its slot.

The slot of chunk c is T_c = c * ``microbatch_group_size_per_vp_stage`` on the rank-0 clock; stage r
reaches it at its local virtual microbatch T_c - r, i.e. at the same wall-clock slot on every stage.
Both swaps are undone in ``finally``. The pre-hook then finds nothing in flight and does nothing.
Same data, same ops, only earlier: results are unchanged.

Whenever aligning cannot help the call passes through untouched, and the reason is kept in
``last_decision`` (shown as the patch's backend by ``status()`` / ``megapatch doctor``).
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import List, Optional

from megapatch.core import report, state
from megapatch.core.registry import Patch, Target
from megapatch.patches._common import MEGATRON_CORE_TESTED

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
PGB = "megatron.core.distributed.param_and_grad_buffer"
DDP_MODULE = "megatron.core.distributed.distributed_data_parallel"

_lock = threading.Lock()
#: The decision taken for the most recent interleaved-schedule call (read by ``_backend``).
last_decision = {"aligned": False, "reason": "no interleaved schedule call seen yet", "chunks": 0}
_quant_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _decide(aligned: bool, reason: str, chunks: int = 0) -> None:
    with _lock:
        last_decision.update(aligned=aligned, reason=reason, chunks=chunks)
    if not aligned:  # requested but not happening: say so once per job (rank 0) for each reason
        report.once(f"fp8.align_transposes:{reason}", "warning",
                    f"megapatch: fp8.align_transposes was requested but passes through: {reason}")


# -- helpers -------------------------------------------------------------------------------------


def _unwrap_ddp(chunk):
    """The megatron-core DistributedDataParallel of a model chunk (following ``.module``), or None."""
    from megatron.core.distributed import DistributedDataParallel

    m = chunk
    for _ in range(4):
        if isinstance(m, DistributedDataParallel):
            return m
        m = getattr(m, "module", None)
        if m is None:
            return None
    return None


def _chunk_of_virtual_microbatch(num_microbatches: int, num_chunks: int, group: int) -> List[int]:
    """Model chunk of each virtual microbatch, as ``schedules.get_schedule_table`` orders them."""
    table = []
    for lo in range(0, num_microbatches, group):
        hi = num_microbatches if lo + group >= num_microbatches else lo + group
        table.extend(c for c in range(num_chunks) for _mb in range(lo, hi))
    return table


def _pp_rank(kwargs) -> int:
    p2p = kwargs.get("p2p_communicator")
    if p2p is not None and getattr(p2p, "pp_group", None) is not None:
        return p2p.pp_group.rank()
    pgc = kwargs.get("pg_collection")
    if pgc is not None and getattr(pgc, "pp", None) is not None:
        return pgc.pp.rank()
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank()


def _bucket_groups(ddp) -> list:
    return list(ddp.bucket_groups) + list(getattr(ddp, "expert_parallel_bucket_groups", []))


def _has_processing(pgb) -> bool:
    """megatron-core >= 0.16: a finished param all-gather runs post-all-gather processing."""
    return hasattr(pgb, "post_all_gather_processing") or hasattr(
        pgb._ParamAndGradBucketGroup, "_post_param_sync")


def _is_quantized(pgb, param) -> bool:
    """The test upstream itself uses to pick the params it post-processes (per version)."""
    uses = getattr(pgb, "_param_uses_quantized_storage", None)  # 0.19+
    if uses is not None:
        return bool(uses(param))
    if getattr(pgb, "is_float8tensor", None) is not None and pgb.is_float8tensor(param):
        return True
    nvfp4 = getattr(pgb, "is_nvfp4tensor", None)  # 0.18
    return bool(nvfp4 is not None and nvfp4(param))


def _quantized_kinds(pgb, ddp) -> dict:
    """{'quantized': n, 'mxfp8': n, 'float8': n} over the chunk's bucket-group params (cached)."""
    key = (id(pgb.is_float8tensor) if hasattr(pgb, "is_float8tensor") else 0)
    cached = _quant_cache.get(ddp)
    if cached is not None and cached[0] == key:
        return cached[1]
    is_mx = getattr(pgb, "is_mxfp8tensor", None)
    float8_cls = None
    try:  # TE's per-tensor-scaled FP8 class (the one whose processing depends on the GPU)
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor as float8_cls
    except Exception:  # noqa: BLE001 - no TE (CPU) or a TE without this module
        pass
    kinds = {"quantized": 0, "mxfp8": 0, "float8": 0}
    for bg in _bucket_groups(ddp):
        for p in bg.params:
            if _is_quantized(pgb, p):
                kinds["quantized"] += 1
                if is_mx is not None and is_mx(p):
                    kinds["mxfp8"] += 1
                if float8_cls is not None and isinstance(p, float8_cls):
                    kinds["float8"] += 1
    _quant_cache[ddp] = (key, kinds)
    return kinds


def _processing_is_noop(pgb) -> Optional[str]:
    """Why megatron's post-all-gather processing does nothing here, or None."""
    try:
        from megatron.core import fp8_utils
    except ImportError:
        return None
    dispatched = getattr(pgb, "post_all_gather_processing", None)
    if (dispatched is getattr(fp8_utils, "post_all_gather_processing", object())
            and getattr(fp8_utils, "te_post_all_gather_processing", None) is None):
        return ("Transformer Engine < 2.10 (no post_all_gather_processing): FP8 transposes are "
                "built inside TE's forward, megatron's processing is a no-op")
    return None


def _why_not(args, kwargs, pgb) -> Optional[str]:
    """None when the call can be aligned, else why it passes through unchanged."""
    from megatron.core.utils import get_model_config

    if args:
        return "called with positional arguments (the schedule is keyword-only)"
    model = kwargs.get("model")
    if not isinstance(model, list) or len(model) < 2:
        return "no virtual pipeline (model is not a list of >= 2 chunks)"
    if kwargs.get("forward_only"):
        return "forward_only (the schedule disables param_sync_func itself)"
    try:
        from megatron.core.transformer.cuda_graphs import is_graph_capturing

        if is_graph_capturing():
            return "CUDA graph capture in progress"
    except ImportError:
        pass
    config = get_model_config(model[0])
    if getattr(config, "param_sync_func", None) is None:
        return ("config.param_sync_func is None (align_param_gather off, Megatron-LM's first "
                "iteration, or the caller gives none)")
    if not _has_processing(pgb):
        return ("megatron-core < 0.16 has no post-all-gather processing in DDP: FP8 transposes are "
                "built inside TE's forward; aligning the all-gather waits alone is safe but "
                "does not move any transpose")
    ddps = [_unwrap_ddp(m) for m in model]
    if any(d is None for d in ddps):
        return "a model chunk is not megatron.core DistributedDataParallel"
    for d in ddps:
        cfg = d.ddp_config
        if not (cfg.use_distributed_optimizer and cfg.overlap_param_gather
                and getattr(d, "use_forward_hook", True)):
            return "overlap_param_gather is off (or no distributed optimizer)"
        if not getattr(d, "remove_forward_pre_hook_handles", None):
            return "DDP forward pre-hooks are disabled"
        if getattr(cfg, "reuse_grad_buf_for_mxfp8_param_ag", False):
            return "MXFP8 with reuse_grad_buf_for_mxfp8_param_ag (not aligned)"
        for bg in _bucket_groups(d):
            if not hasattr(bg, "param_gather_handle") or not hasattr(bg, "param_gather_dispatched"):
                return "bucket groups have no param_gather_handle/param_gather_dispatched"
    kinds = [_quantized_kinds(pgb, d) for d in ddps]
    total = sum(k["quantized"] for k in kinds)
    if total == 0:
        return ("no FP8 parameters (fp8_param_gather off: BF16 master weights are cast and "
                "transposed on the fly inside TE's forward)")
    if sum(k["mxfp8"] for k in kinds) == total:
        return "MXFP8 parameters: TE's post-all-gather processing is a no-op"
    noop = _processing_is_noop(pgb)
    if noop:
        return noop
    if sum(k["float8"] for k in kinds) == total:
        try:
            from transformer_engine.pytorch.utils import is_non_tn_fp8_gemm_supported

            if is_non_tn_fp8_gemm_supported():
                return ("per-tensor FP8 on a GPU with non-TN FP8 GEMMs (Blackwell): no transpose "
                        "is created")
        except Exception:  # noqa: BLE001
            pass
    return None


class _Aligner:
    """State of one aligned schedule call."""

    def __init__(self, model, ddps, pp_rank, group, num_microbatches):
        self.model, self.ddps, self.pp_rank = model, ddps, pp_rank
        self.n = len(model)
        self.chunk_of = _chunk_of_virtual_microbatch(num_microbatches, self.n, group)
        self.slot = [self.chunk_of.index(c) for c in range(self.n)]  # T_c = c * G
        self.done = [False] * self.n
        self.forward_steps = 0
        self.disabled = False

    def finish_chunk(self, c: int) -> None:
        if self.done[c] or self.disabled:
            return
        self.done[c] = True
        ddp = self.ddps[c]
        # exactly what DistributedDataParallel._make_forward_pre_hook passes
        skip_next = bool(ddp.ddp_config.align_param_gather
                         or getattr(ddp, "overlap_param_gather_with_optimizer_step", False))
        for bg in _bucket_groups(ddp):
            if bg.param_gather_dispatched and bg.param_gather_handle is not None:  # in flight only
                bg.finish_param_sync(skip_next_bucket_dispatch=skip_next)

    def param_sync(self, i: int, f):
        @functools.wraps(f)
        def param_sync_func(*a, **k):
            out = f(*a, **k)  # upstream: dispatch chunk i's all-gathers
            if i >= 1:
                self.finish_chunk(i - 1)  # slot T_{i-1}
            return out

        return param_sync_func

    def forward_step(self, f):
        @functools.wraps(f)
        def forward_step_func(*a, **k):
            v = self.forward_steps
            self.forward_steps += 1
            if not self.disabled:
                model = a[1] if len(a) > 1 else k.get("model")
                if v >= len(self.chunk_of) or model is not self.model[self.chunk_of[v]]:
                    self.disabled = True  # the call's decision (and its one log line) says why
                else:
                    now = v + self.pp_rank  # rank-0 clock
                    for c in range(1, self.n):  # the last chunk (and any slot already passed)
                        if not self.done[c] and self.slot[c] <= now:
                            self.finish_chunk(c)
            return f(*a, **k)

        return forward_step_func


def _schedule(wrapped, instance, args, kwargs):
    if not state.current().align_fp8_transposes:
        return wrapped(*args, **kwargs)
    import sys

    from megatron.core.utils import get_model_config

    pgb = sys.modules.get(PGB)
    reason = "megatron-core distributed is not imported" if pgb is None else _why_not(args, kwargs, pgb)
    if reason is not None:
        _decide(False, reason)
        return wrapped(*args, **kwargs)
    model = kwargs["model"]
    config = get_model_config(model[0])
    original = config.param_sync_func
    psf = original if isinstance(original, list) else [original for _ in model]  # as the schedule does
    group = getattr(config, "microbatch_group_size_per_vp_stage", None) or len(model)
    aligner = _Aligner(model, [_unwrap_ddp(m) for m in model], _pp_rank(kwargs), group,
                       kwargs["num_microbatches"])
    config.param_sync_func = [aligner.param_sync(i, f) for i, f in enumerate(psf)]
    kwargs = dict(kwargs, forward_step_func=aligner.forward_step(kwargs["forward_step_func"]))
    try:
        return wrapped(*args, **kwargs)
    finally:
        config.param_sync_func = psf  # the list the unpatched schedule would have left
        if aligner.disabled:
            _decide(False, "forward steps ran out of virtual-microbatch order (partly aligned)",
                    sum(aligner.done))
        else:
            _decide(True, "aligned", sum(aligner.done))


def _backend() -> str:
    with _lock:
        d = dict(last_decision)
    if d["aligned"]:
        return f"aligned {d['chunks']} chunks at param-sync slots (last call)"
    return f"passing through: {d['reason']}"


def _probe() -> Optional[str]:
    import importlib

    pgb = importlib.import_module(PGB)
    group = getattr(pgb, "_ParamAndGradBucketGroup", None)
    if group is None:
        return f"{PGB}._ParamAndGradBucketGroup does not exist"
    finish = getattr(group, "finish_param_sync", None)
    if finish is None:
        return f"{PGB}._ParamAndGradBucketGroup.finish_param_sync does not exist"
    if "skip_next_bucket_dispatch" not in inspect.signature(finish).parameters:
        return "_ParamAndGradBucketGroup.finish_param_sync has no skip_next_bucket_dispatch parameter"
    names = group.__init__.__code__.co_names
    for attr in ("param_gather_handle", "param_gather_dispatched"):
        if attr not in names:
            return f"_ParamAndGradBucketGroup no longer sets {attr}"
    return None


PATCHES = (
    Patch(
        name="fp8.align_transposes",
        supports=MEGATRON_CORE_TESTED,
        option="align_fp8_transposes",
        summary="FP8 param all-gathers finished + transposed at the interleaved schedule's "
                "param-sync slots (same slot on every pipeline stage)",
        hook=SCHEDULES,
        applies=lambda s: s.align_fp8_transposes,
        probe=_probe,
        backend=_backend,
        targets=(
            Target(SCHEDULES, "forward_backward_pipelining_with_interleaving", _schedule,
                   params=("forward_step_func", "data_iterator", "model", "num_microbatches")),
        ),
        watches=(
            f"{PGB}:_ParamAndGradBucketGroup.finish_param_sync",
            f"{PGB}:_ParamAndGradBucketGroup.start_param_sync",
            f"{DDP_MODULE}:DistributedDataParallel._make_forward_pre_hook",
            f"{DDP_MODULE}:DistributedDataParallel.start_param_sync",
            f"{SCHEDULES}:get_schedule_table",
        ),
    ),
)
