"""Issue 28 item 1: ``megapatch doctor -- <Megatron-LM flags>`` refuses exactly what the run
refuses, and the run refuses it when the model is built, never at its first step.

For each flag set of the table: the doctor's verdict (in this process, the job's MEGAPATCH_*
variables set), and the run's: the model those flags describe built with real megatron-core on
CPU ranks, megapatch switched on from the same variables, then one forward (a refusal there
would be a refusal at the first step). The flags-to-config reading is checked against
Megatron-LM's own parser in ``tests/test_megatron_lm.py``. Each row's expected verdict is
worked out by hand below (an independent oracle); one row also runs Megatron-LM's
``pretrain_gpt.py`` itself.
"""

import os
import sys
import types

import pytest

from conftest import pinned_megatron_lm
from megapatch.commands.doctor import survey
from megapatch.commands.megatron_lm_flags import config_from_flags
from megapatch.testing import run_ranks
from megapatch.testing.ranks import megatron_lm_runs as mlm

LLAMA = ("--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--no-bias-swiglu-fusion")


def _flags(tp, *, hidden=64, heads=4, vocab=255, extra=()):
    return mlm.tiny_gpt_flags(tp=tp, hidden=hidden, heads=heads, vocab=vocab, extra=extra)


#: name -> (flags, MEGAPATCH_* variables, what both must name when refused, else None)
TABLE = {
    # the three: the doctor said OK, the run refused at its first step
    "width 2 at TP 4, Llama flags, 4 query groups": (
        _flags(4, hidden=128, heads=8, extra=LLAMA + ("--group-query-attention", "--num-query-groups", "4")),
        {"MEGAPATCH_TP_INVARIANT_WIDTH": "2"},
        "the tensor-parallel size 4 (--tensor-model-parallel-size) with the width W=2"),
    "width 128, SwiGLU FFN 320 at TP 2": (  # 320 = 2.5 x 128 per gate/up half; 640 for both
        _flags(2, hidden=128, heads=8, extra=LLAMA + ("--ffn-hidden-size", "320")),
        {"MEGAPATCH_TP_INVARIANT_WIDTH": "128"},
        "ffn_hidden_size=320 (--ffn-hidden-size), the size of each of the SwiGLU fc1's gate and up halves"),
    "vocab 513, divisible by 2, TP 2": (  # 513 + 1 EOD = 514, padded to a multiple of 2 x 2: 516 = 4 x 129
        _flags(2, vocab=513, extra=("--make-vocab-size-divisible-by", "2")), {}, "516"),
    # refused from a config field, for comparison
    "GELU with Megatron-LM's fused bias-GELU, TP 2": (
        [f for f in _flags(2) if f != "--no-bias-gelu-fusion"], {},
        "bias_activation_fusion=True (Megatron-LM: on by default; --no-bias-gelu-fusion)"),
    # accepted
    "Llama flags, 4 query groups, TP 4": (
        _flags(4, hidden=128, heads=8, extra=LLAMA + ("--group-query-attention", "--num-query-groups", "4")), {}, None),
    "width 16, SwiGLU FFN 320 at TP 2": (  # 320 = 20 x 16
        _flags(2, hidden=128, heads=8, extra=LLAMA + ("--ffn-hidden-size", "320")),
        {"MEGAPATCH_TP_INVARIANT_WIDTH": "16"}, None),
    "vocab 513 at TP 2, the default padding": (_flags(2, vocab=513), {}, None),  # 514 -> 768 = 3 x 256
    "width 2 at TP 2": (_flags(2), {"MEGAPATCH_TP_INVARIANT_WIDTH": "2"}, None),
    # issue 48 item 3: accepted, with one line saying that core attention runs as the mode's
    "--attention-backend flash at TP 2": (_flags(2, extra=("--attention-backend", "flash")), {}, None),
}


def _doctor(monkeypatch, flags, env):
    """The doctor's survey of ``flags`` in this process under the job's variables (megatron.core
    imported first, so that the unobservable activation from the environment is no finding)."""
    import megatron.core  # noqa: F401

    monkeypatch.setenv("MEGAPATCH_TP_INVARIANT", "1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return survey(list(flags))


def _model(ctx, config_fields):
    from megapatch.testing import build_tiny_gpt, tiny_gpt_config
    from megapatch.testing.models.tiny_gpt import llama_config

    from megatron.core.transformer.enums import AttnBackend

    c = config_fields
    fields = dict(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads,
                  ffn_hidden_size=c.ffn_hidden_size, kv_channels=c.kv_channels,
                  bias_activation_fusion=c.bias_activation_fusion, attention_backend=AttnBackend[c.attention_backend])
    if c.gated_linear_unit:
        config = llama_config(ctx.tp_size, num_query_groups=c.num_query_groups or c.num_attention_heads, **fields)
        return build_tiny_gpt(config, vocab_size=c.padded_vocab_size, seq_len=c.seq_length,
                              position_embedding_type="rope")
    return build_tiny_gpt(tiny_gpt_config(ctx.tp_size, **fields), vocab_size=c.padded_vocab_size,
                          seq_len=c.seq_length)


def _run_side(ctx, flags, env):
    """(when, message): refused at "construction", at the first "forward", or (None, None)."""
    import megapatch
    from megapatch.core.errors import MegapatchError
    from megapatch.testing import make_batch, reinit_model_parallel

    config = config_from_flags(flags)
    for name in ("MEGAPATCH_TP_INVARIANT_WIDTH",):
        os.environ.pop(name, None)
    os.environ.update({"MEGAPATCH_TP_INVARIANT": "1", **env})
    megapatch.disable()
    megapatch.enable()  # from the environment, as in the job: the messages name the variables
    ctx = reinit_model_parallel(ctx, tp=config.tensor_model_parallel_size)
    try:
        model = _model(ctx, config)
    except MegapatchError as exc:
        return "construction", str(exc)
    batch = make_batch(seed=1, batch=1, seq_len=config.seq_length, vocab=config.vocab_size)
    try:
        model(batch.tokens, batch.position_ids, batch.attention_mask, labels=batch.labels)
    except MegapatchError as exc:
        return "forward", str(exc)
    return None, None


def _job(ctx):
    """Each row's verdict; and, under ``"logged"``, the megapatch lines rank 0 logged while building
    each model (for the attention-backend row, the job's ``--seq-length`` as Megatron-LM's arguments
    give it: a STAND-IN for ``megatron.training.global_vars``, as in the tests below)."""
    import logging

    from megapatch.core import report

    logged, lines = {}, []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megapatch").addHandler(handler)
    out = {}
    for name, (flags, env, _) in TABLE.items():
        report._said.discard("tp_invariant:attention_backend")  # once per job: each row is a job here
        for variable in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):  # GPTModel sets them per job
            os.environ.pop(variable, None)
        chosen = "--attention-backend" in flags
        if chosen:
            sys.modules["megatron.training.global_vars"] = types.SimpleNamespace(
                _GLOBAL_ARGS=types.SimpleNamespace(seq_length=config_from_flags(flags).seq_length))
        del lines[:]
        try:
            out[name] = _run_side(ctx, flags, env)
        finally:
            if chosen:
                del sys.modules["megatron.training.global_vars"]
        logged[name] = list(lines)
    out["logged"] = logged
    return out if ctx.rank == 0 else None


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_job, world_size=4, tp=1, timeout=600)[0]


def test_a_chosen_attention_backend_is_logged_by_the_run_as_the_doctor_says_it(runs, monkeypatch):
    """Issue 48 item 3: ``--attention-backend flash`` was replaced by the mode's attention without a
    word; now the job logs one line as its model is built, the doctor's line, and no other row does."""
    name = "--attention-backend flash at TP 2"
    flags, env, _ = TABLE[name]
    note = _doctor(monkeypatch, flags, env)["flags"]["notes"]["tp_invariant.construction"]
    assert "--seq-length 32" in note, note
    assert runs["logged"][name].count(note) == 1, (runs["logged"][name], note)
    for other, lines in runs["logged"].items():
        assert other == name or not any("--attention-backend" in line for line in lines), (other, lines)


def _said(message: str) -> str:
    """A construction refusal's ``does not support <what>: <why>``, as the doctor lists it."""
    return message.split("megapatch tp_invariant=True ", 1)[-1].split(". tp_invariant was set by ", 1)[0]


@pytest.mark.parametrize("name", list(TABLE))
def test_the_doctor_refuses_what_the_run_refuses_at_construction(runs, monkeypatch, name):
    flags, env, cause = TABLE[name]
    doctor = _doctor(monkeypatch, flags, env)
    when, message = runs[name]
    refusals = doctor["flags"]["refusals"]
    assert when != "forward", f"refused only at the first step: {message}"
    if cause is None:
        assert (when, refusals, doctor["result"]["code"]) == (None, {}, 0), (message, refusals)
        return
    assert when == "construction" and doctor["result"]["code"] == 1, (when, doctor["result"])
    listed = "; ".join(refusals.values())
    assert cause in message and cause in listed, (cause, message, listed)
    if message.startswith("megapatch tp_invariant=True does not support"):  # the same words
        assert _said(message) in listed, (message, listed)


# -- Megatron-LM's own pretrain_gpt.py -----------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    return pinned_megatron_lm(tmp_path_factory)


def test_pretrain_gpt_refuses_the_padded_vocabulary_at_construction_in_the_doctors_words(megatron_lm, monkeypatch):
    """`--vocab-size 513 --make-vocab-size-divisible-by 2` at TP 2: Megatron-LM pads to 516, which
    the width 8 does not divide. The job stops while building the model (it never prints its
    parameter count, let alone a loss), with the doctor's sentence naming the flags."""
    flags, env, _ = TABLE["vocab 513, divisible by 2, TP 2"]
    run = mlm.launch(megatron_lm, flags, nproc=2, megapatch_env={"MEGAPATCH_TP_INVARIANT": "1"}, timeout=300)
    assert run.returncode != 0 and not run.losses, run.tail()
    assert "building GPT model" in run.log and "number of parameters" not in run.log, run.tail()
    [listed] = _doctor(monkeypatch, flags, env)["flags"]["refusals"].values()
    said = ("does not support the padded vocabulary of 516 entries: Megatron-LM pads --vocab-size 513 + 1 EOD "
            "token (NullTokenizer) up to a multiple of --make-vocab-size-divisible-by 2 x TP 2 = 4")
    assert said in listed, listed
    lines = [line for line in run.log.splitlines() if "megapatch: UnsupportedConfigurationError" in line
             and "full message" not in line]  # rank 0's whole message; rank 1 names it in short
    assert len(lines) == 1, run.tail()
    assert _said(lines[0]) in listed and said in lines[0], (lines[0], listed)


# -- what the doctor lists from the flags, the run says before upstream does, in the same words ------

SP_SEQUENCE_36 = mlm.tiny_gpt_flags(tp=2, seq=36, vocab=255, sequence_parallel=True)  # 36 = 4.5 x 8
TE_WITHOUT_TE = mlm.tiny_gpt_flags(tp=2, vocab=255, extra=("--transformer-impl", "transformer_engine"))
UPSTREAM_NAME_ERROR = "NameError: name 'TESpecProvider' is not defined"  # core_v0.16.1's gpt_layer_specs


def _te_importable() -> bool:
    import megatron.core.models.gpt.gpt_layer_specs as specs

    return getattr(specs, "TESpecProvider", None) is not None


def _megatron_lm_args(monkeypatch, **args):
    """STAND-IN for a Megatron-LM job's parsed arguments (``initialize_megatron`` sets them in
    ``megatron.training.global_vars``, which the pip megatron-core does not ship)."""
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars",
                        types.SimpleNamespace(_GLOBAL_ARGS=types.SimpleNamespace(**args)))


@pytest.mark.quick("cross_rank.publish_settings")
def test_transformer_engine_missing_stops_the_run_in_the_doctors_words_only_where_megapatch_is_active(monkeypatch):
    """``--transformer-impl transformer_engine`` without TE: megapatch, where active, stops the job
    once model parallelism is set up (before any model is built, so before upstream's NameError),
    saying what the doctor says; megapatch native or off, or a job that builds no TE spec, is
    left to upstream."""
    from megapatch.commands.upstream_stops import _upstream_stops
    from megapatch.core import state
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.core.options import Settings
    from megapatch.patches.cross_rank import publish_settings as patch

    if _te_importable():
        pytest.skip("Transformer Engine is importable here")
    built = []

    def initialize_model_parallel():
        built.append(True)
        return "groups"

    _megatron_lm_args(monkeypatch, transformer_impl="transformer_engine", spec=None, use_legacy_models=False)
    assert patch._initialize_model_parallel(initialize_model_parallel, None, (), {}) == "groups"  # native
    before = state.current(), state.sources()
    state.set_current(Settings(logits_dtype="fp32"), {"logits_dtype": "env MEGAPATCH_LOGITS_DTYPE"})
    try:
        with pytest.raises(UnsupportedConfigurationError) as caught:
            patch._initialize_model_parallel(initialize_model_parallel, None, (), {})
        assert len(built) == 2  # the groups were built (and the settings published) first
        said = str(caught.value)
        [doctor] = _upstream_stops(types.SimpleNamespace(transformer_impl="transformer_engine"))
        for words in ("Transformer Engine is not installed", "--transformer-impl transformer_engine (Megatron-LM's "
                      "default) needs it", "while building its layer specification (upstream raises NameError: "
                      "TESpecProvider)", "Pass --transformer-impl local, or install transformer-engine"):
            assert words in said and words in doctor, (words, said, doctor)
        assert "before any model is built" in said, said
        # jobs that build no Transformer Engine spec from --transformer-impl
        for other in (dict(transformer_impl="local"), dict(spec="my_specs.local_spec"), dict(use_legacy_models=True)):
            _megatron_lm_args(monkeypatch, **{"transformer_impl": "transformer_engine", **other})
            assert patch._initialize_model_parallel(initialize_model_parallel, None, (), {}) == "groups", other
        # outside a Megatron-LM job (megatron-core alone): no arguments to read, nothing refused
        monkeypatch.delitem(sys.modules, "megatron.training.global_vars")
        assert patch._initialize_model_parallel(initialize_model_parallel, None, (), {}) == "groups"
    finally:
        state.set_current(*before)


@pytest.mark.quick("tp_invariant.construction")
def test_a_megatron_lm_sequence_w_does_not_divide_is_refused_at_construction_with_sequence_parallelism(monkeypatch):
    """megatron-core's TransformerConfig has no sequence length; in a Megatron-LM job the block reads
    ``--seq-length`` from the job's arguments and refuses it as the doctor does from the flags."""
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.commands.megatron_lm_flags import config_from_flags
    from megapatch.patches.tp_invariant import construction
    from megapatch.testing import tiny_gpt_config

    listed = construction._preflight_model(config_from_flags(SP_SEQUENCE_36))
    config = tiny_gpt_config(2, sequence_parallel=True, hidden_size=64, num_attention_heads=4,
                             bias_activation_fusion=False)
    assert not hasattr(config, "seq_length")
    construction._check_config(config)  # no Megatron-LM job: the sequence is unknown until a batch comes
    _megatron_lm_args(monkeypatch, seq_length=36, padded_vocab_size=256)
    with pytest.raises(UnsupportedConfigurationError) as caught:
        construction._check_config(config)
    said = _said(str(caught.value))
    assert said.startswith("does not support the sequence length 36 (--seq-length) with --sequence-parallel at "
                           "TP 2") and said in listed, (said, listed)
    _megatron_lm_args(monkeypatch, seq_length=40, padded_vocab_size=256)  # 40 = 5 x 8
    construction._check_config(config)
    _megatron_lm_args(monkeypatch, seq_length=36, padded_vocab_size=256)
    config.sequence_parallel = False  # the sequence is not split: nothing to refuse
    construction._check_config(config)
    config.sequence_parallel, config.variable_seq_lengths = True, True  # batches vary: the first step tells
    construction._check_config(config)


@pytest.mark.parametrize("name", ["sequence 36 with --sequence-parallel at TP 2",
                                  "--transformer-impl transformer_engine without TE"])
def test_pretrain_gpt_stops_before_its_model_is_built_in_the_doctors_words(megatron_lm, monkeypatch, name):
    flags = {"sequence 36 with --sequence-parallel at TP 2": SP_SEQUENCE_36,
             "--transformer-impl transformer_engine without TE": TE_WITHOUT_TE}[name]
    te = name.startswith("--transformer-impl")
    if te and _te_importable():
        pytest.skip("Transformer Engine is importable here")
    run = mlm.launch(megatron_lm, flags, nproc=2, megapatch_env={"MEGAPATCH_TP_INVARIANT": "1"}, timeout=300)
    assert run.returncode != 0 and not run.losses, run.tail()
    assert "number of parameters" not in run.log and UPSTREAM_NAME_ERROR not in run.log, run.tail()
    assert ("building GPT model" in run.log) != te, run.tail()  # TE: stopped before the model is built
    doctor = _doctor(monkeypatch, flags, {})["flags"]
    lines = [line for line in run.log.splitlines() if "megapatch: UnsupportedConfigurationError" in line
             and "full message" not in line]  # rank 0's whole message; rank 1 names it in short
    assert len(lines) == 1, run.tail()
    if te:
        [stop] = doctor["stops"]
        for words in ("Transformer Engine is not installed", "--transformer-impl transformer_engine (Megatron-LM's "
                      "default) needs it", "Pass --transformer-impl local, or install transformer-engine"):
            assert words in lines[0] and words in stop, (words, lines[0], stop)
        return
    [listed] = doctor["refusals"].values()
    assert "the sequence length 36 (--seq-length) with --sequence-parallel at TP 2" in lines[0], lines[0]
    assert _said(lines[0]) in listed, (lines[0], listed)


def test_transformer_engine_counts_as_missing_where_megatron_cores_layer_specs_could_not_import_it(monkeypatch):
    """Where megatron-core's GPT layer specs are loaded, their own record decides (a TE installed but
    failing to import leaves ``TESpecProvider`` undefined on core_v0.16.1, None on main); before,
    whether a ``transformer_engine`` package is found. The cause says which of the two it is."""
    import importlib.util

    from megapatch.patches.cross_rank import publish_settings as patch

    te = dict(transformer_impl="transformer_engine", spec=None, use_legacy_models=False)
    found = {"transformer_engine": None}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: found.get(name, "elsewhere"))
    monkeypatch.delitem(sys.modules, patch.GPT_LAYER_SPECS, raising=False)
    assert patch.transformer_engine_missing(types.SimpleNamespace(**te)) == "Transformer Engine is not installed"
    found["transformer_engine"] = "a spec"
    assert patch.transformer_engine_missing(types.SimpleNamespace(**te)) is None
    for specs in (types.SimpleNamespace(), types.SimpleNamespace(TESpecProvider=None)):
        monkeypatch.setitem(sys.modules, patch.GPT_LAYER_SPECS, specs)
        assert patch.transformer_engine_missing(types.SimpleNamespace(**te)) == (
            "Transformer Engine is installed, but megatron-core cannot import it")
        stop = patch.transformer_engine_stop(types.SimpleNamespace(**te))
        assert stop.startswith("Transformer Engine is installed, but megatron-core cannot import it, and "
                               "--transformer-impl transformer_engine (Megatron-LM's default) needs it"), stop
    monkeypatch.setitem(sys.modules, patch.GPT_LAYER_SPECS, types.SimpleNamespace(TESpecProvider=object))
    found["transformer_engine"] = None  # the specs' record wins over the package search
    assert patch.transformer_engine_missing(types.SimpleNamespace(**te)) is None
    assert patch.transformer_engine_stop(types.SimpleNamespace(**te)) is None
    monkeypatch.setitem(sys.modules, patch.GPT_LAYER_SPECS, types.SimpleNamespace(TESpecProvider=None))
    for other in (dict(transformer_impl="local"), dict(spec=("my_specs", "layer_spec")), dict(use_legacy_models=True),
                  dict(transformer_impl=None)):
        assert patch.transformer_engine_missing(types.SimpleNamespace(**{**te, **other})) is None, other
    assert patch.transformer_engine_missing(types.SimpleNamespace()) is None  # megatron-core alone: no flags
