"""numerics="eager" (the default): in a bf16 model the fused ops round where eager's ops do, so the
compiled loss and gradients follow eager's own bf16 numbers, not only an fp32 reference.
Inner aot_eager: only the fused ops differ from eager (Inductor's emulate_precision_casts is the
option's other half, checked through the config it patches)."""
import copy

import pytest
import torch

import fxfuse
from fxfuse.options import Options
from helpers import hf_model, loss_and_grads, rel_err

MODELS = ("llama", "qwen2", "gemma2")


def _inputs(vocab=512, b=2, t=64, seed=1):
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _run(model, inputs, options):
    m = copy.deepcopy(model)
    n0 = len(fxfuse.compiled_reports())
    loss, grads = loss_and_grads(m, inputs, call=torch.compile(m, backend="fxfuse", options=options))
    return loss, grads, fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])


@pytest.mark.parametrize("model_type", MODELS)
def test_bf16_follows_eager(model_type):
    """Every site fused; loss within 1e-5 and every gradient within 1e-2 of eager's own bf16 run
    (plain Inductor: 1.2e-2 to 2.1e-2 at this size); numerics="fp32" lands more than twice as far
    from eager's loss. What is left are fp32 reduction orders (RMSNorm's sum of squares, rsqrt)
    flipping a bf16 rounding now and then: the PyTorch reference path, same reductions as eager,
    matches Gemma 2 bit for bit (test_gemma2_reference_path_bit_exact)."""
    torch._dynamo.reset()
    model = hf_model(model_type, dtype=torch.bfloat16, vocab_size=512, hidden_size=128, intermediate_size=256)
    inputs = _inputs()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), inputs)
    loss, grads, report = _run(model, inputs, {"inner": "aot_eager"})
    counts = report.counts()
    assert all(counts[p] > 0 for p in ("rms_norm", "rope", "swiglu", "linear_cross_entropy")), counts
    loss_err = rel_err(loss, ref_loss)
    worst = max(rel_err(grads[k], ref_grads[k]) for k in ref_grads)
    assert loss_err < 1e-5 and worst < 1e-2, (loss_err, worst)
    torch._dynamo.reset()
    fp32_loss, _, _ = _run(model, inputs, {"inner": "aot_eager", "numerics": "fp32"})
    assert rel_err(fp32_loss, ref_loss) > 2 * loss_err


def _bf16_matmul_is_rounded_fp32() -> bool:
    """Whether this CPU's bf16 matmul returns the fp32 matmul of its inputs, rounded once (not so
    with AVX-512 / AMX bf16 dot-product kernels, which sum products in their own order)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(36, 512, generator=g).bfloat16(), torch.randn(512, 128, generator=g).bfloat16()
    return torch.equal(a @ b, (a.float() @ b.float()).bfloat16())


def test_gemma2_reference_path_bit_exact(monkeypatch):
    """Without Triton (a CPU user: the ops' PyTorch paths) Gemma 2's bf16 loss equals eager's bit for
    bit under numerics="eager", and so does every gradient with RMSNorm, RoPE and SwiGLU fused. The
    loss head's gradients are fp32 matmuls rounded once; they equal eager's bf16 matmuls bit for bit
    only where this CPU's bf16 matmul is that too (elsewhere within the bf16 bound of
    test_bf16_follows_eager)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = hf_model("gemma2", dtype=torch.bfloat16, vocab_size=512, hidden_size=128, intermediate_size=256)
    inputs = _inputs()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), inputs)
    torch._dynamo.reset()
    loss, grads, report = _run(model, inputs, {"inner": "aot_eager", "patterns": ("rms_norm", "rope", "swiglu")})
    assert report.counts()["rms_norm"] > 0 and report.counts()["swiglu"] > 0 and report.counts()["rope"] > 0
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    torch._dynamo.reset()
    loss, grads, report = _run(model, inputs, {"inner": "aot_eager"})
    assert report.counts()["linear_cross_entropy"] == 1
    assert torch.equal(loss, ref_loss)
    if _bf16_matmul_is_rounded_fp32():
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    else:
        assert max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < 1e-2


def test_fp32_model_unchanged_by_numerics():
    """In an fp32 model there is nothing to round: both settings give the same graph outputs."""
    torch._dynamo.reset()
    model = hf_model("gemma2", vocab_size=512, hidden_size=128, intermediate_size=256)
    inputs = _inputs()
    a, ga, _ = _run(model, inputs, {"inner": "aot_eager"})
    torch._dynamo.reset()
    b, gb, _ = _run(model, inputs, {"inner": "aot_eager", "numerics": "fp32"})
    assert torch.equal(a, b) and all(torch.equal(ga[k], gb[k]) for k in ga)


def test_numerics_option():
    assert Options.parse({}).numerics == "eager" and Options.parse({}).eager_rounding
    def patches(options):  # without fxfuse.reinplace's pass (tests/test_reinplace.py)
        return Options.parse({"inplace_backward": False, **options}).inductor_patches()

    assert patches({}) == {"emulate_precision_casts": True}
    assert patches({"numerics": "fp32"}) == {}
    user = patches({"inductor_config": {"emulate_precision_casts": False, "max_autotune": True}})
    assert user == {"emulate_precision_casts": False, "max_autotune": True}
    with pytest.raises(ValueError, match="numerics"):
        Options.parse({"numerics": "bf16"})


def _hf_rope(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb with rotate_half, cos/sin [B, T, D] broadcast over heads."""
    def rotate_half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("numerics", ["eager", "fp32"])
def test_bf16_rope_on_contiguous_heads_rounds_like_eager(numerics):
    """q, k contiguous [B, H, T, D] bf16 (not views of [B, T, H, D] projections): the fused rotation
    rounds each product as eager's bf16 ops do under numerics="eager", so outputs and gradients equal
    eager's bit for bit; numerics="fp32" rounds once and differs somewhere."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    b, h, t, d = 2, 4, 33, 64
    q, k = (torch.randn(b, h, t, d, generator=g).bfloat16() for _ in range(2))
    ang = torch.randn(b, t, d // 2, generator=g)
    cos, sin = (torch.cat((f(ang), f(ang)), -1).bfloat16() for f in (torch.cos, torch.sin))
    gq, gk = (torch.randn(b, h, t, d, generator=g).bfloat16() for _ in range(2))

    def run(fn):
        qq, kk = (x.clone().requires_grad_() for x in (q, k))
        oq, ok = fn(qq, kk, cos, sin)
        torch.autograd.backward((oq, ok), (gq, gk))
        return oq.detach(), ok.detach(), qq.grad, kk.grad

    n0 = len(fxfuse.compiled_reports())
    fused = run(torch.compile(_hf_rope, backend="fxfuse", options={"inner": "aot_eager", "numerics": numerics}))
    assert fxfuse.Report.merge(fxfuse.compiled_reports()[n0:]).counts()["rope"] == 1
    same = [torch.equal(a, e) for a, e in zip(fused, run(_hf_rope))]
    assert all(same) if numerics == "eager" else not all(same), same


def test_gpt_oss_clamped_swiglu_bit_exact(monkeypatch):
    """gpt-oss's clamped SwiGLU rounds like eager's seven bf16 ops under numerics="eager": with it the
    only fused pattern, the bf16 loss and every gradient equal eager's bit for bit, on the PyTorch
    reference path and on the Triton kernels (interpreter); numerics="fp32" (one rounding) does not."""
    from test_swiglu_graph import gpt_oss

    model = gpt_oss(torch.bfloat16, vocab_size=512, hidden_size=64, intermediate_size=96)
    inputs = _inputs()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), inputs)
    for path in ("triton", "reference"):
        if path == "reference":
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        torch._dynamo.reset()
        loss, grads, report = _run(model, inputs, {"inner": "aot_eager", "patterns": ("swiglu",)})
        assert report.counts()["swiglu"] == model.config.num_hidden_layers, str(report)
        assert torch.equal(loss, ref_loss), path
        assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads), path
    torch._dynamo.reset()
    _, grads, _ = _run(model, inputs, {"inner": "aot_eager", "patterns": ("swiglu",), "numerics": "fp32"})
    assert not all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
