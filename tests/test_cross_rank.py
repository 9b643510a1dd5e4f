"""Ranks of one TP group with different megapatch settings stop with a clear error, fast.

Every rank function bounds its collectives (``_bounded``): where the check is missing, ranks
with different settings issue mismatched collectives that hang, and the test must fail in
seconds, not at the harness's timeout.
"""

import os
import subprocess
import sys
import threading

import pytest
import torch

from megapatch.core.errors import CrossRankMismatchError
from megapatch.testing import RankFailure, RankTimeout, run_ranks
from megapatch.testing.ranks.ports import rendezvous_port

from conftest import REPO, environ_without_megapatch, run_python

COLLECTIVE_DEADLINE_S = 120  # a hung collective fails the test; generous for a loaded machine
# a check timeout no job here reaches: a refusal that came only at the timeout ends the job at its own
# (much shorter) deadline instead, so "at once" is tested without measuring a time
NEVER = "3600"


def _bounded(fn, seconds=COLLECTIVE_DEADLINE_S):
    """``fn()``, or an error if it has not returned after ``seconds`` (a hung collective)."""
    result, error = [], []

    def run():
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 -- handed to the caller
            error.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"collective still running after {seconds} s: the ranks' settings were "
                           f"not checked before it (mismatched collectives hang)")
    if error:
        raise error[0]
    return result[0]


def _reduce_once(ctx, per_rank_mode):
    import megapatch
    from megatron.core.tensor_parallel import mappings

    mode = per_rank_mode[ctx.rank]
    if mode is not None:
        megapatch.enable(tp_reduce_dtype=mode)
    x = torch.ones(8, dtype=torch.bfloat16)
    return _bounded(lambda: mappings.reduce_from_tensor_model_parallel_region(x, group=ctx.tp_group).tolist())


def test_different_settings_in_one_tp_group_are_refused():
    """Refused when the settings are exchanged, not at the check timeout: that is set far beyond
    the job's own deadline, so a refusal that waited for it would end the job as a RankTimeout."""
    with pytest.raises(RankFailure) as err:
        run_ranks(_reduce_once, world_size=2, tp=2, args=(["fp32", "fp32-accumulate"],), timeout=300,
                  env={"MEGAPATCH_CHECK_TIMEOUT": NEVER})
    text = str(err.value)
    assert not isinstance(err.value, RankTimeout), text[-3000:]
    assert "CrossRankMismatchError" in text, text[-3000:]
    assert "megapatch settings differ across tensor-parallel group [0, 1]" in text
    assert "tp_reduce_dtype=fp32;" in text and "tp_reduce_dtype=fp32-accumulate;" in text


def test_a_peer_without_megapatch_is_named_after_the_timeout():
    with pytest.raises(RankFailure) as err:
        run_ranks(_reduce_once, world_size=2, tp=2, args=(["fp32", None],), timeout=120,
                  env={"MEGAPATCH_CHECK_TIMEOUT": "3"})
    text = str(err.value)
    assert "rank(s) [1] of tensor-parallel group [0, 1] published no megapatch settings within 3 s" in text
    assert "the kill switch MEGAPATCH_DISABLE is set there" in text  # one cause a 1,000-rank job meets


@pytest.mark.quick("cross_rank.publish_settings", "tp_reduce.megatron_core")
def test_same_settings_pass_and_reduce():
    out = run_ranks(_reduce_once, world_size=2, tp=2, args=(["fp32", "fp32"],), timeout=120)
    assert out == [[2.0] * 8, [2.0] * 8]


def test_error_type_is_public():
    assert issubclass(CrossRankMismatchError, RuntimeError)


# -- a rank that disables and re-enables the same settings agrees with its peers --------------

def _toggle_then_reduce(ctx):
    import megapatch
    from megatron.core.tensor_parallel import mappings

    megapatch.enable(tp_reduce_dtype="fp32")
    if ctx.rank == 1:
        megapatch.disable()
        megapatch.enable(tp_reduce_dtype="fp32")
    x = torch.ones(8, dtype=torch.bfloat16)
    return _bounded(lambda: mappings.reduce_from_tensor_model_parallel_region(x, group=ctx.tp_group).tolist())


def test_disable_then_enable_the_same_settings_is_no_mismatch():
    out = run_ranks(_toggle_then_reduce, world_size=2, tp=2, timeout=120,
                    env={"MEGAPATCH_CHECK_TIMEOUT": "15"})
    assert out == [[2.0] * 8, [2.0] * 8]


# -- logits: no TP reduction is patched, the check still runs (first patched call) ------------

def _logits_forward(ctx, per_rank_mode):
    import megapatch
    from megapatch.testing import build_tiny_gpt, make_batch, tiny_gpt_config

    megapatch.enable(logits_dtype=per_rank_mode[ctx.rank])
    model = build_tiny_gpt(tiny_gpt_config(tp=ctx.tp_size), vocab_size=64, seq_len=8)
    batch = make_batch(seed=5, batch=1, seq_len=8, vocab=64)
    logits = _bounded(lambda: model(batch.tokens, batch.position_ids, batch.attention_mask))
    return str(logits.dtype)


def test_different_logits_dtype_in_one_tp_group_is_refused():
    with pytest.raises(RankFailure) as err:
        run_ranks(_logits_forward, world_size=2, tp=2, args=(["fp32", "native"],), timeout=150,
                  env={"MEGAPATCH_CHECK_TIMEOUT": "60"})
    text = str(err.value)
    assert "CrossRankMismatchError" in text, text[-3000:]
    assert "rank 1 runs logits_dtype=native (this rank: fp32)" in text


def test_same_logits_dtype_passes():
    assert run_ranks(_logits_forward, world_size=2, tp=2, args=(["fp32", "fp32"],),
                     timeout=150) == ["torch.float32", "torch.float32"]


# -- Megatron-LM order: megatron imported before the process group; a rank set to native -------

@pytest.mark.parametrize("peer, named", [
    ({"MEGAPATCH_TP_REDUCE_DTYPE": "native"}, "rank 1 runs tp_reduce_dtype=native (this rank: fp32)"),
    # issue 19 item 12: the kill switch on one rank of a job that asks for FP32 everywhere
    ({"MEGAPATCH_TP_REDUCE_DTYPE": "fp32", "MEGAPATCH_DISABLE": "1"},
     "rank 1 has megapatch switched off by the kill switch MEGAPATCH_DISABLE"),
])
def test_a_native_or_switched_off_rank_is_named_at_once_in_the_megatron_lm_order(peer, named):
    script = os.path.join(REPO, "tests", "scripts", "megatron_lm_order_tp2.py")
    base = environ_without_megapatch()
    base.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous_port()),
                PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", MEGAPATCH_CHECK_TIMEOUT=NEVER)
    procs = []
    for rank, variables in enumerate(({"MEGAPATCH_TP_REDUCE_DTYPE": "fp32"}, peer)):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), **variables)
        procs.append(subprocess.Popen([sys.executable, script], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=REPO))
    try:
        out0, _ = procs[0].communicate(timeout=300)  # the job's deadline, far below the check timeout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
    lines = [line for line in out0.splitlines() if line.startswith("FAILED after")]
    assert lines, out0[-3000:]
    assert "CrossRankMismatchError" in lines[0]
    assert named in lines[0]  # at model-parallel initialisation: the check timeout is never reached


def _replicas(ctx, per_rank_mode):
    """Each rank's settings are set before megatron builds its groups (as MEGAPATCH_* variables
    would), then TP=2 x DP=2 is initialised: the check at initialisation covers the whole job."""
    import megapatch
    from megapatch.testing import reinit_model_parallel

    megapatch.enable(tp_reduce_dtype=per_rank_mode[ctx.rank])
    try:
        reinit_model_parallel(ctx, tp=2)
    except CrossRankMismatchError as exc:
        return f"refused: {exc}"
    return "ok"


@pytest.mark.parametrize("modes", [("fp32", "fp32", "native", "native"), ("native", "native", "fp32", "fp32")])
def test_data_parallel_replicas_with_different_settings_are_refused(modes):
    """World 4 = TP 2 x DP 2, one replica fp32 and the other native: each TP group agrees, so only
    a whole-job check can tell; whichever replica rank 0 is in, a rank reports it in seconds."""
    out = run_ranks(_replicas, world_size=4, args=(list(modes),), init_megatron=False, timeout=300,
                    env={"MEGAPATCH_CHECK_TIMEOUT": NEVER})  # refused before the job's deadline: not the timeout
    refused = [text for text in out if text != "ok"]
    assert refused, out
    assert all("megapatch settings differ across the job (world size 4" in text for text in refused), refused
    assert run_ranks(_replicas, world_size=4, args=(["fp32"] * 4,), init_megatron=False,
                     timeout=120) == ["ok"] * 4


def _replicas_at_tp1(ctx, per_rank_settings):
    """As ``_replicas``, at TP=1 x DP=2: every TP group is one rank, so only the whole-job check
    at model-parallel initialisation can see the two replicas differ."""
    import megapatch
    from megapatch.testing import reinit_model_parallel

    megapatch.enable(**per_rank_settings[ctx.rank])
    try:
        reinit_model_parallel(ctx, tp=1)
    except CrossRankMismatchError as exc:
        return f"refused: {exc}"
    return "ok"


@pytest.mark.parametrize("settings,named", [
    ([dict(logits_dtype="fp32"), dict()], "rank 1 runs logits_dtype=native (this rank: fp32)"),
    ([dict(), dict(tp_reduce_dtype="fp32")], "rank 0 runs tp_reduce_dtype=native (this rank: fp32)"),
    ([dict(logits_dtype="fp32"), dict(tp_reduce_dtype="fp32")], "logits_dtype="),
], ids=["rank0-asks", "rank1-asks", "both-ask-differently"])
def test_data_parallel_replicas_at_tp1_with_different_settings_are_refused(settings, named):
    """issue 28 survivor: the whole-job check skipped at TP=1 (every whole-job test was TP=2 x
    DP=2) let data-parallel replicas in different modes train silently. At TP=1 x DP=2 the rank
    that asks for a change is refused at model-parallel initialisation, naming the difference;
    a native rank only publishes (it works beside peers without megapatch)."""
    out = run_ranks(_replicas_at_tp1, world_size=2, args=(settings,), init_megatron=False, timeout=120,
                    env={"MEGAPATCH_CHECK_TIMEOUT": NEVER})  # refused before the job's deadline: not the timeout
    asking = [rank for rank, s in enumerate(settings) if s]
    for rank in asking:
        assert out[rank].startswith("refused: megapatch settings differ across the job (world size 2"), out
        assert named in out[rank], out
    assert all(out[rank] == "ok" for rank, s in enumerate(settings) if not s), out
    assert run_ranks(_replicas_at_tp1, world_size=2, args=([settings[asking[0]]] * 2,), init_megatron=False,
                     timeout=120) == ["ok", "ok"]


# -- mutation-audit additions (results/mutation.md): the tp_invariant options are compared, a
# -- reconfiguration forgets verified groups, and the helpers' own contracts ---------------------

def _invariant_at_init(ctx, per_rank_settings):
    """Settings set before megatron builds TP=2 (as MEGAPATCH_* variables would)."""
    import megapatch
    from megapatch.testing import reinit_model_parallel

    megapatch.enable(**per_rank_settings[ctx.rank])
    try:
        reinit_model_parallel(ctx, tp=2)
    except CrossRankMismatchError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize("settings,named", [
    ([dict(tp_invariant=True), dict(logits_dtype="fp32")], "tp_invariant=False (this rank: True)"),
    ([dict(tp_invariant=True), dict(tp_invariant=True, tp_invariant_width=16)],
     "rank 1 runs tp_invariant_width=16 (this rank: 8)"),
])
def test_ranks_differing_in_tp_invariant_or_its_width_are_refused(settings, named):
    """Both ranks ask for a change (neither is native), but not the same one: bitwise invariance on
    one rank and not the other, or two widths (different trees), would silently break the result."""
    out = run_ranks(_invariant_at_init, world_size=2, args=(settings,), init_megatron=False, timeout=120,
                    env={"MEGAPATCH_CHECK_TIMEOUT": "60"})
    assert "megapatch settings differ across tensor-parallel group [0, 1]" in out[0], out
    assert named in out[0], out
    assert run_ranks(_invariant_at_init, world_size=2, args=([settings[0]] * 2,), init_megatron=False,
                     timeout=120) == ["ok", "ok"]


def _reconfigure_mid_run(ctx):
    """Both ranks reduce with fp32 (the group is verified), then rank 0 switches to fp32-accumulate
    (another collective) and both reduce again: rank 0, which changed, must check the group again
    and refuse (rank 1 kept its settings and goes ahead; its collective then fails or times out)."""
    import megapatch
    from megatron.core.tensor_parallel import mappings

    megapatch.enable(tp_reduce_dtype="fp32")
    x = torch.ones(8, dtype=torch.bfloat16)
    first = _bounded(lambda: mappings.reduce_from_tensor_model_parallel_region(x.clone(), group=ctx.tp_group).tolist())
    megapatch.enable(tp_reduce_dtype="fp32-accumulate" if ctx.rank == 0 else "fp32")
    torch.distributed.barrier(group=ctx.tp_group)  # rank 0's new entry is published before either reduces
    try:
        _bounded(lambda: mappings.reduce_from_tensor_model_parallel_region(x.clone(), group=ctx.tp_group))
    except CrossRankMismatchError as exc:
        return first, f"refused: {exc}"
    except Exception as exc:  # noqa: BLE001 -- rank 1: its peer left the collective
        return first, f"failed: {type(exc).__name__}"
    return first, "reduced"


def test_a_reconfiguration_to_other_settings_is_checked_again_not_hung():
    out = run_ranks(_reconfigure_mid_run, world_size=2, tp=2, timeout=300, env={"MEGAPATCH_CHECK_TIMEOUT": NEVER})
    assert [first for first, _ in out] == [[2.0] * 8] * 2
    second = out[0][1]
    assert second.startswith("refused:"), out  # within the grace period: the check timeout is never reached
    assert "rank 1 runs tp_reduce_dtype=fp32 (this rank: fp32-accumulate)" in second, second


def test_reconfigured_forgets_verified_groups_and_arms_the_first_call_check(monkeypatch):
    from megapatch.core import cross_rank, options

    monkeypatch.setattr(cross_rank, "_checked", {(0, 1)})
    monkeypatch.setattr(cross_rank, "_checked_ids", {12345})
    monkeypatch.setattr(cross_rank, "pending", False)
    cross_rank.reconfigured(options.Settings(tp_reduce_dtype="fp32"))
    assert cross_rank._checked == set() and cross_rank._checked_ids == set() and cross_rank.pending is True
    cross_rank._checked.add((0, 1))
    cross_rank.reconfigured(options.NATIVE)
    assert cross_rank._checked == set() and cross_rank.pending is False


def test_differences_name_each_differing_option_with_both_values():
    from megapatch.core.cross_rank import _differences

    mine = "megapatch 1.0: a=x;b=y;c=z"
    assert _differences(mine, mine) == ""
    assert _differences(mine, "megapatch 1.0: a=x;b=w;c=v") == "b=w (this rank: y), c=v (this rank: z)"
    assert _differences(mine, "megapatch 2.0: a=x;b=y;c=z") == "megapatch version=2.0 (this rank: 1.0)"


def test_job_check_reads_every_rank_on_rank_0_and_rank_0_elsewhere():
    from megapatch.core.cross_rank import _job_ranks

    class Dist:
        def __init__(self, rank):
            self.rank = rank

        def get_rank(self):
            return self.rank

        def get_world_size(self):
            return 4

    assert _job_ranks(Dist(0)) == (0, 1, 2, 3)
    assert _job_ranks(Dist(2)) == (0, 2)


# -- the comparison loop itself, on a stand-in store and clock (in-process, no waiting) ----------
# The rank jobs above show the check end to end; these pin its timing contract exactly: a late
# entry is waited for up to the check timeout, a difference is re-read for the grace period (a
# peer may be reconfiguring too), and each refusal names what it saw.

class _Clock:
    """``time`` for ``cross_rank``: ``sleep`` advances ``monotonic`` instead of waiting."""

    START = 1000.0  # not zero: "now - start" and "now + start" must differ

    def __init__(self):
        self.now, self.sleeps = self.START, 0

    @property
    def elapsed(self):
        return self.now - self.START

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        assert 0 < seconds < 1, seconds  # a poll, not a wait
        self.now += seconds
        self.sleeps += 1


class _Store:
    """A c10d store whose entries change at given times of ``clock``: ``{key: [(time, value)]}``
    (value None: not published yet)."""

    def __init__(self, clock, timeline):
        self.clock, self.timeline = clock, timeline

    def _value(self, key):
        value = None
        for at, text in self.timeline.get(key, ()):
            if at <= self.clock.elapsed:
                value = text
        return value

    def check(self, keys):
        return all(self._value(k) is not None for k in keys)

    def get(self, key):
        value = self._value(key)
        assert value is not None, key  # upstream's get blocks on a missing key: check first
        return value.encode()


def _comparison(monkeypatch, timeline, *, settings=None, grace=5.0, ranks=(0, 1), me=0, world=2,
                scope="tp"):
    """Run ``cross_rank._compare`` as rank ``me`` against ``timeline`` ({rank: [(time, entry)]});
    return (clock, the refusal or None)."""
    from types import SimpleNamespace

    from megapatch.core import cross_rank, options

    settings = settings or options.Settings(tp_reduce_dtype="fp32", check_timeout=30.0)
    clock = _Clock()
    mine = cross_rank._entry(settings)
    timeline = {f"k{r}": [(0.0, mine)] if r == me else timeline.get(r, []) for r in ranks}
    store = _Store(clock, timeline)
    dist = SimpleNamespace(get_rank=lambda: me, get_world_size=lambda: world,
                           distributed_c10d=SimpleNamespace(_get_default_store=lambda: store))
    monkeypatch.setattr(cross_rank, "time", clock)
    try:
        cross_rank._compare(dist, tuple(ranks), "k{}".format, settings, grace=grace, scope=scope)
    except CrossRankMismatchError as refusal:
        return clock, str(refusal)
    return clock, None


def _entry_of(**options_):
    from megapatch.core import cross_rank, options

    return cross_rank._entry(options.Settings(**options_))


def test_the_check_returns_at_once_when_every_entry_agrees_and_waits_for_a_late_one(monkeypatch):
    agreeing = _entry_of(tp_reduce_dtype="fp32")
    clock, refusal = _comparison(monkeypatch, {1: [(0.0, agreeing)], 2: [(0.0, agreeing)]}, ranks=(0, 1, 2))
    assert refusal is None and clock.sleeps == 0
    clock, refusal = _comparison(monkeypatch, {1: [(2.0, agreeing)]})  # published 2 s late
    assert refusal is None and 2.0 <= clock.elapsed < 2.2, clock.elapsed


def test_a_rank_that_never_publishes_is_named_after_the_check_timeout_not_before(monkeypatch):
    from megapatch.core import options

    agreeing = _entry_of(tp_reduce_dtype="fp32")
    settings = options.Settings(tp_reduce_dtype="fp32", check_timeout=3.0)
    clock, refusal = _comparison(monkeypatch, {1: [(0.0, agreeing)]}, settings=settings, ranks=(0, 1, 2, 3),
                                 world=4)
    assert refusal is not None and 3.0 <= clock.elapsed < 3.2, clock.elapsed
    assert "rank(s) [2, 3] of tensor-parallel group [0, 1, 2, 3] published no megapatch settings within 3 s" \
        " (MEGAPATCH_CHECK_TIMEOUT)" in refusal, refusal
    assert "(here: tp_reduce_dtype=fp32;logits_dtype=native;" in refusal, refusal


def test_a_difference_is_refused_after_the_grace_period_or_the_timeout_whichever_is_first(monkeypatch):
    from megapatch.core import options

    native = _entry_of()
    for grace, timeout, at in ((5.0, 30.0, 5.0), (0.0, 30.0, 0.0), (5.0, 2.0, 2.0)):
        settings = options.Settings(tp_reduce_dtype="fp32", check_timeout=timeout)
        clock, refusal = _comparison(monkeypatch, {1: [(0.0, native)]}, settings=settings, grace=grace)
        assert refusal is not None and at <= clock.elapsed < at + 0.2, (grace, timeout, clock.elapsed)
        assert refusal.startswith("megapatch settings differ across tensor-parallel group [0, 1]: rank 1 runs "
                                  "tp_reduce_dtype=native (this rank: fp32) (this is rank 0). Published: "
                                  f"rank 0: {_entry_of(tp_reduce_dtype='fp32')}; rank 1: {native}."), refusal


def test_a_peer_that_comes_to_agree_within_the_grace_period_is_not_refused(monkeypatch):
    # a peer still on its earlier settings while it reconfigures, as this rank did a moment ago
    timeline = {1: [(0.0, _entry_of(tp_reduce_dtype="fp32-accumulate")), (3.0, _entry_of(tp_reduce_dtype="fp32"))]}
    clock, refusal = _comparison(monkeypatch, timeline, grace=5.0)
    assert refusal is None and 3.0 <= clock.elapsed < 3.2, (clock.elapsed, refusal)


def test_a_difference_is_named_before_a_missing_rank_and_a_switched_off_rank_by_its_kill_switch(monkeypatch):
    from megapatch.core import options

    off = f"megapatch {_entry_of().split(':')[0].split()[1]} [kill switch MEGAPATCH_DISABLE set]: " \
          f"{options.NATIVE.fingerprint()}"
    clock, refusal = _comparison(monkeypatch, {1: [(0.0, off)]}, ranks=(0, 1, 2), world=3, grace=0.0)
    assert clock.sleeps == 0 and refusal is not None  # rank 2 missing: the difference is not held back
    assert "rank 1 has megapatch switched off by the kill switch MEGAPATCH_DISABLE (this is rank 0)" in refusal
    assert "published no" not in refusal and "rank 2" not in refusal.split("Published:")[1], refusal


def test_the_job_wide_check_says_how_the_job_is_compared(monkeypatch):
    clock, refusal = _comparison(monkeypatch, {0: [(0.0, _entry_of())]}, ranks=(0, 3), me=3, world=4,
                                 grace=0.0, scope="job")
    assert refusal.startswith("megapatch settings differ across the job (world size 4; rank 0 compares "
                              "every rank, the others rank 0): rank 0 runs tp_reduce_dtype=native "
                              "(this rank: fp32) (this is rank 3)."), refusal


def test_no_check_runs_before_torch_distributed_is_initialised_or_megatron_built_its_groups(monkeypatch):
    import sys

    from megapatch.core import cross_rank, options

    assert not torch.distributed.is_initialized()
    assert cross_rank._dist() is None
    settings = options.Settings(tp_reduce_dtype="fp32")
    cross_rank.publish(settings)  # no-ops, no store to reach
    cross_rank.model_parallel_initialized(settings)
    cross_rank.ensure_group_agrees(object(), settings)
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", None)
    assert cross_rank._tp_group() is None

    class ParallelState:
        initialised = False

        def model_parallel_is_initialized(self):
            return self.initialised

        def get_tensor_model_parallel_group(self):
            raise AssertionError("tensor model parallel group is not initialized")  # as upstream does

    parallel_state = ParallelState()
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", parallel_state)
    assert cross_rank._tp_group() is None
    parallel_state.initialised = True
    assert cross_rank._tp_group() is None  # half-built or torn down: nothing to check yet
    parallel_state.get_tensor_model_parallel_group = lambda: "the group"
    assert cross_rank._tp_group() == "the group"


# -- issue 28 item 8: survivors of the sixth fresh mutation sample (seed 33) ----------------------

def test_a_wrapper_called_before_any_configuration_runs_no_settings_check():
    """The kill switch's announcing wrapper is installed without a configuration: until one asks for
    a change, a patched call checks nothing (a fresh process, so the module's own initial state)."""
    code = ("from megapatch.core import cross_rank\n"
            "from megapatch.core.wrappers import MegapatchWrapper\n"
            "checks = []\n"
            "cross_rank.check_first_call = lambda: checks.append('check')\n"
            "wrapper = MegapatchWrapper(lambda: 'upstream', lambda inner, instance, a, k: inner(*a, **k), 'announce')\n"
            "print(wrapper(), checks)\n"
            "cross_rank.pending = True\n"
            "print(wrapper(), checks)\n")
    done = run_python(code, fresh=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["upstream []", "upstream ['check']"], done.stdout  # the control: armed, it checks
