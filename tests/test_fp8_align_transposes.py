"""align_fp8_transposes on REAL megatron-core (CPU, gloo): interleaved schedule, real DDP.

One 2-rank job (PP=2, VPP=2, DP=1, 4 microbatches, G=2) runs, from the same seeds, several
configurations in a loop: unpatched ("lazy") and patched ("aligned") with Megatron-LM's
``config.param_sync_func = [chunk.start_param_sync for chunk in model]``; both with
``param_sync_func=None``; a forward-only pass; and the non-interleaved schedule (no VPP).
Everything is real megatron-core (``GPTModel`` local spec, ``DistributedDataParallel`` with
``use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True,
align_param_gather=True`` per chunk; its async all-gathers are real, also at DP=1), except:

* STAND-IN FOR FP8 (there is no FP8 tensor on CPU): after DDP is built,
  ``param_and_grad_buffer.post_all_gather_processing`` (the name upstream's
  ``finish_param_sync`` dispatches to with the params ``is_float8tensor`` selects) is replaced by
  a recorder, and ``param_and_grad_buffer.is_float8tensor`` answers True for the model's
  parameters, so upstream's real dispatch runs. Both are restored after each configuration.
* INSTRUMENTATION: ``param_and_grad_buffer.dist_all_gather_func`` is wrapped to count
  all-gathers, ``_ParamAndGradBucketGroup.finish_param_sync`` to record calls that found a gather
  in flight while a forward step was running (= the DDP forward pre-hook). Restored afterwards.
* the distributed optimizer is an SGD step on each bucket's shard (it does not build on CPU).

Slot of an event on PP rank r: before this rank's first forward step (the schedule's up-front
``param_sync_func`` calls, which precede the first pipeline receive) it is 0; during or right
before local forward step v it is v + r (the rank-0 clock). The aligned slot of chunk c is
T_c = c * G. No CPU workaround beyond ``megapatch.testing.cpu_workarounds`` is needed.
"""

import logging

import pytest

from conftest import bare_module, run_python
from megapatch.testing import run_ranks

PP, VPP, MICROBATCHES, GROUP, ITERS = 2, 2, 4, 2, 2
SEQ, MICRO_BATCH, VOCAB, LR = 16, 2, 64, 0.05


class _Rec:
    def __init__(self):
        self.events, self.fwd_next, self.in_fwd, self.it, self.pp_rank = [], 0, None, 0, 0

    def slot(self):
        if self.in_fwd is not None:
            return self.in_fwd + self.pp_rank
        return 0 if self.fwd_next == 0 else self.fwd_next + self.pp_rank


def _install_stand_ins(rec, model):
    """FP8 stand-in + instrumentation (see module docstring). Returns a restore function."""
    import megatron.core.distributed.param_and_grad_buffer as pgb

    owner = {}
    for c, ddp in enumerate(model):
        for g, bg in enumerate(ddp.bucket_groups + ddp.expert_parallel_bucket_groups):
            bg._test_id = (c, g)
            for p in bg.params:
                owner[id(p)] = (c, g)
    missing = object()  # megatron-core < 0.16 has neither name: nothing to stand in for
    saved = dict(post=getattr(pgb, "post_all_gather_processing", missing),
                 isf8=getattr(pgb, "is_float8tensor", missing),
                 ag=pgb.dist_all_gather_func, finish=pgb._ParamAndGradBucketGroup.finish_param_sync)

    def post_all_gather_processing(model_params):  # STAND-IN for TE's FP8 transpose creation
        c, g = owner[id(model_params[0])]
        rec.events.append(dict(kind="process", it=rec.it, chunk=c, bg=g, slot=rec.slot()))

    def is_float8tensor(t):  # STAND-IN: "these weights are FP8 params"
        return id(t) in owner

    def dist_all_gather_func(*a, **k):
        rec.events.append(dict(kind="all_gather", it=rec.it))
        return saved["ag"](*a, **k)

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        if self.param_gather_handle is not None and rec.in_fwd is not None:
            rec.events.append(dict(kind="prehook_pending", it=rec.it, chunk=self._test_id[0]))
        if self.param_gather_handle is not None:
            rec.events.append(dict(kind="finish_in_flight", it=rec.it, chunk=self._test_id[0],
                                   bg=self._test_id[1], skip_next=skip_next_bucket_dispatch))
        return saved["finish"](self, skip_next_bucket_dispatch=skip_next_bucket_dispatch)

    if saved["post"] is not missing:  # never add the name where upstream has none (< 0.16)
        pgb.post_all_gather_processing = post_all_gather_processing
        pgb.is_float8tensor = is_float8tensor
    pgb.dist_all_gather_func = dist_all_gather_func
    pgb._ParamAndGradBucketGroup.finish_param_sync = finish_param_sync

    def restore():
        if saved["post"] is not missing:
            pgb.post_all_gather_processing = saved["post"]
            pgb.is_float8tensor = saved["isf8"]
        pgb.dist_all_gather_func = saved["ag"]
        pgb._ParamAndGradBucketGroup.finish_param_sync = saved["finish"]

    return restore


def _train(ctx, patched, psf, vpp, eval_pass=False, cost_s=0.0):
    """One configuration from fresh, seeded models. Returns losses, param hash, events, decision."""
    import hashlib
    import time

    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import megapatch
    from megapatch.testing import build_tiny_gpt, make_batch, tiny_gpt_config

    if patched:
        megapatch.enable(align_fp8_transposes=True)
    else:
        megapatch.disable()
    rec = _Rec()
    rec.pp_rank = ctx.pp_rank
    config = tiny_gpt_config(1, pp=ctx.pp_size, vpp=vpp, params_dtype=torch.float32,
                             pipeline_dtype=torch.float32, bf16=False,
                             microbatch_group_size_per_vp_stage=GROUP)
    chunks = [build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ, seed=1234, vp_stage=v)
              for v in range(vpp or 1)] if vpp else [build_tiny_gpt(config, vocab_size=VOCAB, seq_len=SEQ)]
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True,
        align_param_gather=True, bucket_size=20000)
    model = [DistributedDataParallel(config, ddp_config, m) for m in chunks]
    for m in model:
        m.broadcast_params()
    restore = _install_stand_ins(rec, model)
    if cost_s:
        import megatron.core.distributed.param_and_grad_buffer as pgb

        inner = pgb.post_all_gather_processing

        def costly(params):
            inner(params)
            time.sleep(cost_s * sum(p.numel() for p in params) / 1e5)

        pgb.post_all_gather_processing = costly
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if psf == "list":  # Megatron-LM training.py
        config.param_sync_func = [m.start_param_sync for m in model]
        if len(model) == 1:
            config.param_sync_func = config.param_sync_func[0]
    else:
        config.param_sync_func = None
    psf_set = config.param_sync_func
    config.finalize_model_grads_func = lambda chunks_, *a, **k: [m.finish_grad_sync() for m in chunks_]

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator, chunk):
        v = rec.fwd_next
        rec.in_fwd, rec.fwd_next = v, v + 1
        batch = next(data_iterator)
        out = chunk(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
        rec.in_fwd = None
        return out, loss_func

    fwd_bwd = get_forward_backward_func()
    losses, times = [], []
    try:
        for it in range(ITERS + (1 if eval_pass else 0)):
            forward_only = it == ITERS
            rec.it, rec.fwd_next, rec.in_fwd = it, 0, None
            for m in model:
                m.zero_grad_buffer()
            batches = [make_batch(100 * it + i, MICRO_BATCH, SEQ, VOCAB) for i in range(MICROBATCHES)]
            torch.distributed.barrier()
            t0 = time.perf_counter()
            with torch.no_grad() if forward_only else torch.enable_grad():
                out = fwd_bwd(forward_step_func=forward_step,
                              data_iterator=[iter(batches) for _ in model],
                              model=model if len(model) > 1 else model[0],
                              num_microbatches=MICROBATCHES, seq_length=SEQ,
                              micro_batch_size=MICRO_BATCH, forward_only=forward_only)
            times.append(time.perf_counter() - t0)
            losses.append([float(d["lm loss"]) for d in out] if out else [])
            if forward_only:
                break
            with torch.no_grad():  # distributed-optimizer stand-in: SGD on this rank's shards
                for m in model:
                    for buf in m.buffers + m.expert_parallel_buffers:
                        for bucket in buf.buckets:
                            bucket.param_data.add_(bucket.grad_data, alpha=-LR)  # DP=1: one shard
        rec.it = "final"
        for m in model:
            m.start_param_sync(force_sync=True)
    finally:
        restore()
    h = hashlib.sha256()
    for m in model:
        for name, p in m.module.named_parameters():
            h.update(name.encode())
            h.update(p.detach().numpy().tobytes())
    from megapatch.patches.fp8 import align_transposes as pm

    backend = megapatch.status().patch("fp8.align_transposes").backend
    result = dict(losses=losses, params=h.hexdigest(), events=rec.events, times=times,
                  decision=dict(pm.last_decision), backend=backend,
                  n_groups=[len(m.bucket_groups) for m in model],
                  psf_after=type(config.param_sync_func).__name__,
                  psf_restored=config.param_sync_func is psf_set)
    megapatch.disable()
    pm.last_decision.update(aligned=False, reason="no interleaved schedule call seen yet", chunks=0)
    return result


def _job(ctx):
    from megapatch.testing import reinit_model_parallel

    out = {}
    out["lazy"] = _train(ctx, patched=False, psf="list", vpp=VPP)
    out["aligned"] = _train(ctx, patched=True, psf="list", vpp=VPP)
    out["aligned_eval"] = _train(ctx, patched=True, psf="list", vpp=VPP, eval_pass=True)
    out["none_off"] = _train(ctx, patched=False, psf="none", vpp=VPP)
    out["none_on"] = _train(ctx, patched=True, psf="none", vpp=VPP)
    reinit_model_parallel(ctx, tp=1, pp=PP, vpp=None)
    out["novpp_off"] = _train(ctx, patched=False, psf="list", vpp=None)
    out["novpp_on"] = _train(ctx, patched=True, psf="list", vpp=None)
    return out


def _ddp_post_processes() -> bool:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    return hasattr(pgb, "post_all_gather_processing")


@pytest.fixture(scope="module")
def runs():
    if not _ddp_post_processes():
        pytest.skip("this megatron-core (< 0.16) runs no post-all-gather processing in DDP, so the "
                    "stand-in has nothing to record; the patch passes through here, which "
                    "test_passes_through_where_ddp_runs_no_processing checks")
    return run_ranks(_job, world_size=PP, tp=1, pp=PP, vpp=VPP, timeout=600)


def _process_slots(result, it=ITERS - 1):
    return {(e["chunk"], e["bg"]): e["slot"] for e in result["events"]
            if e["kind"] == "process" and e["it"] == it}


def _count(result, kind, it=ITERS - 1):
    return sum(1 for e in result["events"] if e["kind"] == kind and e["it"] == it)


@pytest.mark.quick("fp8.align_transposes")
def test_aligned_processing_runs_at_the_same_slot_on_every_stage(runs):
    for rank, r in enumerate(runs):
        slots = _process_slots(r["aligned"])
        assert slots, f"rank {rank}: no post-all-gather processing recorded"
        n_groups = r["aligned"]["n_groups"]
        assert len(slots) == sum(n_groups), (rank, slots, n_groups)  # every group, once
        for (chunk, _bg), slot in slots.items():
            assert slot == chunk * GROUP, (rank, chunk, slot)


def test_unpatched_processing_slot_lags_by_pipeline_rank(runs):
    """The same measurement without the patch: stage r processes chunk c at T_c + r."""
    for rank, r in enumerate(runs):
        for (chunk, _bg), slot in _process_slots(r["lazy"]).items():
            assert slot == chunk * GROUP + rank, (rank, chunk, slot)
    assert any(s != c * GROUP for (c, _), s in _process_slots(runs[1]["lazy"]).items())


def test_results_are_bit_identical_patched_vs_unpatched(runs):
    for r in runs:
        assert r["lazy"]["params"] == r["aligned"]["params"]
        assert r["lazy"]["losses"] == r["aligned"]["losses"]
        assert r["aligned_eval"]["losses"][:ITERS] == r["aligned"]["losses"]
    assert runs[-1]["lazy"]["losses"][0], "the last stage reports losses"


def test_prehook_finds_no_pending_gather_with_the_patch(runs):
    for r in runs:
        assert _count(r["lazy"], "prehook_pending") > 0
        assert _count(r["aligned"], "prehook_pending") == 0


def test_no_extra_all_gathers(runs):
    for r in runs:
        for it in range(ITERS):
            assert _count(r["aligned"], "all_gather", it) == _count(r["lazy"], "all_gather", it) > 0
        assert _count(r["aligned"], "process") == _count(r["lazy"], "process")


def test_patch_reports_alignment_and_restores_param_sync_func(runs):
    for r in runs:
        assert r["aligned"]["decision"] == {"aligned": True, "reason": "aligned", "chunks": VPP}
        assert r["aligned"]["backend"] == f"aligned {VPP} chunks at param-sync slots (last call)"
        assert r["aligned"]["psf_after"] == "list"
        assert r["aligned"]["psf_restored"] and r["lazy"]["psf_restored"]  # the caller's own list


def test_in_flight_gathers_are_finished_as_the_prehook_would(runs):
    """Every in-flight gather is finished once per iteration, with the skip_next_bucket_dispatch
    value the DDP forward pre-hook passes (align_param_gather=True here)."""
    for r in runs:
        for it in range(ITERS):
            finished = {run: sorted((e["chunk"], e["bg"], e["skip_next"]) for e in r[run]["events"]
                                    if e["kind"] == "finish_in_flight" and e["it"] == it)
                        for run in ("lazy", "aligned")}
            assert finished["aligned"] == finished["lazy"], (it, finished)
            assert finished["lazy"] and all(skip for _c, _g, skip in finished["lazy"]), finished


def test_forward_only_passes_through_with_the_reason(runs):
    for r in runs:
        d = r["aligned_eval"]["decision"]
        assert not d["aligned"] and d["reason"].startswith("forward_only")
        assert r["aligned_eval"]["backend"].startswith("passing through: forward_only")


def test_param_sync_func_none_passes_through_unchanged(runs):
    for r in runs:
        off, on = r["none_off"], r["none_on"]
        assert on["decision"]["aligned"] is False
        assert "param_sync_func is None" in on["decision"]["reason"]
        assert on["backend"].startswith("passing through: config.param_sync_func is None")
        assert (on["params"], on["losses"]) == (off["params"], off["losses"])
        assert _process_slots(on) == _process_slots(off)
        assert on["params"] == r["lazy"]["params"]  # same training, only the dispatch differs


def test_without_vpp_behaviour_is_unchanged(runs):
    for r in runs:
        off, on = r["novpp_off"], r["novpp_on"]
        assert (on["params"], on["losses"]) == (off["params"], off["losses"])
        assert _process_slots(on) == _process_slots(off)
        assert on["decision"]["reason"] == "no interleaved schedule call seen yet"  # never wrapped


def test_status_reports_the_patch_without_a_call(monkeypatch):
    import megapatch
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    from megapatch.patches.fp8 import align_transposes as pm

    # the last decision is process-wide: an in-process test of this file that ran the aligned path
    # (pytest-xdist puts them in one worker, in any order) must not decide what "no call" shows
    monkeypatch.setattr(pm, "last_decision", {"aligned": False, "reason": "no interleaved schedule call seen yet",
                                              "chunks": 0})
    megapatch.enable(align_fp8_transposes=True)
    report = megapatch.status().patch("fp8.align_transposes")
    assert report.state == "active"
    assert report.backend.startswith("passing through:")


def _pass_through_reason(ctx):
    """Versions without DDP post-processing: the real schedule runs unchanged, with the reason."""
    return _train(ctx, patched=True, psf="list", vpp=VPP)["decision"]


def test_passes_through_where_ddp_runs_no_processing():
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from megapatch.patches.fp8.align_transposes import _has_processing

    if _has_processing(pgb):
        pytest.skip("this megatron-core (>= 0.16) post-processes in DDP: the patch aligns here "
                    "instead of passing through, which the slot tests above check")
    decision = run_ranks(_pass_through_reason, world_size=PP, tp=1, pp=PP, vpp=VPP, timeout=600)[0]
    assert not decision["aligned"] and "0.16" in decision["reason"], decision


# -- the wrapper's logic on a stand-in schedule (in process, no ranks) ---------------------------


def test_chunk_order_helper_matches_upstream_schedule_table_for_uneven_groups():
    import megatron.core.pipeline_parallel.schedules as schedules
    from megapatch.patches.fp8.align_transposes import _chunk_of_virtual_microbatch

    table = getattr(schedules, "get_schedule_table", None)
    if table is None:
        from megatron.core.pipeline_parallel import utils

        table = getattr(utils, "get_schedule_table", None)
    if table is None:
        pytest.skip("this megatron-core has no get_schedule_table to compare with")
    cases = [(m, c, g) for m in (1, 2, 3, 4, 5, 7, 8, 9) for c in (2, 3) for g in (1, 2, 3, 4, 5)]
    assert any(m % g for m, _c, g in cases)  # uneven last groups are covered
    for m, c, g in cases:
        assert _chunk_of_virtual_microbatch(m, c, g) == [chunk for _mb, chunk in table(m, c, g)], (m, c, g)


class _FakeBucketGroup:
    """The attributes the aligner reads from a _ParamAndGradBucketGroup, and its finish calls."""

    def __init__(self, dispatched=True, in_flight=True):
        self.params = []
        self.param_gather_dispatched = dispatched
        self.param_gather_handle = object() if dispatched and in_flight else None
        self.finished = []

    def finish_param_sync(self, skip_next_bucket_dispatch=False):
        self.finished.append(skip_next_bucket_dispatch)
        self.param_gather_handle = None


class _FakeChunk:
    """A model chunk that is its own DDP (the test replaces _unwrap_ddp by the identity)."""

    def __init__(self, config, align_param_gather, with_optimizer_step=False):
        from types import SimpleNamespace

        self.config = config
        self.ddp_config = SimpleNamespace(align_param_gather=align_param_gather)
        self.overlap_param_gather_with_optimizer_step = with_optimizer_step
        self.in_flight = _FakeBucketGroup()
        self.expert_in_flight = _FakeBucketGroup()
        self.not_dispatched = _FakeBucketGroup(dispatched=False)
        self.already_done = _FakeBucketGroup(in_flight=False)
        self.bucket_groups = [self.in_flight, self.not_dispatched, self.already_done]
        self.expert_parallel_bucket_groups = [self.expert_in_flight]


def _run_stand_in_schedule(monkeypatch, forward_chunks, chunks):
    """Calls the patch's schedule wrapper around a stand-in schedule that dispatches chunk 0, runs
    ``forward_chunks`` (chunk index per local forward step, PP rank 0) and calls
    param_sync_func[1] at chunk 1's slot. Returns (decision, config, the caller's list, log)."""
    from types import SimpleNamespace

    import megapatch
    import megatron.core.distributed.param_and_grad_buffer  # noqa: F401  (the patch requires it)
    from megapatch.patches.fp8 import align_transposes as pm

    monkeypatch.setattr(pm, "_why_not", lambda args, kwargs, pgb: None)
    monkeypatch.setattr(pm, "_unwrap_ddp", lambda chunk: chunk)
    monkeypatch.setattr(pm, "last_decision", dict(pm.last_decision))
    log = []
    config = SimpleNamespace(microbatch_group_size_per_vp_stage=2)
    model = [_FakeChunk(config, **kw) for kw in chunks]
    caller_list = [lambda *a, i=i: log.append(("dispatch", i)) for i in range(len(model))]
    config.param_sync_func = caller_list

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, pg_collection):
        config.param_sync_func[0]()
        for v, c in enumerate(forward_chunks):
            if v == 1:
                config.param_sync_func[1]()  # chunk 1's dispatch slot (rank 0: T_1 - 1)
            forward_step_func(data_iterator, model[c])
        return "schedule result"

    def forward_step(data_iterator, chunk):
        log.append(("forward", model.index(chunk)))

    megapatch.enable(align_fp8_transposes=True)
    pp = SimpleNamespace(pp=SimpleNamespace(rank=lambda: 0))
    out = pm._schedule(schedule, None, (), dict(forward_step_func=forward_step, data_iterator=None,
                                                 model=model, num_microbatches=len(forward_chunks) // 2,
                                                 pg_collection=pp))
    assert out == "schedule result"
    return dict(pm.last_decision), config, caller_list, model, log


def test_stand_in_schedule_finishes_dense_and_expert_groups_in_flight_only(monkeypatch):
    decision, config, caller_list, model, log = _run_stand_in_schedule(
        monkeypatch, [0, 0, 1, 1], [dict(align_param_gather=True), dict(align_param_gather=False)])
    assert decision == {"aligned": True, "reason": "aligned", "chunks": 2}
    assert config.param_sync_func is caller_list  # restored: the caller's own list, not a copy
    assert [e for e in log if e[0] == "dispatch"] == [("dispatch", 0), ("dispatch", 1)]
    # skip_next_bucket_dispatch: what DDP's pre-hook passes for each chunk's configuration
    for chunk, skip in zip(model, (True, False)):
        assert chunk.in_flight.finished == [skip], chunk.in_flight.finished
        assert chunk.expert_in_flight.finished == [skip]  # expert-parallel groups are not dropped
        assert chunk.not_dispatched.finished == [] and chunk.already_done.finished == []  # in flight only


def test_stand_in_schedule_passes_the_optimizer_step_overlap_flag(monkeypatch):
    _decision, _config, _list, model, _log = _run_stand_in_schedule(
        monkeypatch, [0, 0, 1, 1], [dict(align_param_gather=False, with_optimizer_step=True)] * 2)
    for chunk in model:
        assert chunk.in_flight.finished == [True] and chunk.expert_in_flight.finished == [True]


def test_out_of_order_forward_steps_are_not_reported_as_aligned(monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="megapatch")
    decision, config, caller_list, model, _log = _run_stand_in_schedule(
        monkeypatch, [1, 0, 0, 1], [dict(align_param_gather=True)] * 2)
    assert decision["aligned"] is False and "out of virtual-microbatch order" in decision["reason"], decision
    said = [r.getMessage() for r in caplog.records if r.name == "megapatch"]
    assert any("passes through" in m and "out of virtual-microbatch order" in m for m in said), said
    assert config.param_sync_func is caller_list
    assert model[1].in_flight.finished == []  # nothing aligned after the fallback


# -- issue 28 survivor: one MXFP8 parameter must not switch the alignment off for the whole model --

class _StandInDDP:
    """LABELLED STAND-IN for a megatron-core DistributedDataParallel chunk as ``_why_not`` reads it
    (FP8 parameters do not exist on CPU): the distributed optimizer with overlapped, aligned param
    gathers, forward pre-hooks on, one bucket group holding ``params``."""

    def __init__(self, config, params):
        from types import SimpleNamespace

        self.config = config
        self.ddp_config = SimpleNamespace(use_distributed_optimizer=True, overlap_param_gather=True,
                                          align_param_gather=True, reuse_grad_buf_for_mxfp8_param_ag=False)
        self.use_forward_hook = True
        self.remove_forward_pre_hook_handles = {"chunk": "handle"}
        group = _FakeBucketGroup()
        group.params = list(params)
        self.bucket_groups, self.expert_parallel_bucket_groups = [group], []


def _decision(monkeypatch, chunks, change=None):
    """``_why_not`` for a VPP model whose chunk i holds the kinds ``chunks[i]`` ('fp8', 'mxfp8',
    'bf16'), after ``change(model, pgb, call)`` edits it (``call`` holds ``args`` and ``kwargs``). The dispatch stand-in follows TE 2.x's classes as megatron-core tests them
    (fp8_utils.py, 0.16.1): ``is_float8tensor`` is ``isinstance(t, QuantizedTensor)``, True for
    per-tensor FP8 *and* MXFP8 params; ``is_mxfp8tensor`` is True for MXFP8 ones only. TE's
    ``post_all_gather_processing`` creates the transpose of a Float8Tensor (on GPUs without non-TN
    FP8 GEMMs) and does nothing for an MXFP8Tensor (TE pytorch/tensor/utils.py)."""
    from types import SimpleNamespace

    import torch

    import megatron.core.distributed.param_and_grad_buffer as real_pgb
    from megapatch.patches.fp8 import align_transposes as pm

    monkeypatch.setattr(pm, "_unwrap_ddp", lambda chunk: chunk)
    kinds = {}
    config = SimpleNamespace(param_sync_func=[lambda: None] * len(chunks))
    model = []
    for chunk in chunks:
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in chunk]
        kinds.update((id(p), kind) for p, kind in zip(params, chunk))
        model.append(_StandInDDP(config, params))
    pgb = SimpleNamespace(
        _ParamAndGradBucketGroup=real_pgb._ParamAndGradBucketGroup,
        post_all_gather_processing=lambda params: None,  # STAND-IN for TE's processing
        is_float8tensor=lambda t: kinds.get(id(t)) in ("fp8", "mxfp8"),
        is_mxfp8tensor=lambda t: kinds.get(id(t)) == "mxfp8")
    call = {"args": (), "kwargs": dict(model=model, forward_step_func=None, data_iterator=None, num_microbatches=4)}
    if change is not None:
        change(model, pgb, call)
    return pm._why_not(call["args"], call["kwargs"], pgb)


@pytest.mark.parametrize("chunks", [
    (("fp8", "mxfp8", "bf16"), ("fp8", "fp8")),  # one chunk mixes both kinds
    (("mxfp8", "mxfp8"), ("fp8", "bf16")),       # one chunk all MXFP8, the other FP8
    (("fp8",), ("fp8", "fp8")),
], ids=["mixed-in-a-chunk", "mixed-across-chunks", "fp8-only"])
def test_a_model_with_any_per_tensor_fp8_parameter_is_aligned(monkeypatch, chunks):
    """The FP8 parameters' transposes are still built after the all-gather, whatever MXFP8
    parameters sit beside them: aligning must not pass through."""
    assert _decision(monkeypatch, chunks) is None


def test_only_a_model_whose_quantized_parameters_are_all_mxfp8_passes_through(monkeypatch):
    reason = _decision(monkeypatch, [("mxfp8", "bf16"), ("mxfp8",)])
    assert reason == "MXFP8 parameters: TE's post-all-gather processing is a no-op", reason
    assert _decision(monkeypatch, [("bf16",), ("bf16",)]).startswith("no FP8 parameters")


# -- every reason the alignment passes through, and the pieces it reads (labelled stand-ins) -------

def _why_not_after(monkeypatch, change):
    """``_why_not`` on an all-FP8 model of two chunks after ``change``; the changes touch the *last*
    chunk: a check of the first chunk only would miss them."""
    return _decision(monkeypatch, [("fp8",), ("fp8",)], change)


def _set(obj, **values):
    for name, value in values.items():
        setattr(obj, name, value)


WHY_NOT = {
    "positional": (lambda m, p, c: c.update(args=(None,)), "called with positional arguments"),
    "one chunk": (lambda m, p, c: c["kwargs"].update(model=m[:1]), "no virtual pipeline"),
    "not a list": (lambda m, p, c: c["kwargs"].update(model=m[0]), "no virtual pipeline"),
    "forward only": (lambda m, p, c: c["kwargs"].update(forward_only=True), "forward_only"),
    "no param_sync_func": (lambda m, p, c: _set(m[1].config, param_sync_func=None), "config.param_sync_func is None"),
    "no DDP processing": (lambda m, p, c: delattr(p, "post_all_gather_processing")
                          or _set(p, _ParamAndGradBucketGroup=type("Group", (), {})), "megatron-core < 0.16"),
    "no distributed optimizer": (lambda m, p, c: _set(m[1].ddp_config, use_distributed_optimizer=False),
                                 "overlap_param_gather is off"),
    "no overlap": (lambda m, p, c: _set(m[1].ddp_config, overlap_param_gather=False), "overlap_param_gather is off"),
    "no forward hook": (lambda m, p, c: _set(m[1], use_forward_hook=False), "overlap_param_gather is off"),
    "pre-hooks removed": (lambda m, p, c: _set(m[1], remove_forward_pre_hook_handles={}),
                          "DDP forward pre-hooks are disabled"),
    "MXFP8 grad-buffer reuse": (lambda m, p, c: _set(m[1].ddp_config, reuse_grad_buf_for_mxfp8_param_ag=True),
                                "MXFP8 with reuse_grad_buf_for_mxfp8_param_ag"),
    "bucket group without handle": (lambda m, p, c: delattr(m[1].bucket_groups[0], "param_gather_handle"),
                                    "bucket groups have no param_gather_handle"),
    "expert group without dispatch flag": (
        lambda m, p, c: m[1].expert_parallel_bucket_groups.append(type("Group", (), {"params": []})()),
        "bucket groups have no param_gather_handle"),
    "no FP8 parameter": (lambda m, p, c: _set(p, is_float8tensor=lambda t: False), "no FP8 parameters"),
}


@pytest.mark.parametrize("case", sorted(WHY_NOT))
def test_each_reason_to_pass_through_is_found_on_any_chunk_and_named(monkeypatch, case):
    change, reason = WHY_NOT[case]
    assert _why_not_after(monkeypatch, lambda m, p, c: None) is None  # the control: aligned
    found = _why_not_after(monkeypatch, change)
    assert found is not None and found.startswith(reason), (case, found)


def test_a_te_before_2_10_is_named_where_megatron_dispatches_its_processing_to_nothing(monkeypatch):
    """megatron-core's ``fp8_utils.post_all_gather_processing`` with no TE function behind it
    (TE < 2.10: ``te_post_all_gather_processing`` None) does nothing: nothing to align."""
    from megatron.core import fp8_utils

    if not hasattr(fp8_utils, "post_all_gather_processing"):
        pytest.skip("this megatron-core has no post-all-gather processing to dispatch (< 0.16)")

    def megatrons_dispatcher(model, pgb, call):
        pgb.post_all_gather_processing = fp8_utils.post_all_gather_processing

    monkeypatch.setattr(fp8_utils, "te_post_all_gather_processing", None, raising=False)
    assert _why_not_after(monkeypatch, megatrons_dispatcher).startswith("Transformer Engine < 2.10")
    monkeypatch.setattr(fp8_utils, "te_post_all_gather_processing", lambda params: None)  # TE >= 2.10
    assert _why_not_after(monkeypatch, megatrons_dispatcher) is None


def test_a_chunks_ddp_is_found_through_up_to_four_module_wrappers():
    import torch
    from megatron.core.distributed import DistributedDataParallel

    from megapatch.patches.fp8.align_transposes import _unwrap_ddp

    ddp = bare_module(DistributedDataParallel)  # the type is what is read; nothing is built

    def wrapped(inner, times):
        for _ in range(times):
            outer = torch.nn.Module()
            outer.module = inner
            inner = outer
        return inner

    assert [_unwrap_ddp(wrapped(ddp, n)) is ddp for n in range(5)] == [True, True, True, True, False]
    assert _unwrap_ddp(wrapped(torch.nn.Linear(1, 1), 2)) is None
    assert _unwrap_ddp(torch.nn.Linear(1, 1)) is None


def test_the_pipeline_rank_is_read_from_the_communicator_then_the_process_groups_then_megatrons_state(monkeypatch):
    from types import SimpleNamespace

    from megatron.core import parallel_state

    from megapatch.patches.fp8.align_transposes import _pp_rank

    group = lambda rank: SimpleNamespace(rank=lambda: rank)  # noqa: E731
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: 7)
    assert _pp_rank({"p2p_communicator": SimpleNamespace(pp_group=group(3)), "pg_collection": SimpleNamespace(pp=group(5))}) == 3
    assert _pp_rank({"p2p_communicator": SimpleNamespace(pp_group=None), "pg_collection": SimpleNamespace(pp=group(5))}) == 5
    assert _pp_rank({"p2p_communicator": SimpleNamespace(), "pg_collection": SimpleNamespace(pp=None)}) == 7
    assert _pp_rank({}) == 7


def test_quantized_parameters_are_recognised_by_each_releases_own_test_and_counted_once_per_dispatch(monkeypatch):
    """0.19+: ``_param_uses_quantized_storage``; earlier: ``is_float8tensor``, then 0.18's
    ``is_nvfp4tensor``. The counts are cached per chunk until the dispatch function changes."""
    import weakref
    from types import SimpleNamespace

    import torch

    from megapatch.patches.fp8 import align_transposes as pm

    a, b = torch.zeros(1), torch.zeros(2)
    assert pm._is_quantized(SimpleNamespace(_param_uses_quantized_storage=lambda p: p is a, is_float8tensor=lambda p: True), b) is False
    assert pm._is_quantized(SimpleNamespace(_param_uses_quantized_storage=lambda p: p is a), a) is True
    assert pm._is_quantized(SimpleNamespace(is_float8tensor=lambda p: p is a), a) is True
    assert pm._is_quantized(SimpleNamespace(is_float8tensor=lambda p: False, is_nvfp4tensor=lambda p: p is b), b) is True
    assert pm._is_quantized(SimpleNamespace(is_float8tensor=lambda p: False, is_nvfp4tensor=lambda p: False), b) is False
    assert pm._is_quantized(SimpleNamespace(), a) is False

    monkeypatch.setattr(pm, "_quant_cache", weakref.WeakKeyDictionary())
    group, expert_group = _FakeBucketGroup(), _FakeBucketGroup()
    group.params, expert_group.params = [a, b], [b]
    chunk = type("Chunk", (), {})()  # weak-referenceable: the cache is keyed by the chunk's DDP
    chunk.bucket_groups, chunk.expert_parallel_bucket_groups = [group], [expert_group]
    first = SimpleNamespace(is_float8tensor=lambda p: True, is_mxfp8tensor=lambda p: p is b)
    assert pm._quantized_kinds(first, chunk) == {"quantized": 3, "mxfp8": 2, "float8": 0}
    group.params.append(torch.zeros(3))
    assert pm._quantized_kinds(first, chunk) == {"quantized": 3, "mxfp8": 2, "float8": 0}  # cached
    second = SimpleNamespace(is_float8tensor=lambda p: p is a, is_mxfp8tensor=lambda p: False)
    assert pm._quantized_kinds(second, chunk) == {"quantized": 1, "mxfp8": 0, "float8": 0}  # recounted


def test_the_backend_says_the_last_decision(monkeypatch):
    from megapatch.patches.fp8 import align_transposes as pm

    monkeypatch.setattr(pm, "last_decision", {"aligned": True, "reason": "aligned", "chunks": 3})
    assert pm._backend() == "aligned 3 chunks at param-sync slots (last call)"
    monkeypatch.setattr(pm, "last_decision", {"aligned": False, "reason": "forward_only (...)", "chunks": 0})
    assert pm._backend() == "passing through: forward_only (...)"


def test_the_probe_names_each_piece_of_the_bucket_group_it_relies_on(monkeypatch):
    import megatron.core.distributed.param_and_grad_buffer as real_pgb

    from megapatch.patches.fp8 import align_transposes as pm

    assert pm._probe() is None
    group = real_pgb._ParamAndGradBucketGroup
    with monkeypatch.context() as m:
        m.setattr(group, "finish_param_sync", lambda self, force_sync=False: None)
        assert pm._probe() == "_ParamAndGradBucketGroup.finish_param_sync has no skip_next_bucket_dispatch parameter"
    with monkeypatch.context() as m:
        m.delattr(group, "finish_param_sync")
        assert pm._probe().endswith("_ParamAndGradBucketGroup.finish_param_sync does not exist")
    with monkeypatch.context() as m:
        def __init__(self, buckets):
            self.param_gather_handle = None  # no param_gather_dispatched any more
        m.setattr(group, "__init__", __init__)
        assert pm._probe() == "_ParamAndGradBucketGroup no longer sets param_gather_dispatched"
    with monkeypatch.context() as m:
        m.delattr(real_pgb, "_ParamAndGradBucketGroup")
        assert pm._probe().endswith("._ParamAndGradBucketGroup does not exist")


def test_a_forward_step_beyond_the_schedule_table_stops_aligning_instead_of_failing(monkeypatch):
    """A schedule that runs more forward steps than its table has (a changed upstream schedule): the
    extra step runs as upstream's, the call is reported as not aligned, nothing raises."""
    decision, config, caller_list, _model, log = _run_stand_in_schedule(
        monkeypatch, [0, 0, 1, 1, 0], [dict(align_param_gather=True)] * 2)  # a table of 4 steps, 5 run
    assert [e for e in log if e[0] == "forward"] == [("forward", c) for c in (0, 0, 1, 1, 0)]
    assert decision["aligned"] is False and "out of virtual-microbatch order" in decision["reason"], decision
    assert config.param_sync_func is caller_list


# -- issue 28 item 8: survivors of the seventh fresh mutation sample (seed 34) ---------------------

def test_before_any_schedule_call_the_decision_says_nothing_was_aligned():
    """``last_decision`` (documented as what status shows) in a fresh process: not aligned, no call
    seen, 0 chunks aligned."""
    done = run_python("from megapatch.patches.fp8 import align_transposes as pm\n"
                      "print(pm.last_decision)\nprint(pm._backend())\n", fresh=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "{'aligned': False, 'reason': 'no interleaved schedule call seen yet', 'chunks': 0}",
        "passing through: no interleaved schedule call seen yet"], done.stdout
