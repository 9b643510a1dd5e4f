"""``tp_invariant`` arithmetic and wrappers against independent oracles, on planted values (the
mutation audit's survivors, results/mutation.md).

The 8-rank job of tests/test_tp_invariant.py compares every TP size with TP=1, so a bug that
changes TP=1 the same way (a block that skips its last row, a wrong tree at the top) stays
invisible there. These tests compare the block arithmetic with a tree written here
(``_tree``: halves, recursively) over block sums that are exact, on values whose FP32 sum depends
on the association (+-2^24 with small integers), placed so every row and block position matters.
The sequence-parallel and distributed-optimizer code (token-split sums, the sequence slices, the
grad buffers) gets the same treatment at TP=1, with stand-in groups that carry a rank.
One 4-rank job runs TP=2 with two data-parallel replicas holding different values (a sum over the
wrong group is caught) and sizes that TP does not divide.
"""

import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from conftest import StandInGroup
from reduction_oracles import BIG, planted, signs
from megapatch.testing import run_ranks

W = 8
def _tree(parts):
    """Independent oracle of the fixed tree: the sum of the first half plus that of the second."""
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    half = len(parts) // 2
    return _tree(parts[:half]) + _tree(parts[half:])


def _small(shape, seed):
    """Small integers (exact sums in any order), position-dependent."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=generator).float()


def _norm_grad(dim):
    """A [16, 3] (dim 0) or [3, 16] (dim 1) gradient: 8 blocks of 2 along ``dim``. Block sums of
    squares are exact, but their FP32 total depends on the association: block 0 squares to 2^24,
    block 1 to 1 (lost against 2^24 alone), blocks 2 and 3 to 1 each (kept when added first). The
    non-zero values sit in each block's last row, and block 4 also has one in its first row."""
    g = torch.zeros(16, 3)
    g[1, 0] = 4096.0     # block 0, last row: 2^24
    g[3, 2] = 1.0        # block 1, last row
    g[5, 1] = -1.0       # block 2, last row
    g[7, 0] = 1.0        # block 3, last row
    g[8, 1] = 2.0        # block 4, first row
    g[11, 2] = 3.0       # block 5, last row
    g[15, 0] = -2.0      # block 7, last row
    return g if dim == 0 else g.t().contiguous()


def _norm_oracle(full, dim):
    blocks = full.split(2, dim=dim)
    sums = [torch.tensor(float(sum(v * v for v in b.flatten().tolist())), dtype=torch.float32) for b in blocks]
    return _tree(sums)


@pytest.fixture
def invariant(monkeypatch):
    from megapatch.core import options, state

    monkeypatch.setattr(state, "_current", options.Settings(tp_invariant=True, tp_invariant_width=W))
    monkeypatch.setattr(state, "_sources", {"tp_invariant": "enable()", "tp_invariant_width": "enable()"})


# -- block arithmetic at TP=1 (no ranks) --------------------------------------------------------

def test_squared_norms_are_the_fixed_tree_of_every_rows_block_sums(invariant):
    from megapatch.numerics.block_tree import squared_norms

    replicated = _small((5, 3), 9)
    got = squared_norms([_norm_grad(0), replicated, _norm_grad(1)], [0, None, 1], None)
    want = torch.stack([_norm_oracle(_norm_grad(0), 0), (replicated * replicated).sum(),
                        _norm_oracle(_norm_grad(1), 1)])
    assert got.dtype == torch.float32 and torch.equal(got, want), (got.tolist(), want.tolist())
    # the planted values make the association visible: adding the blocks in order loses the ones
    assert _norm_oracle(_norm_grad(0), 0) == BIG + 4 + 16
    assert sum(torch.tensor(float(v)) for v in (BIG, 1, 1, 1, 4, 9, 0, 4)) != BIG + 4 + 16


def test_column_parallel_blocks_match_the_oracle(invariant):
    """Forward: one GEMM per block of output features (+ bias), rounded once; dgrad: the tree of
    the blocks' [M, N/W] x [N/W, K] partials; wgrad and bias grad per block."""
    from megapatch.numerics.block_linear import ColumnParallel

    x = _small((3, 2, 4), 1).bfloat16().requires_grad_()
    weight = _small((16, 4), 2).bfloat16().requires_grad_()  # small: the forward sums are exact
    bias = _small((16,), 3).bfloat16().requires_grad_()
    out = ColumnParallel.apply(x, weight, bias, None, False, W, None, 1)
    want = x.detach().float() @ weight.detach().float().t() + bias.detach().float()
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())
    grad = _small((3, 2, 16), 4)
    out.backward(grad.bfloat16())
    g2, x2 = grad.reshape(-1, 16), x.detach().float().reshape(-1, 4)
    assert torch.equal(weight.grad, (g2.t() @ x2).bfloat16())
    assert torch.equal(bias.grad, g2.sum(0).bfloat16())
    # dgrad on planted weights, where the association shows (an FP32 input: an FP32 dgrad)
    x = torch.ones(3, 2, 4, dtype=torch.float32, requires_grad=True)
    weights = planted((16, 4), 5).bfloat16()
    grad = signs((3, 2, 16), 6)
    ColumnParallel.apply(x, weights, None, None, False, W, None, 1).backward(grad.bfloat16())
    products = grad[..., :, None] * weights.float()[None, None]  # [3, 2, N, K]
    dgrad = _tree([products[..., 2 * b, :] + products[..., 2 * b + 1, :] for b in range(W)])
    assert torch.equal(x.grad, dgrad), "dgrad is not the fixed tree of the 8 blocks"
    assert not torch.equal(dgrad, products.sum(-2))
    x, weight = x.detach(), weight.detach()
    fp32 = ColumnParallel.apply(x.detach(), weight.detach(), None, None, False, W, torch.float32, 1)
    assert fp32.dtype == torch.float32 and torch.equal(fp32, x.detach().float() @ weight.detach().float().t())


def test_gated_column_parallel_pairs_gate_and_up_rows_in_the_tree(invariant):
    """halves=2 (SwiGLU fc1 [gate; up]): the tree's leaves are gate row b then up row b."""
    from megapatch.numerics.block_linear import ColumnParallel

    x = torch.tensor([[1.0, 0, 0, 0], [0, 0, 1, 0]], requires_grad=True)  # FP32: an FP32 dgrad
    weight = planted((16, 4), 7).bfloat16()
    out = ColumnParallel.apply(x, weight, None, None, False, W, None, 2)  # one product per output
    assert torch.equal(out, x.detach() @ weight.float().t())
    grad = signs((2, 16), 8)
    out.backward(grad)
    leaves = [grad[:, r, None] * weight.float()[r] for b in range(W) for r in (b, W + b)]
    assert torch.equal(x.grad, _tree(leaves))
    assert not torch.equal(_tree(leaves), _tree([grad[:, r, None] * weight.float()[r] for r in range(16)]))


def test_row_parallel_forward_is_the_fixed_tree_and_its_grads_are_per_block(invariant):
    from megapatch.numerics.block_linear import RowParallel

    x = signs((3, 2, 16), 11).requires_grad_()  # [S, B, K]; FP32: the tree's result unrounded
    weight = planted((2, 16), 12).bfloat16().requires_grad_()
    out = RowParallel.apply(x, weight, None, W)
    products = x.detach()[..., None, :] * weight.detach().float()[None, None]  # [S, B, N, K]
    want = _tree([products[..., 2 * b] + products[..., 2 * b + 1] for b in range(W)])
    assert torch.equal(out, want)
    assert not torch.equal(want, products.sum(-1))  # the association matters on these values
    grad = _small((3, 2, 2), 13)
    out.backward(grad)
    assert torch.equal(x.grad, grad @ weight.detach().float())
    assert torch.equal(weight.grad, (grad.reshape(-1, 2).t() @ x.detach().reshape(-1, 16)).bfloat16())


def test_sum_exp_partials_are_per_block_fp32_sums(invariant):
    from megapatch.numerics.block_tree import invariant_sum, sum_exp_partials

    e = _small((2, 3, 16), 14).abs().bfloat16()
    parts = sum_exp_partials(e, W)
    assert len(parts) == W
    for b, part in enumerate(parts):
        assert part.dtype == torch.float32 and torch.equal(part, e.float().reshape(6, 16)[:, 2 * b:2 * b + 2].sum(-1))
    values = [torch.tensor([v]) for v in (BIG, 1.0, 1.0, 1.0, -BIG, 3.0, 1.0, 1.0)]
    assert torch.equal(invariant_sum(values, None, torch.bfloat16), _tree(values).bfloat16())
    assert invariant_sum(values, None, torch.bfloat16).dtype == torch.bfloat16


# -- the patch's own decisions (no ranks) --------------------------------------------------------

def _config(**overrides):
    fields = dict(qk_layernorm=False, gradient_accumulation_fusion=False, bias_activation_fusion=False,
                  use_te_activation_func=False, defer_embedding_wgrad_compute=False, num_moe_experts=None,
                  cross_entropy_loss_fusion=False,
                  tensor_model_parallel_size=2, num_query_groups=None, num_attention_heads=4,
                  transformer_impl="local", gated_linear_unit=False)
    return SimpleNamespace(**{**fields, **overrides})


@pytest.mark.parametrize("field,value,flag", [
    ("gradient_accumulation_fusion", True, "--no-gradient-accumulation-fusion"),
    ("bias_activation_fusion", True, "--no-bias-gelu-fusion"),  # a GELU model: its flag only
    ("use_te_activation_func", True, "--use-te-activation-func"),
    ("defer_embedding_wgrad_compute", True, "--defer-embedding-wgrad-compute"),
    ("num_query_groups", 1, "--num-query-groups"),
    ("cross_entropy_loss_fusion", True, "--cross-entropy-loss-fusion"),
])
@pytest.mark.quick("tp_invariant.construction")
def test_each_uncovered_config_field_is_refused_alone(invariant, field, value, flag):
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import _refusal_tables, construction

    assert _refusal_tables.config_refusals(_config()) == [] and construction._preflight_model(_config()) is None
    refusals = _refusal_tables.config_refusals(_config(**{field: value}))
    assert len(refusals) == 1 and field in refusals[0][0] and flag in refusals[0][0], refusals
    with pytest.raises(UnsupportedConfigurationError, match=f"does not support {field}"):
        construction._check_config(_config(**{field: value}))
    assert flag in construction._preflight_model(_config(**{field: value}))


@pytest.mark.quick("tp_invariant.construction")
def test_expert_layers_are_covered_and_their_uncovered_fields_refused_only_with_experts(invariant):
    """Issue 26: a MoE model (expert TP = TP) is accepted; its uncovered settings are refused with
    the flag, and the same settings on a dense model are not."""
    from megapatch.patches.tp_invariant import _refusal_tables

    moe = dict(num_moe_experts=8, moe_ffn_hidden_size=32, expert_tensor_parallel_size=2, add_bias_linear=False,
               moe_token_dispatcher_type="allgather")  # expert parallelism is covered with alltoall only
    assert _refusal_tables.config_refusals(_config(**moe)) == []
    for field, value, flag in (("expert_model_parallel_size", 2, "--expert-model-parallel-size"),
                               ("moe_token_dispatcher_type", "flex", "--moe-token-dispatcher-type"),
                               ("expert_tensor_parallel_size", 1, "--expert-tensor-parallel-size"),
                               ("add_bias_linear", True, "--disable-bias-linear"),
                               ("moe_ffn_hidden_size", 36, "--moe-ffn-hidden-size")):
        refusals = _refusal_tables.config_refusals(_config(**{**moe, field: value}))
        assert len(refusals) == 1 and flag in refusals[0][0], (field, refusals)
        assert _refusal_tables.config_refusals(_config(**{field: value})) == [], field
    assert _refusal_tables.config_refusals(_config(**{**moe, "expert_model_parallel_size": 2,
                                             "moe_token_dispatcher_type": "alltoall"})) == []


@pytest.mark.quick("tp_invariant.construction")
def test_qk_layernorm_is_accepted_where_the_width_cuts_its_heads_and_refused_naming_the_count(invariant):
    """QK norm gradients sum over heads as W leaves: W must divide the head (and KV group) count or
    be a multiple of it (W = 8 here)."""
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import _refusal_tables, construction

    for heads, groups in ((4, None), (16, 8), (16, 2), (8, 4)):
        config = _config(qk_layernorm=True, num_attention_heads=heads, num_query_groups=groups)
        assert _refusal_tables.config_refusals(config) == [], (heads, groups)
    for heads, groups, flag in ((12, 4, "--num-attention-heads"), (16, 6, "--num-query-groups")):
        config = _config(qk_layernorm=True, num_attention_heads=heads, num_query_groups=groups)
        [(what, why)] = _refusal_tables.config_refusals(config)
        assert flag in what and "--qk-layernorm" in what and "W=8" in why, (what, why)
        with pytest.raises(UnsupportedConfigurationError, match=flag):
            construction._check_config(config)
        assert flag in construction._preflight_model(config)


def test_kv_groups_equal_to_the_tp_size_and_heads_as_groups_are_accepted(invariant):
    from megapatch.patches.tp_invariant import _refusal_tables, construction, distributed_optimizer

    assert _refusal_tables.config_refusals(_config(num_query_groups=2, tensor_model_parallel_size=2)) == []
    assert _refusal_tables.config_refusals(_config(num_attention_heads=2, tensor_model_parallel_size=2)) == []
    assert _refusal_tables.config_refusals(_config(num_attention_heads=1, tensor_model_parallel_size=2))
    assert construction._preflight_model(_config(transformer_impl="transformer_engine")) is None  # covered below
    from megapatch.patches.tp_invariant import transformer_engine as te

    assert te._preflight(_config(transformer_impl="transformer_engine")) is None
    assert te._preflight(_config(transformer_impl="local", fp8="hybrid")) is None  # no TE layers to refuse
    # TE experts, sequential or grouped GEMM, are covered
    assert te._preflight(_config(transformer_impl="transformer_engine", num_moe_experts=8,
                                 moe_grouped_gemm=True)) is None
    for field, flag in (("fp8", "--fp8-format"), ("fp4", "--fp4-format"), ("tp_comm_overlap", "--tp-comm-overlap"),
                        ("delay_wgrad_compute", "--delay-wgrad-compute")):
        value = "e4m3" if field in ("fp8", "fp4") else True
        assert flag in te._preflight(_config(transformer_impl="transformer_engine", **{field: value})), field
    assert distributed_optimizer._preflight_optimizer(SimpleNamespace(use_distributed_optimizer=False)) is None
    assert distributed_optimizer._preflight_optimizer(SimpleNamespace(use_distributed_optimizer=True)) is None  # covered
    assert "--num-distributed-optimizer-instances" in distributed_optimizer._preflight_optimizer(
        SimpleNamespace(use_distributed_optimizer=True, num_distributed_optimizer_instances=2))


class _Recorder:
    def __init__(self):
        self.marked = "unset"

    def __call__(self, *args, **kwargs):
        from megapatch.patches.tp_invariant import _marks

        self.marked = _marks.gated_fc1.get()
        return "upstream"


class _Layer:
    pass


def _mlp(**config):
    return SimpleNamespace(config=_config(**config), linear_fc1=_Layer(), linear_fc2=_Layer())


@pytest.mark.quick("tp_invariant.mlp")
def test_the_mlp_marks_only_a_gated_fc1_and_refuses_what_it_cannot_cover(invariant):
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import _marks, mlp

    for gated in (True, False):
        layer, upstream = _mlp(gated_linear_unit=gated), _Recorder()
        assert mlp._mlp_forward(upstream, layer, (), {}) == "upstream"
        assert upstream.marked is (layer.linear_fc1 if gated else None), gated
    assert _marks.gated_fc1.get() is None  # the mark ends with the call
    for field in ("use_te_activation_func", "bias_activation_fusion"):
        with pytest.raises(UnsupportedConfigurationError, match=field):
            mlp._mlp_forward(_Recorder(), _mlp(**{field: True}), (), {})



def test_the_block_runs_the_covered_te_modules_and_refuses_the_rest_by_name(invariant):
    """Built under the mode, a block's TE modules are either covered (tp_invariant.transformer_engine
    runs them; megatron-core's wrappers and TE's norms) or refused naming the module and its place."""
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import construction

    def module(name, where):
        return type(name, (), {"__module__": where})()

    wrappers = "megatron.core.extensions.transformer_engine"
    for name in ("TELayerNormColumnParallelLinear", "TEColumnParallelLinear", "TERowParallelLinear",
                 "TEDotProductAttention"):
        assert construction._transformer_engine(module(name, wrappers), "decoder.layers.0.x") is True
    assert construction._transformer_engine(module("RMSNorm", "transformer_engine.pytorch.module.rmsnorm"), "final") is True
    assert construction._transformer_engine(module("RowParallelLinear", "megatron.core.tensor_parallel.layers"), "x") is False
    for name, where in (("TEGroupedLinear", wrappers), ("Linear", "transformer_engine.pytorch.module.linear"),
                        ("LayerNormMLP", "transformer_engine.pytorch.module.layernorm_mlp")):
        with pytest.raises(UnsupportedConfigurationError, match=f"{name} \\(decoder.layers.1.mlp\\)"):
            construction._transformer_engine(module(name, where), "decoder.layers.1.mlp")


def _column_call(group_size, **kw):
    from megapatch.patches.tp_invariant import _linear_layers

    args = dict(input=_small((3, 4), 21).bfloat16(), weight=_small((16, 4), 22).bfloat16(), bias=None,
                gradient_accumulation_fusion=False, allreduce_dgrad=group_size > 1, sequence_parallel=False,
                grad_output_buffer=None)
    instance = SimpleNamespace(tp_group=StandInGroup(group_size), config=SimpleNamespace(num_query_groups=None))
    for key in list(kw):
        if key in args:
            args[key] = kw.pop(key)
    for key, value in kw.items():
        setattr(instance, key, value)
    return _linear_layers.column_forward_impl(lambda *a, **k: "upstream", instance, (), args)


@pytest.mark.parametrize("setting,what", [
    (dict(gradient_accumulation_fusion=True), "gradient_accumulation_fusion"),
    (dict(grad_output_buffer=[]), "defer_embedding_wgrad_compute"),
    (dict(config=SimpleNamespace(num_query_groups=1)), "num_query_groups=1"),
    (dict(allreduce_dgrad=False, input=_small((3, 4), 21).bfloat16().requires_grad_()), "reduced outside it"),
])
def test_column_layers_refuse_what_the_mode_cannot_cover(invariant, setting, what):
    from megapatch.core.errors import UnsupportedConfigurationError

    assert _column_call(2) is not None  # the same call without the setting goes through
    with pytest.raises(UnsupportedConfigurationError, match=what):
        _column_call(2, **setting)


def test_a_column_layer_whose_dgrad_is_reduced_elsewhere_runs_where_no_gradient_is_taken(invariant):
    """Megatron RL's rollouts run the trainer's model with sequence parallelism switched off: its
    output layer then arrives with neither SP nor its dgrad all-reduce. Without a gradient (no_grad,
    or an input that needs none) there is no dgrad to reduce, so the mode does not refuse it."""
    from megapatch.core.errors import UnsupportedConfigurationError

    needs_grad = _small((3, 4), 21).bfloat16().requires_grad_()
    assert _column_call(2, allreduce_dgrad=False) is not None
    with torch.no_grad():
        assert _column_call(2, allreduce_dgrad=False, input=needs_grad) is not None
    with pytest.raises(UnsupportedConfigurationError, match="reduced outside it"):
        _column_call(2, allreduce_dgrad=False, input=needs_grad)


@pytest.mark.parametrize("positional,what", [
    ((True,), "gradient_accumulation_fusion"),
    ((False, False, False, []), "defer_embedding_wgrad_compute"),
])
def test_column_refusals_read_positional_arguments_at_upstreams_positions(invariant, positional, what):
    """``_forward_impl(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
    sequence_parallel, grad_output_buffer, ...)``, as linear_with_grad_accumulation_and_async_allreduce
    takes them (megatron-core passes keywords; a positional caller must be read the same)."""
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import _linear_layers

    instance = SimpleNamespace(tp_group=StandInGroup(1), config=SimpleNamespace(num_query_groups=None))
    args = (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(16, 4, dtype=torch.bfloat16), None)
    assert _linear_layers.column_forward_impl(None, instance, args + (False, False, False, None), {}) is not None
    with pytest.raises(UnsupportedConfigurationError, match=what):
        _linear_layers.column_forward_impl(None, instance, args + positional, {})


def test_kv_groups_equal_to_the_tp_size_pass_the_column_layer(invariant):
    assert _column_call(2, config=SimpleNamespace(num_query_groups=2)) is not None


def test_column_layer_runs_the_block_gemm_and_honours_the_fp32_output_request(invariant):
    from megapatch.numerics import fp32_output_linear

    x, weight = _small((3, 4), 21).bfloat16(), _small((16, 4), 22).bfloat16()
    out = _column_call(1)
    assert out.dtype == torch.bfloat16 and torch.equal(out, (x.float() @ weight.float().t()).bfloat16())
    with fp32_output_linear.output_dtype(torch.float32):
        out = _column_call(1)
    assert out.dtype == torch.float32 and torch.equal(out, x.float() @ weight.float().t())


def test_a_gated_fc1_that_w_does_not_split_is_refused_naming_its_full_size(invariant):
    """Rank r of TP 2 holds [gate_r; up_r], 6 rows each: 12 gate and 12 up rows in the full layer,
    which 8 blocks cannot split."""
    from megapatch.core.errors import OptionError
    from megapatch.core.scope import scoped
    from megapatch.patches.tp_invariant import _linear_layers, _marks

    instance = SimpleNamespace(tp_group=StandInGroup(2), config=SimpleNamespace(num_query_groups=None))
    args = dict(input=torch.ones(2, 4, dtype=torch.bfloat16), weight=torch.ones(12, 4, dtype=torch.bfloat16),
                bias=None, allreduce_dgrad=True)
    with scoped(_marks.gated_fc1, instance):
        with pytest.raises(OptionError, match=r"output features \(each of gate, up\) has size 12, not divisible"):
            _linear_layers.column_forward_impl(None, instance, (), args)


def _row_instance(**kw):
    fields = dict(tp_group=StandInGroup(1), sequence_parallel=False, explicit_expert_comm=False,
                  gradient_accumulation_fusion=False, input_is_parallel=True, skip_bias_add=False,
                  weight=planted((2, 16), 31).bfloat16(), bias=_small((2,), 32).bfloat16())
    return SimpleNamespace(**{**fields, **kw})


def test_row_layer_adds_its_bias_after_the_tree_or_hands_it_back(invariant):
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import _linear_layers

    x = signs((3, 16), 33).bfloat16()
    layer = _row_instance()
    products = x.float()[:, None, :] * layer.weight.float()[None]
    tree = _tree([products[..., 2 * b] + products[..., 2 * b + 1] for b in range(W)]).bfloat16()
    out, bias = _linear_layers.row_forward(None, layer, (x,), {})
    assert bias is None and torch.equal(out, tree + layer.bias)
    out, bias = _linear_layers.row_forward(None, _row_instance(skip_bias_add=True), (x,), {})
    # handed back expanded to the output's shape (its gradient then sums tokens in the fixed tree)
    assert torch.equal(out, tree) and torch.equal(bias, layer.bias.expand_as(tree))
    out, bias = _linear_layers.row_forward(None, _row_instance(bias=None), (x,), {})
    assert bias is None and torch.equal(out, tree)
    out, _ = _linear_layers.row_forward(None, _row_instance(sequence_parallel=True), (x,), {})
    assert torch.equal(out, tree + layer.bias)  # TP 1: no sequence to split
    # the bias is added, not lost in rounding: small integers, exact in BF16 (|sum| <= 147)
    small, layer = _small((3, 16), 34).bfloat16(), _row_instance(weight=_small((2, 16), 35).bfloat16())
    out, _ = _linear_layers.row_forward(None, layer, (small,), {})
    exact = small.float() @ layer.weight.float().t()
    assert torch.equal(out.float(), exact + layer.bias.float()) and not torch.equal(out.float(), exact)
    with pytest.raises(UnsupportedConfigurationError, match="gradient_accumulation_fusion"):
        _linear_layers.row_forward(None, _row_instance(gradient_accumulation_fusion=True), (x,), {})
    # a routed expert's fc2 (the dispatcher sums it over expert TP): the tree, no bias of its own
    out, bias = _linear_layers.row_forward(None, _row_instance(explicit_expert_comm=True, bias=None), (x,), {})
    assert bias is None and torch.equal(out, tree)
    with pytest.raises(UnsupportedConfigurationError, match="--disable-bias-linear"):
        _linear_layers.row_forward(None, _row_instance(explicit_expert_comm=True), (x,), {})


def test_a_row_layer_that_w_does_not_split_is_refused_naming_its_full_size(invariant):
    from megapatch.core.errors import OptionError
    from megapatch.patches.tp_invariant import _linear_layers

    layer = _row_instance(tp_group=StandInGroup(2), weight=torch.ones(2, 6, dtype=torch.bfloat16))
    with pytest.raises(OptionError, match="input features has size 12, not divisible by tp_invariant_width=8"):
        _linear_layers.row_forward(None, layer, (torch.ones(3, 6, dtype=torch.bfloat16),), {})


def test_the_wrappers_pass_through_when_the_mode_is_off():
    from megapatch.patches.tp_invariant import _linear_layers, construction, distributed_optimizer, grad_norm, mlp

    upstream = lambda *a, **k: ("upstream", a, k)  # noqa: E731
    assert _linear_layers.column_forward_impl(upstream, None, (1,), {})[0] == "upstream"
    assert _linear_layers.row_forward(upstream, None, (1,), {})[0] == "upstream"
    assert mlp._mlp_forward(upstream, None, (1,), {})[0] == "upstream"
    assert grad_norm._norm_owner_scope(upstream, None, (1,), {})[0] == "upstream"
    assert grad_norm._grad_norm_fp32(upstream, None, ([], 2.0), {})[0] == "upstream"
    assert construction.block_init(upstream, None, (1,), {})[0] == "upstream"
    assert distributed_optimizer._distributed_optimizer_init(upstream, None, (1,), {})[0] == "upstream"


def test_grad_norm_refusals_and_the_order_free_max(invariant):
    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.core.scope import scoped
    from megapatch.patches.tp_invariant import grad_norm

    upstream = lambda *a, **k: "upstream"  # noqa: E731
    assert grad_norm._grad_norm_fp32(upstream, None, ([], float("inf")), {}) == "upstream"
    assert grad_norm._grad_norm_fp32(upstream, None, ([],), {"norm_type": "inf"}) == "upstream"
    with pytest.raises(UnsupportedConfigurationError, match="outside an optimizer"):
        grad_norm._grad_norm_fp32(upstream, None, ([], 2.0), {})
    with scoped(grad_norm._norm_owner, SimpleNamespace()):
        with pytest.raises(UnsupportedConfigurationError, match="grad norm of type 1.0"):
            grad_norm._grad_norm_fp32(upstream, None, ([], 1), {})
    seen = []
    grad_norm._norm_owner_scope(lambda: seen.append(grad_norm._norm_owner.get()), "the optimizer", (), {})
    assert seen == ["the optimizer"] and grad_norm._norm_owner.get() is None


def test_the_norm_spans_tp_alone_or_tp_times_pp_and_refuses_other_ranks(invariant, monkeypatch):
    from megatron.core import parallel_state

    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import grad_norm

    stages = StandInGroup(4)  # PP 4 with TP 2: TP x PP = 8, TP + PP = 6
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: stages)
    tp = StandInGroup(2)
    assert grad_norm._pipeline_stages(None, tp, False) is None and grad_norm._pipeline_stages(StandInGroup(2), tp, False) is None
    assert grad_norm._pipeline_stages(StandInGroup(8), tp, False) is stages
    for size in (16, 6, 4):  # data-parallel or expert ranks too, or a group that is no TP x PP
        with pytest.raises(UnsupportedConfigurationError, match=f"a grad norm over {size} ranks \\(TP 2 x PP 4"):
            grad_norm._pipeline_stages(StandInGroup(size), tp, False)
    # the distributed optimizer's norm spans its data-parallel shards too (gathered first): TP x PP x DP
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda **kw: 2)
    assert grad_norm._pipeline_stages(StandInGroup(16), tp, True) is stages
    with pytest.raises(UnsupportedConfigurationError, match="TP 2 x PP 4 x DP 2"):
        grad_norm._pipeline_stages(StandInGroup(8), tp, True)


# -- sequence parallelism and token-split sums at TP=1 (no ranks) ------------------------------------

def test_sequence_parallel_slices_take_this_ranks_positions(invariant):
    """``_own_rows`` (ScatterSequence's forward, GatherSequence's backward): rank r of t holds
    positions [r s/t, (r+1) s/t) of the sequence (dim 0), as upstream's reduce-scatter does."""
    from megapatch.numerics.block_linear import GatherSequence, ScatterSequence, _own_rows

    x = torch.arange(8 * 2 * 3, dtype=torch.float32).view(8, 2, 3)
    for t, r in ((1, 0), (2, 0), (2, 1), (4, 3), (8, 5)):
        group = StandInGroup(t, r)
        want = x[r * 8 // t:(r + 1) * 8 // t]
        gathered_grad, none = GatherSequence.backward(SimpleNamespace(group=group), x)
        assert none is None
        for got in (_own_rows(x, group), ScatterSequence.apply(x, group), gathered_grad):
            assert got.shape == (8 // t, 2, 3) and torch.equal(got, want), (t, r)


def _token_grad():
    """[8 positions, 2 sequences, 3 features] = 16 rows in W = 8 blocks of 2: exact block sums whose
    FP32 total depends on the association (2^24 then ones: the tree keeps two of them, in order
    all are lost), values in blocks' last rows and one in a first row."""
    g = torch.zeros(16, 3)
    g[1, 0], g[3, 0], g[5, 0], g[7, 0] = BIG, 1.0, 1.0, 1.0
    g[8, 1], g[13, 1], g[14, 1] = 2.0, 1.0, -BIG
    g[11, 2], g[15, 0], g[2, 2] = 3.0, -2.0, 1.0
    return g.view(8, 2, 3)


def _in_order(rows):
    total = torch.zeros(rows.shape[-1])
    for row in rows.reshape(-1, rows.shape[-1]):
        total = total + row
    return total


def _token_oracle(rows):
    """Per feature: the fixed tree (``_tree``) of the sums of each block of 2 rows ([s*b, h])."""
    r2 = rows.reshape(-1, rows.shape[-1])
    return _tree([r2[2 * b] + r2[2 * b + 1] for b in range(W)])


def test_norm_affine_gradients_sum_token_blocks_in_the_fixed_tree(invariant):
    """TokenBlockedAffine: forward ``normalised * w + b`` rounded once; the weight and bias
    gradients are per-block sums over consecutive rows of [s, b, h] added in the fixed tree
    (s, b and h all differ, so a reshape by the wrong dim shows); with sequence parallelism
    (``split``) rank 0 returns the total and other ranks zeros."""
    from megapatch.numerics.token_tree import TokenBlockedAffine

    grad = _token_grad()
    normalised = signs((8, 2, 3), 60).requires_grad_()
    weight = torch.tensor([0.5, -2.0, 3.0], requires_grad=True)  # FP32: the tree's sum unrounded
    bias = torch.tensor([1.0, 0.25, -1.0], requires_grad=True)
    out = TokenBlockedAffine.apply(normalised, weight, bias, None, W, False, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (normalised.detach() * weight.detach() + bias.detach()).bfloat16())
    out.backward(grad.bfloat16())
    assert torch.equal(weight.grad, _token_oracle(grad * normalised.detach()))
    assert torch.equal(bias.grad, _token_oracle(grad))
    assert torch.equal(normalised.grad, grad * weight.detach())
    # the association shows on these values: summed in token order the bits differ
    assert not torch.equal(bias.grad, _in_order(grad))
    assert not torch.equal(weight.grad, _in_order(grad * normalised.detach()))
    for rank in (0, 1):  # split: the total on rank 0, zeros elsewhere (upstream all-reduces them)
        w = weight.detach().clone().requires_grad_()
        b = bias.detach().clone().requires_grad_()
        TokenBlockedAffine.apply(normalised.detach(), w, b, StandInGroup(1, rank), W, True,
                                 torch.float32).backward(grad)
        want_w, want_b = _token_oracle(grad * normalised.detach()), _token_oracle(grad)
        if rank:
            want_w, want_b = torch.zeros(3), torch.zeros(3)
        assert torch.equal(w.grad, want_w) and torch.equal(b.grad, want_b), rank
    # no bias: only the weight's gradient
    w = weight.detach().clone().requires_grad_()
    out = TokenBlockedAffine.apply(normalised.detach(), w, None, None, W, False, torch.float32)
    assert torch.equal(out, normalised.detach() * w.detach())
    out.backward(grad)
    assert torch.equal(w.grad, _token_oracle(grad * normalised.detach()))


def test_row_bias_gradient_sums_token_blocks_in_the_fixed_tree(invariant):
    from megapatch.numerics.token_tree import TokenBlockedBias

    grad = _token_grad()
    bias = torch.tensor([1.0, 0.25, -1.0], requires_grad=True)
    out = TokenBlockedBias.apply(bias, (8, 2, 3), None, W, False)
    assert torch.equal(out, bias.detach().expand(8, 2, 3))
    out.backward(grad)
    assert bias.grad.dtype == torch.float32 and torch.equal(bias.grad, _token_oracle(grad))
    half = torch.tensor([1.0, 0.25, -1.0], dtype=torch.bfloat16, requires_grad=True)
    TokenBlockedBias.apply(half, (8, 2, 3), StandInGroup(1, 1), W, True).backward(grad.bfloat16())
    assert half.grad.dtype == torch.bfloat16 and torch.equal(half.grad, torch.zeros(3, dtype=torch.bfloat16))


def test_squared_norms_of_a_gated_fc1_pair_gate_and_up_blocks(invariant):
    """``halves=2``: rank r holds [gate_r; up_r] along the partition dim; block b's leaves are gate
    block b and up block b (as the dgrad tree pairs them), not block b of the local rows."""
    from megapatch.numerics.block_tree import squared_norms

    # [16, 3] each, W blocks of 2 rows. Squares: gate block 0 2^24, up blocks 0 and 1 one each
    # (paired with gate: one lost; cut across the local rows: both kept), 9 and 4 further on
    gate, up = torch.zeros(16, 3), torch.zeros(16, 3)
    gate[1, 0], gate[11, 2], up[1, 1], up[3, 0], up[12, 1] = 4096.0, 3.0, 1.0, -1.0, 2.0
    for dim in (0, 1):
        grad = torch.cat([gate, up], 0) if dim == 0 else torch.cat([gate.t(), up.t()], 1)
        got = squared_norms([grad], [dim], None, [2])
        squares = [[torch.tensor(float((half[2 * b:2 * b + 2] ** 2).sum())) for b in range(W)] for half in (gate, up)]
        sums = [squares[0][b] + squares[1][b] for b in range(W)]
        assert torch.equal(got, _tree(sums).view(1)), (dim, got, _tree(sums))
        assert not torch.equal(got, squared_norms([grad], [dim], None)), dim  # the pairing shows


def test_token_blocks_are_w_or_w_over_t_and_a_split_sequence_w_does_not_divide_is_refused(invariant):
    """``token_blocks``: W blocks of positions per rank, W/t when sequence parallelism splits the
    sequence over the TP group (only then does the group count), one block for a sequence W does
    not divide without SP; with SP such a sequence is refused, naming its full length."""
    from megapatch.core.errors import OptionError
    from megapatch.numerics import block_tree as tree

    assert tree.token_blocks(torch.ones(6, 2, 3), None, False) == 1
    assert tree.token_blocks(torch.ones(6, 2, 3), StandInGroup(2), False) == 1
    assert tree.token_blocks(torch.ones(16, 1, 3), None, False) == W
    assert tree.token_blocks(torch.ones(16, 1, 3), StandInGroup(2), False) == W  # not split: the group plays no part
    assert tree.token_blocks(torch.ones(8, 1, 3), StandInGroup(2), True) == W // 2
    assert tree.token_blocks(torch.ones(4, 1, 3), StandInGroup(4), True) == W // 4
    with pytest.raises(OptionError, match=r"the sequence \(tokens summed into a norm or bias gradient\) has "
                                          r"size 12, not divisible by tp_invariant_width=8"):
        tree.token_blocks(torch.ones(6, 1, 3), StandInGroup(2), True)


def test_torch_norms_run_their_affine_part_in_token_blocks_and_unknown_norms_are_refused(invariant):
    """LayerNorm/RMSNorm (the local spec without apex) are routed once through TokenBlockedAffine:
    same output as torch's to rounding, weight and bias gradients the fixed tree of token blocks.
    A norm with parameters of its own that the mode does not know is refused; one without
    parameters, one whose parameters are a child's, a norm without affine part and a layer that is
    no norm are left alone."""
    import torch.nn.functional as F

    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.patches.tp_invariant import _norms

    x = _small((16, 1, 3), 71) + torch.arange(3.0)  # no constant row: a well-defined norm
    grad = _token_grad().reshape(16, 1, 3)
    for norm in (torch.nn.LayerNorm(3), torch.nn.RMSNorm(3, eps=1e-5)):
        with torch.no_grad():
            norm.weight.copy_(torch.tensor([0.5, -2.0, 3.0]))
            if getattr(norm, "bias", None) is not None:
                norm.bias.copy_(torch.tensor([1.0, 0.25, -1.0]))
        native = norm(x)
        _norms.token_blocked_norm(norm)
        routed = norm.forward
        _norms.token_blocked_norm(norm)  # once only
        assert norm.forward is routed and norm._megapatch_token_blocked
        out = norm(x)
        torch.testing.assert_close(out, native, rtol=1e-6, atol=1e-6)
        out.backward(grad)
        if isinstance(norm, torch.nn.LayerNorm):
            normalised = F.layer_norm(x, (3,), None, None, norm.eps)
            assert torch.equal(norm.bias.grad, _token_oracle(grad))
        else:
            normalised = F.rms_norm(x, (3,), None, norm.eps)
        assert torch.equal(norm.weight.grad, _token_oracle(grad * normalised)), type(norm)

    class OwnNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

    with pytest.raises(UnsupportedConfigurationError, match="does not support the norm layer .*OwnNorm"):
        _norms.token_blocked_norm(OwnNorm())

    class FreeNorm(torch.nn.Module):  # nothing summed over tokens
        pass

    class NormStack(torch.nn.Module):  # its parameters are a child's, which the block visits itself
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.LayerNorm(3)

    for module in (FreeNorm(), NormStack(), torch.nn.LayerNorm(3, elementwise_affine=False), torch.nn.Linear(3, 3)):
        forward = module.forward
        _norms.token_blocked_norm(module)
        assert module.forward == forward and not getattr(module, "_megapatch_token_blocked", False)


def test_a_gated_fc1_is_marked_and_found_through_an_optimizers_fp32_copies():
    """``_mark_gated_fc1`` marks a SwiGLU fc1's weight and bias (only for a gated linear unit);
    ``_model_params`` finds the model parameter of each FP32 main copy a mixed-precision optimizer
    made (where the mark is read)."""
    from megapatch.patches.tp_invariant import _marks, grad_norm

    def fc1(config, bias=True):
        return SimpleNamespace(config=SimpleNamespace(gated_linear_unit=config), linear_fc1=SimpleNamespace(
            weight=torch.nn.Parameter(torch.ones(2)), bias=torch.nn.Parameter(torch.ones(2)) if bias else None))

    gated, plain, no_bias = fc1(True), fc1(False), fc1(True, bias=False)
    for module in (gated, plain, no_bias, SimpleNamespace(config=gated.config)):  # the last has no fc1
        _marks.mark_gated_fc1(module)
    assert getattr(gated.linear_fc1.weight, _marks.GATED) == 2 == getattr(gated.linear_fc1.bias, _marks.GATED)
    assert getattr(no_bias.linear_fc1.weight, _marks.GATED) == 2
    assert not hasattr(plain.linear_fc1.weight, _marks.GATED) and not hasattr(plain.linear_fc1.bias, _marks.GATED)
    mains = [torch.nn.Parameter(torch.ones(2)) for _ in range(4)]
    optimizer = SimpleNamespace(
        float16_groups=[[gated.linear_fc1.weight, plain.linear_fc1.weight],
                        [plain.linear_fc1.bias, gated.linear_fc1.bias]],
        fp32_from_float16_groups=[mains[:2], mains[2:]])
    model_of = grad_norm._model_params(optimizer)
    assert {i for i, p in model_of.items() if getattr(p, _marks.GATED, 1) == 2} == {id(mains[0]), id(mains[3])}
    assert model_of[id(mains[1])] is plain.linear_fc1.weight and model_of[id(mains[2])] is plain.linear_fc1.bias
    assert grad_norm._model_params(SimpleNamespace()) == {}
    assert grad_norm._model_params(SimpleNamespace(float16_groups=None, fp32_from_float16_groups=None)) == {}


def test_the_grad_norm_reads_its_stats_group_at_upstreams_position(invariant, monkeypatch):
    """``get_grad_norm_fp32(grads_for_norm, norm_type, grad_stats_parallel_group)``: a stats group
    spanning more than TP x PP is refused whether given by position or by name."""
    from megatron.core import parallel_state

    from megapatch.core.errors import UnsupportedConfigurationError
    from megapatch.core.scope import scoped
    from megapatch.patches.tp_invariant import grad_norm

    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: StandInGroup(4))
    owner = SimpleNamespace(get_parameters=lambda: [], tp_group=StandInGroup(2),
                            config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    with scoped(grad_norm._norm_owner, owner):
        for args, kwargs in ((([], 2.0, StandInGroup(16)), {}), (([],), {"grad_stats_parallel_group": StandInGroup(16)})):
            with pytest.raises(UnsupportedConfigurationError, match=r"a grad norm over 16 ranks \(TP 2 x PP 4"):
                grad_norm._grad_norm_fp32(None, None, args, kwargs)
        assert grad_norm._grad_norm_fp32(None, None, ([], 2.0, StandInGroup(2)), {}) == 0.0  # TP alone: no parameters


class DistributedOptimizer(SimpleNamespace):
    """Named as megatron-core's: the patch tells a distributed optimizer by its type's name."""


def test_a_distributed_optimizers_norm_reads_full_gradients_from_its_buffers_in_order(invariant):
    """DP 1: ``_distributed_grads`` yields every parameter with its gradient viewed from the grad
    buffer in buffer order (not the map's order), and the grad norm adds their squares (sharded or
    replicated) exactly, like the non-distributed optimizer's."""
    from megapatch.core.scope import scoped
    from megapatch.patches.tp_invariant import grad_norm

    sharded = _param(_norm_grad(0), 0, SimpleNamespace(tp_size=1, tp_rank=0))
    replicated = _param(torch.full((2, 2), 4096.0), None, SimpleNamespace(tp_size=1, tp_rank=0))
    data = torch.cat([replicated.grad.reshape(-1), sharded.grad.reshape(-1)])
    buffer = SimpleNamespace(grad_data=data, data_parallel_group=StandInGroup(1, 0), bucket_indices=[(0, 52)],
                             buckets=[SimpleNamespace(grad_data=data)],
                             param_index_map={sharded: (4, 52, 0), replicated: (0, 4, 0)})
    for p in (sharded, replicated):
        p.grad = None  # the distributed optimizer's gradients live in the buffer only
    optimizer = DistributedOptimizer(buffers=[buffer], config=SimpleNamespace())
    pairs = list(grad_norm._distributed_grads(optimizer))
    assert [p for p, _ in pairs] == [replicated, sharded]
    assert torch.equal(pairs[0][1], torch.full((2, 2), 4096.0)) and torch.equal(pairs[1][1], _norm_grad(0))
    optimizer.tp_group = StandInGroup(1)
    with scoped(grad_norm._norm_owner, optimizer):
        norm = grad_norm._grad_norm_fp32(None, None, ([], 2.0, None), {})
    assert norm == _exact_norm([torch.tensor(4 * BIG), _norm_oracle(_norm_grad(0), 0)])


# -- TP=2 with two data-parallel replicas (world 4) ------------------------------------------------

def _parts(numel, seed):
    return [planted((numel,), seed * 100 + b) for b in range(W)]


def _param(full, dim, ctx, **attrs):
    shard = full if dim is None else full.chunk(ctx.tp_size, dim=dim)[ctx.tp_rank]
    p = torch.nn.Parameter(torch.zeros_like(shard))
    p.grad = shard.clone()
    p.tensor_model_parallel = dim is not None
    p.partition_dim = -1 if dim is None else dim
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def _tp2_job(ctx):
    import megapatch
    from megapatch.core.scope import scoped
    from megapatch.numerics import block_tree as tpi
    from megapatch.numerics import block_linear
    from megapatch.patches.tp_invariant import grad_norm

    megapatch.enable(tp_invariant=True)
    group, t, r, dp = ctx.tp_group, ctx.tp_size, ctx.tp_rank, ctx.dp_rank
    mine = slice(r * W // t, (r + 1) * W // t)
    out = {}
    for numel in (7, 8):  # 7: not divisible by the TP size (padded all-to-all)
        parts = _parts(numel, dp)[mine]
        out[("sum", numel)] = tpi.invariant_sum(parts, group)
        out[("sum_bf16", numel)] = tpi.invariant_sum(parts, group, torch.bfloat16)
    shards = [_norm_grad(0).chunk(t, 0)[r] * (dp + 1), _small((5, 3), 9), _norm_grad(1).chunk(t, 1)[r]]
    out["norms"] = tpi.squared_norms(shards, [0, None, 1], group)
    # the column-parallel dgrad summed over TP through the tree
    x = torch.ones(2, 4, requires_grad=True)  # FP32: the FP32 tree comes out unrounded
    weight = planted((16, 4), 40 + dp).bfloat16()[r * 16 // t:(r + 1) * 16 // t]
    y = block_linear.ColumnParallel.apply(x, weight, None, group, True, tpi.blocks_per_rank(group), None, 1)
    y.backward(signs((2, 16), 41)[:, r * 16 // t:(r + 1) * 16 // t])
    out["dgrad"] = x.grad
    # the patch's grad norm: every parameter's square added exactly, a shared one and a missing grad skipped
    params = [_param(_norm_grad(0), 0, ctx), _param(torch.full((2, 2), 4096.0), None, ctx),
              _param(_small((3, 16), 42), 1, ctx), _param(torch.full((2,), 1000.0), None, ctx, shared=True),
              _param(_small((4,), 43), None, ctx)]
    params[-1].grad = None
    owner = SimpleNamespace(get_parameters=lambda: params, tp_group=group,
                            config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    with scoped(grad_norm._norm_owner, owner):
        out["grad_norm"] = grad_norm._grad_norm_fp32(None, None, ([], 2.0, group), {})
    out.update(_sequence_parallel_paths(ctx))
    out["do_grads"] = [g.clone() for _, g in grad_norm._distributed_grads(_dp_sharded_optimizer(ctx))]
    out["ce_tp2"] = _cross_entropy(ctx, 16)
    try:
        _cross_entropy(ctx, 10)
        out["ce_refused"] = None
    except Exception as exc:  # noqa: BLE001 -- the message is checked
        out["ce_refused"] = f"{type(exc).__name__}: {exc}"
    from megapatch.testing import reinit_model_parallel

    ctx = reinit_model_parallel(ctx, tp=1)
    out["ce_tp1"] = _cross_entropy(ctx, 16)
    megapatch.disable()
    return out


SP_GRAD = torch.zeros(8, 1, 2)  # the row layer's output gradient, [8 positions, 1, 2 features]
SP_GRAD[:4, 0, 0] = torch.tensor([BIG, 1.0, 1.0, 1.0])  # the bias gradient's tree keeps two ones
SP_GRAD[4:, 0, 1] = torch.tensor([2.0, -BIG, 3.0, 1.0])


def _sequence_parallel_paths(ctx):
    """At TP=2, the sequence-parallel slices and collectives for real: GatherSequence (forward
    all-gather, backward this rank's slice), ScatterSequence (forward slice, backward all-gather),
    and the patched column and row layers with ``sequence_parallel`` (the row bias's gradient a
    token tree across the group, on rank 0)."""
    from megapatch.numerics import block_linear
    from megapatch.patches.tp_invariant import _linear_layers

    group, t, r, dp = ctx.tp_group, ctx.tp_size, ctx.tp_rank, ctx.dp_rank
    out = {}
    mine = _small((4, 1, 3), 90 + dp)[r * 4 // t:(r + 1) * 4 // t].clone().requires_grad_()
    gathered = block_linear.GatherSequence.apply(mine, group)
    gathered.backward(_small((4, 1, 3), 91))
    out["sp_gather"], out["sp_gather_grad"] = gathered.detach(), mine.grad
    whole = _small((4, 1, 3), 92 + dp).requires_grad_()
    scattered = block_linear.ScatterSequence.apply(whole, group)
    scattered.backward(_small((4 // t, 1, 3), 93 + r))
    out["sp_scatter"], out["sp_scatter_grad"] = scattered.detach(), whole.grad
    # column layer: this rank's 2 positions gathered; dgrad the tree over TP, sliced back
    x = torch.ones(4 // t, 1, 4, requires_grad=True)  # FP32: the FP32 tree comes out unrounded
    weight = planted((16, 4), 94 + dp).bfloat16()[r * 16 // t:(r + 1) * 16 // t]
    layer = SimpleNamespace(tp_group=group, config=SimpleNamespace(num_query_groups=None))
    y = _linear_layers.column_forward_impl(None, layer, (), dict(
        input=x, weight=weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
        sequence_parallel=True, grad_output_buffer=None))
    y.backward(signs((4, 1, 16), 95)[..., r * 16 // t:(r + 1) * 16 // t])
    out["sp_column"], out["sp_column_dgrad"] = y.detach(), x.grad
    # row layer: the fixed-tree sum of the K blocks, this rank's 4 of 8 positions, bias after
    x = signs((8, 1, 16), 96)[..., r * 16 // t:(r + 1) * 16 // t].clone().requires_grad_()
    bias = torch.tensor([0.5, -0.25], requires_grad=True)
    row = _row_instance(tp_group=group, sequence_parallel=True, bias=bias,
                        weight=planted((2, 16), 97).bfloat16()[:, r * 16 // t:(r + 1) * 16 // t])
    y, none = _linear_layers.row_forward(None, row, (x,), {})
    y.backward(SP_GRAD[r * 8 // t:(r + 1) * 8 // t])
    out["sp_row"], out["sp_row_bias_grad"], out["sp_row_dgrad"] = y.detach(), bias.grad, x.grad
    return out


def _dp_sharded_optimizer(ctx):
    """A distributed optimizer's grad buffer at DP=2: two buckets, each data-parallel rank holding
    only its own chunk of each reduced (the other chunk stale: -1)."""
    dp_group, d = ctx.dp_group, ctx.dp_rank
    true = torch.arange(20.0) + 100 * ctx.tp_rank
    data = true.clone()
    for start, end in ((0, 8), (8, 20)):
        data[start:end].chunk(2)[1 - d].fill_(-1.0)
    params = [torch.nn.Parameter(torch.zeros(2, 4)), torch.nn.Parameter(torch.zeros(3, 4))]
    buffer = SimpleNamespace(grad_data=data, data_parallel_group=dp_group, bucket_indices=[(0, 8), (8, 20)],
                             buckets=[SimpleNamespace(grad_data=data[0:8]), SimpleNamespace(grad_data=data[8:20])],
                             param_index_map={params[1]: (8, 20, 1), params[0]: (0, 8, 0)})
    return DistributedOptimizer(buffers=[buffer])


def _ce_logits(vocab):
    """[3 tokens, 1, vocab] FP32 logits spread over a wide range: exp() spans many binades."""
    return _small((3, 1, vocab), 50) * 4.0 + torch.arange(vocab, dtype=torch.float32) / 3


CE_TARGET = torch.tensor([[1], [9], [14]])


def _cross_entropy(ctx, vocab):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    shard = vocab // ctx.tp_size
    logits = _ce_logits(vocab)[..., ctx.tp_rank * shard:(ctx.tp_rank + 1) * shard].contiguous()
    return vocab_parallel_cross_entropy(logits, CE_TARGET.remainder(vocab))


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(_tp2_job, world_size=4, tp=2, timeout=300)


def test_invariant_sum_over_the_tp_group_is_the_fixed_tree_on_every_rank(tp2):
    for rank, out in enumerate(tp2):
        dp = rank // 2
        for numel in (7, 8):
            want = _tree(_parts(numel, dp))
            assert torch.equal(out[("sum", numel)], want), (rank, numel)
            assert out[("sum_bf16", numel)].dtype == torch.bfloat16
            assert torch.equal(out[("sum_bf16", numel)], want.bfloat16()), (rank, numel)
    # the planted partials make the tree visible: summed in order they give other bits
    assert any(not torch.equal(_tree(_parts(n, d)), sum(_parts(n, d))) for n in (7, 8) for d in (0, 1))


def test_squared_norms_at_tp2_equal_the_tp1_oracle(tp2):
    for rank, out in enumerate(tp2):
        scale = rank // 2 + 1
        want = torch.stack([_norm_oracle(_norm_grad(0) * scale, 0), (_small((5, 3), 9) ** 2).sum(),
                            _norm_oracle(_norm_grad(1), 1)])
        assert torch.equal(out["norms"], want), (rank, out["norms"].tolist(), want.tolist())


@pytest.mark.quick("tp_invariant.tensor_parallel")
def test_column_dgrad_summed_over_tp_is_the_fixed_tree(tp2):
    for rank, out in enumerate(tp2):
        weight = planted((16, 4), 40 + rank // 2).bfloat16().float()
        grad = signs((2, 16), 41)
        products = grad[:, :, None] * weight[None]
        want = _tree([products[:, 2 * b] + products[:, 2 * b + 1] for b in range(W)])
        assert torch.equal(out["dgrad"], want), rank
        assert not torch.equal(want, products.sum(1))


@pytest.mark.quick("tp_invariant.grad_norm")
def _exact_norm(squares):
    """The norm the mode promises: the square root of the exact sum of the parameters' FP32
    squares, rounded once (independent of their order and of the pipeline's cut)."""
    return math.sqrt(float(sum(Fraction(float(v)) for v in squares)))


def test_the_patched_grad_norm_adds_parameters_exactly_and_skips_shared_ones(tp2):
    totals = [_norm_oracle(_norm_grad(0), 0), torch.tensor(4 * BIG),
              _tree([torch.tensor(float((b ** 2).sum())) for b in _small((3, 16), 42).split(2, dim=1)])]
    in_order = torch.zeros((), dtype=torch.float32)
    for value in totals:
        in_order = in_order + value
    assert in_order.item() ** 0.5 != _exact_norm(totals)  # the planted squares make an FP32 sum visible
    for out in tp2:
        assert out["grad_norm"] == _exact_norm(totals), (out["grad_norm"], _exact_norm(totals))


def test_vocab_parallel_cross_entropy_is_tp_invariant_and_matches_a_float64_oracle(tp2):
    logits = _ce_logits(16).double()
    want = torch.logsumexp(logits, dim=-1) - logits.gather(-1, CE_TARGET[..., None])[..., 0]
    for rank, out in enumerate(tp2):
        assert torch.equal(out["ce_tp2"], out["ce_tp1"]), rank
        assert torch.allclose(out["ce_tp1"].double(), want, rtol=1e-6, atol=0), (out["ce_tp1"], want)


def test_a_vocabulary_that_w_does_not_split_is_refused_naming_its_size(tp2):
    for out in tp2:
        assert out["ce_refused"] and "OptionError" in out["ce_refused"], out["ce_refused"]
        assert "the vocabulary (cross entropy) has size 10, not divisible by tp_invariant_width=8" in out["ce_refused"]


def test_sequence_parallel_gather_and_scatter_over_tp_are_exact_and_slice_this_ranks_positions(tp2):
    for rank, out in enumerate(tp2):
        t, r, dp = 2, rank % 2, rank // 2
        assert torch.equal(out["sp_gather"], _small((4, 1, 3), 90 + dp)), rank
        assert torch.equal(out["sp_gather_grad"], _small((4, 1, 3), 91)[2 * r:2 * r + 2]), rank
        assert torch.equal(out["sp_scatter"], _small((4, 1, 3), 92 + dp)[2 * r:2 * r + 2]), rank
        assert torch.equal(out["sp_scatter_grad"], torch.cat([_small((2, 1, 3), 93 + q) for q in range(t)])), rank


def test_sequence_parallel_column_and_row_layers_follow_the_fixed_tree_over_tp(tp2):
    """Column: the input gathered (4 positions), dgrad the fixed tree of all 8 blocks over TP, this
    rank's 2 positions of it. Row: the tree sum over TP, this rank's 4 of 8 positions, plus the
    bias; the bias gradient is the token tree over all 8 positions on rank 0, zeros on rank 1."""
    for rank, out in enumerate(tp2):
        r, dp = rank % 2, rank // 2
        weight = planted((16, 4), 94 + dp).bfloat16().float()
        # the forward's K (4) is not split: one FP32 GEMM, whose order over the planted +-2^24 terms
        # is the CPU BLAS kernel's (it differs between machines), so the oracle is the exact sum and
        # FP32's rounding bound for 4 terms; a wrong shard or slice is off by thousands
        exact = torch.ones(4, 1, 4).double() @ weight[8 * r:8 * r + 8].double().t()
        bound = 4 * 2.0 ** -24 * (torch.ones(4, 1, 4).double() @ weight[8 * r:8 * r + 8].double().abs().t())
        assert out["sp_column"].dtype == torch.float32
        assert bool(((out["sp_column"].double() - exact).abs() <= bound).all()), (rank, out["sp_column"], exact)
        products = signs((4, 1, 16), 95)[..., :, None] * weight  # [4, 1, 16, 4]
        dgrad = _tree([products[..., 2 * b, :] + products[..., 2 * b + 1, :] for b in range(W)])
        assert not torch.equal(dgrad, products.sum(-2))
        assert torch.equal(out["sp_column_dgrad"], dgrad[2 * r:2 * r + 2]), rank
        x, w = signs((8, 1, 16), 96), planted((2, 16), 97).bfloat16().float()
        products = x[..., None, :] * w  # [8, 1, 2, 16]
        tree = _tree([products[..., 2 * b] + products[..., 2 * b + 1] for b in range(W)])
        bias = torch.tensor([0.5, -0.25])
        assert torch.equal(out["sp_row"], (tree + bias)[4 * r:4 * r + 4]), rank
        want = _tree(list(SP_GRAD.reshape(8, 2))) if r == 0 else torch.zeros(2)
        assert torch.equal(out["sp_row_bias_grad"], want), (rank, out["sp_row_bias_grad"])
        torch.testing.assert_close(out["sp_row_dgrad"], SP_GRAD @ w[:, 8 * r:8 * r + 8], rtol=1e-6, atol=0)
    assert not torch.equal(_tree(list(SP_GRAD.reshape(8, 2))), _in_order(SP_GRAD))


@pytest.mark.quick("tp_invariant.distributed_optimizer")
def test_a_distributed_optimizers_shards_are_gathered_over_dp_before_the_norm_reads_them(tp2):
    for rank, out in enumerate(tp2):
        true = torch.arange(20.0) + 100 * (rank % 2)
        grads = out["do_grads"]
        assert len(grads) == 2 and torch.equal(grads[0], true[:8].view(2, 4)), rank
        assert torch.equal(grads[1], true[8:].view(3, 4)), rank


@pytest.mark.parametrize("tokens,batch,nb", [(8, 2, W), (7, 1, 1)])
def test_the_token_blocked_router_gemm_with_a_bias_matches_an_fp64_oracle(invariant, tokens, batch, nb):
    """The MoE router's gating GEMM (``TokenBlockedLinear``) with a bias, run per token block (W
    blocks; one where the sequence does not divide W): output ``x W^T + b`` and every gradient
    against FP64, small-integer operands so all are exact."""
    from megapatch.numerics.token_tree import TokenBlockedLinear

    rows = tokens * batch
    x = _small((tokens, batch, 16), 3).requires_grad_(True)
    weight = _small((4, 16), 4).requires_grad_(True)
    bias = _small((4,), 5).add_(0.5).requires_grad_(True)
    out = TokenBlockedLinear.apply(x, weight, bias, None, nb, False, torch.float32)
    expected = x.detach().double() @ weight.detach().double().t() + bias.detach().double()
    assert out.dtype == torch.float32 and torch.equal(out.double(), expected)
    grad = _small((tokens, batch, 4), 6)
    out.backward(grad)
    assert torch.equal(bias.grad.double(), grad.double().sum(dim=(0, 1)))
    assert torch.equal(weight.grad.double(), grad.double().reshape(rows, 4).t() @ x.detach().double().reshape(rows, 16))
    assert torch.equal(x.grad.double(), grad.double() @ weight.detach().double())


def test_blocks_that_do_not_divide_the_rows_are_an_error_not_dropped_rows():
    from megapatch.numerics.block_tree import slices

    assert slices(12, 4) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    with pytest.raises(ValueError, match="12 rows do not split into 8 equal blocks"):
        slices(12, 8)


# -- tp_invariant.moe_micro_batch: one sequence at a time ------------------------------------------

class _StandInMoE(torch.nn.Module):
    """Stands in for an MoE layer: ``(hidden * w + the micro-batch's mean, bias)``; the mean mixes
    the sequences, so a call on the whole micro-batch differs from per-sequence calls."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.5, -2.0, 0.25]))
        self.b = torch.nn.Parameter(torch.tensor([0.5, 0.5, 0.5]))
        self.calls = []

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        self.calls.append((tuple(hidden_states.shape), None if padding_mask is None else tuple(padding_mask.shape)))
        return hidden_states * self.w + hidden_states.mean(dim=(0, 1)), self.b


@pytest.mark.quick("tp_invariant.moe_micro_batch")
def test_an_moe_micro_batch_runs_one_sequence_at_a_time_and_each_sequence_deposits_its_own_term(invariant):
    """Under the mode, with every trainable parameter depositing into the exact sum, a micro-batch of
    3 sequences is 3 calls of one sequence (mask sliced alike), outputs concatenated along the batch;
    the first sequence's gradient goes to DDP's hook, the others' are deposited as terms of their
    own -- each equal to that sequence's gradient alone; the sequences per call are noted for the
    aux-loss scale. Without the sinks, or at one sequence, upstream's single call."""
    from megapatch.numerics import gradient_terms
    from megapatch.patches.tp_invariant import moe_micro_batch as patch

    layer = _StandInMoE()
    hidden = _small((4, 3, 3), 31).requires_grad_(False)  # [s, b, h]
    mask = torch.zeros(3, 4, dtype=torch.bool)
    plain = patch._moe_forward(layer.forward, layer, (hidden,), {"padding_mask": mask})  # no sinks yet
    assert layer.calls == [((4, 3, 3), (3, 4))] and gradient_terms.moe_sequences_per_call() == 1
    deposited = {"w": [], "b": []}
    for name, param in layer.named_parameters():
        setattr(param, gradient_terms.SEQUENCE_TERMS, deposited[name].extend)
    layer.calls.clear()
    out, bias = patch._moe_forward(layer.forward, layer, (hidden,), {"padding_mask": mask})
    assert layer.calls == [((4, 1, 3), (1, 4))] * 3 and gradient_terms.moe_sequences_per_call() == 3
    want = torch.cat([hidden[:, i:i + 1] * layer.w + hidden[:, i:i + 1].mean(dim=(0, 1)) for i in range(3)], dim=1)
    assert torch.equal(out, want) and not torch.equal(out, plain[0]) and torch.equal(bias, layer.b)
    out.sum().backward()
    per_sequence = [(hidden[:, i:i + 1]).sum(dim=(0, 1)) for i in range(3)]  # d(sum)/dw of sequence i alone
    assert torch.equal(layer.w.grad, per_sequence[0])
    # deposited as backward reaches them (any order: the exact sum is order-independent)
    assert sorted(g.tolist() for g in deposited["w"]) == sorted(s.tolist() for s in per_sequence[1:])
    layer.calls.clear()
    patch._moe_forward(layer.forward, layer, (hidden[:, :1],), {})
    assert layer.calls == [((4, 1, 3), None)] and gradient_terms.moe_sequences_per_call() == 1
