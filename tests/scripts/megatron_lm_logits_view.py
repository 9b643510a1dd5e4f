"""Run with a megatron-core that has PR #6252's ``ColumnParallelLinear.output_dtype`` on PYTHONPATH
(e.g. Megatron-LM main's checkout). TE's ``general_gemm`` is replaced by a CPU stand-in (FP32 out
of the BF16 operands, layout "TN"), so upstream's own FP32 path can run. Prints a JSON report:
upstream's path vs megapatch's, through megatron's vocab-parallel cross entropy and backward."""

import json

import torch

from megapatch.testing import run_ranks


def _te_gemm_stand_in(A, B, out_dtype=None, layout="TN", bias=None, **kwargs):
    assert layout == "TN" and bias is None
    return (torch.mm(B.float(), A.float().t()).to(out_dtype),)


def _body(ctx):
    import megapatch
    import megatron.core.extensions.transformer_engine as te_extension
    from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
    from megatron.core.transformer import TransformerConfig
    from megapatch.patches.logits._lm_head import lm_head

    te_extension.te_general_gemm = _te_gemm_stand_in
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=2,
                               params_dtype=torch.bfloat16, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    x = torch.randint(-8, 9, (8, 2, 64)).to(torch.bfloat16)  # exact products and sums in FP32
    target = torch.randint(0, 96, (8, 2))

    def run(output_dtype, patched):
        layer = ColumnParallelLinear(64, 96, config=config, init_method=torch.nn.init.zeros_,
                                     bias=False, gather_output=False, output_dtype=output_dtype)
        with torch.no_grad():
            layer.weight.copy_(torch.randint(-8, 9, layer.weight.shape).to(torch.bfloat16))
        inp = x.clone().requires_grad_()
        result = {"output_dtype_before": str(layer.output_dtype)}
        try:
            if patched:
                with lm_head(layer):
                    logits, _ = layer(inp)
            else:
                logits, _ = layer(inp)
            oracle = (x.float().reshape(-1, 64) @ layer.weight.detach().float().t()).reshape(8, 2, 96)
            result.update(dtype=str(logits.dtype), exact=bool(torch.equal(logits.detach(), oracle)))
            vocab_parallel_cross_entropy(logits, target).sum().backward()
            result["trained"] = inp.grad is not None and layer.weight.grad is not None
        except RuntimeError as exc:
            result["error"] = str(exc)[:200]
        result["output_dtype_after"] = str(layer.output_dtype)
        return result

    report = {"upstream_fp32": run(torch.float32, patched=False)}
    megapatch.enable(logits_dtype="fp32")
    report["megapatch_default_layer"] = run(None, patched=True)
    report["megapatch_fp32_layer"] = run(torch.float32, patched=True)
    report["backend"] = megapatch.status().patch("logits.fp32_lm_head").backend
    # a model built with logit_dtype=torch.bfloat16 (Bridge's logit_dtype, --output-logit-dtype bf16)
    from megapatch.core.errors import UnsupportedConfigurationError

    bf16_layer = ColumnParallelLinear(64, 96, config=config, init_method=torch.nn.init.zeros_,
                                      bias=False, gather_output=False, output_dtype=torch.bfloat16)
    try:
        with lm_head(bf16_layer):
            bf16_layer(x.clone())
        report["megapatch_bf16_layer"] = "not refused"
    except UnsupportedConfigurationError as refusal:
        report["megapatch_bf16_layer"] = str(refusal)
    megapatch.disable()
    return report


if __name__ == "__main__":
    print(json.dumps(run_ranks(_body, world_size=1)[0]))
