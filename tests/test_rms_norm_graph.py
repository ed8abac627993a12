"""RMSNorm end to end: every spelling is matched in real and hand-written models, and the compiled
model's loss and gradients equal eager's."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from helpers import batch, bf16_errors, compiled_parity, count_calls, hf_model, is_rms_norm, rel_err

FP32_TOL = 1e-5
HF_TYPES = ["llama", "mistral", "qwen2", "phi3", "gemma", "qwen3"]


@pytest.mark.parametrize("model_type", HF_TYPES)
def test_hf_models_every_rmsnorm_fused(model_type):
    model = hf_model(model_type)
    inputs = batch()
    expected = count_calls(model, is_rms_norm, **inputs)
    loss_err, grad_err, report, names = compiled_parity(model, inputs)
    assert report.counts()["rms_norm"] == expected
    assert not [s for s in report.unmatched if s.pattern == "rms_norm"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert any("norm" in n for n in names)  # norm weights are among the compared gradients


def test_llama_through_inductor():
    model = hf_model("llama")
    inputs = batch()
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, inner="inductor")
    assert report.counts()["rms_norm"] == count_calls(model, is_rms_norm, **inputs)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


def test_report_names_modules_and_sources():
    model = hf_model("llama", num_hidden_layers=1)
    report = fxfuse.explain(model, **batch())
    sites = [s for s in report.matched if s.pattern == "rms_norm"]
    modules = sorted(s.module for s in sites)
    assert modules == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"]
    assert all(s.variant == "rmsnorm_llama" and s.source.startswith("modeling_llama.py:") for s in sites)
    assert all(s.saved_tensors for s in sites)


# Hand-written spellings. Each takes (x [..., D], w [D], eps) and returns the normalised x.
def _llama(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


SPELLINGS = {
    "pow_mean_rsqrt": lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w,
    "x_times_x": lambda x, w, eps: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w,
    "sum_over_n": lambda x, w, eps: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps) * w,
    "sum_times_inv_n": lambda x, w, eps: x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) * (1.0 / x.shape[-1])
                                                         + eps) * w,
    "div_sqrt": lambda x, w, eps: x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w,
    "one_over_sqrt": lambda x, w, eps: x * (1.0 / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w,
    "reciprocal_sqrt": lambda x, w, eps: w * (x * torch.reciprocal(torch.sqrt((x * x).mean(-1, keepdim=True) + eps))),
    "pow_minus_half": lambda x, w, eps: x * (x.pow(2).mean(-1, keepdim=True) + eps) ** -0.5 * w,
    "div_pow_half": lambda x, w, eps: x / (x.pow(2).mean(-1, keepdim=True) + eps) ** 0.5 * w,
    "weight_first": lambda x, w, eps: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)),
    "llama_upcast": _llama,
    "gemma_one_plus_w": lambda x, w, eps: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
                                           * (1.0 + w.float())).type_as(x),
    "F_rms_norm": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w, eps),
    "F_rms_norm_default_eps": lambda x, w, eps: F.rms_norm(x, (x.shape[-1],), w),
    "no_weight": lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps),
}


class Block(nn.Module):
    """embed -> linear -> norm (optionally per head on [B, T, H, D]) -> linear; loss = mean square."""

    def __init__(self, norm, d=24, heads=None, vocab=50):
        super().__init__()
        self.norm, self.heads = norm, heads
        self.emb = nn.Embedding(vocab, d)
        self.inp = nn.Linear(d, d)
        nd = d // heads if heads else d
        self.w = nn.Parameter(1 + 0.1 * torch.randn(nd))
        self.out = nn.Linear(d, d)

    def forward(self, input_ids, labels=None):
        h = self.inp(self.emb(input_ids))
        if self.heads:
            b, t, d = h.shape
            h = self.norm(h.view(b, t, self.heads, d // self.heads), self.w, 1e-5).reshape(b, t, d)
        else:
            h = self.norm(h, self.w, 1e-5)
        return self.out(h).pow(2).mean()


@pytest.mark.parametrize("heads", [None, 3], ids=["rows", "per_head"])
@pytest.mark.parametrize("spelling", SPELLINGS)
def test_spellings_matched_with_parity(spelling, heads):
    torch.manual_seed(0)
    model = Block(SPELLINGS[spelling], heads=heads)
    inputs = {"input_ids": torch.randint(0, 50, (2, 7))}
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, loss_fn=lambda out: out)
    assert report.counts()["rms_norm"] == 1, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_torch_nn_rmsnorm_module():
    model = nn.Sequential(nn.Embedding(50, 16), nn.RMSNorm(16), nn.Linear(16, 4), nn.RMSNorm(4, eps=1e-3))
    # not out.square().sum(): the squares of a normalised row sum to ~its width whatever the input,
    # so every gradient before the last norm is a cancellation left over from eps
    mix = torch.tensor([1.0, -2.0, 0.5, 3.0])
    loss_err, grad_err, report, _ = compiled_parity(
        model, {"input": torch.randint(0, 50, (3, 5))}, loss_fn=lambda out: (out * mix).sum())
    assert report.counts()["rms_norm"] == 2
    assert {s.variant for s in report.matched} == {"rmsnorm_torch"}
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


class SharedIntermediate(nn.Module):
    """Near misses: an intermediate of the norm is also used after it, so it must stay written.
    "normed": Llama-style in bf16, the fp32 normalised x feeds a second output;
    "variance": the mean of squares feeds a second output."""

    def __init__(self, shared: str, d=16):
        super().__init__()
        self.shared = shared
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.float()
        variance = h.pow(2).mean(-1, keepdim=True)
        normed = h * torch.rsqrt(variance + 1e-6)
        out = self.w * normed.to(x.dtype)
        side = normed if self.shared == "normed" else variance
        return out.float().sum() + side.sum()


@pytest.mark.parametrize("shared,dtype", [("normed", torch.bfloat16), ("variance", torch.float32)])
def test_near_miss_reported_with_reason(shared, dtype):
    model = SharedIntermediate(shared).to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    report = fxfuse.explain(model, x)
    (site,) = [s for s in report.unmatched if s.pattern == "rms_norm"]
    assert "also used outside" in site.reason, site.reason
    if shared == "normed":  # the weightless norm of the fp32 x is still a whole RMSNorm: fused
        assert [s.variant for s in report.matched] == ["rmsnorm_no_weight"]
        assert "smaller spelling inside it was fused" in site.reason
    else:
        assert report.counts()["rms_norm"] == 0
    # still correct when compiled: the site stays unfused
    out = torch.compile(model, backend="fxfuse", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


@pytest.mark.parametrize("inverse", ["div_sqrt", "one_over_sqrt"])
def test_near_miss_without_rsqrt_is_reported(inverse):
    """A spelling with no rsqrt op (x / sqrt(v), x * (1 / sqrt(v))) whose variance is used elsewhere
    is still a candidate: reported unmatched with the reason, not passed over silently."""
    def norm(x, w):
        v = x.pow(2).mean(-1, keepdim=True) + 1e-6
        y = x / torch.sqrt(v) if inverse == "div_sqrt" else x * (1.0 / torch.sqrt(v))
        return (w * y).sum() + v.sum()

    report = fxfuse.explain(norm, torch.randn(4, 16), torch.randn(16))
    assert report.counts()["rms_norm"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "rms_norm"]
    assert "also used outside" in site.reason, site.reason


# L2 norms with eps under the root, each (x [..., D], w [D], eps) -> l2norm(x) * w (w scales after, as
# nGPT's learned scales do; it is no part of the fused call)
L2_SPELLINGS = {
    "fla_rsqrt": lambda x, w, eps: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps) * w,
    "kimi_div_sqrt": lambda x, w, eps: x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps) * w,
    "ngpt_fp32": lambda x, w, eps: (x.float() * torch.rsqrt(x.float().pow(2).sum(-1, keepdim=True) + eps)
                                    ).type_as(x) * w,
}


@pytest.mark.parametrize("spelling,heads,inner", [
    *[(s, h, "aot_eager") for s in L2_SPELLINGS for h in (None, 3)], ("fla_rsqrt", 3, "inductor")])
def test_l2_norm_fused_as_rms_norm_with_parity(spelling, heads, inner):
    """x * rsqrt(sum(x^2) + eps) (linear attention's q / k l2norm, nGPT) is an RMSNorm of eps / D times
    1 / sqrt(D) (a constant weight built in the graph): one fused call, the loss and every gradient equal
    to eager's."""
    torch.manual_seed(0)
    model = Block(L2_SPELLINGS[spelling], heads=heads)
    inputs = {"input_ids": torch.randint(0, 50, (2, 7))}
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, inner=inner, loss_fn=lambda out: out)
    assert report.counts()["rms_norm"] == 1, str(report)
    assert report.matched[0].variant.startswith("l2norm_"), report.matched[0].variant
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.parametrize("spelling", ["fla_rsqrt", "ngpt_fp32"])
def test_l2_norm_bf16_within_twice_eagers_error(spelling):
    """In bf16 (FLA's form: every step rounded to bf16 in eager) the fused call is no further from an
    fp32 reference than 2x eager bf16's own distance."""
    def make(dtype):
        torch.manual_seed(0)
        return Block(L2_SPELLINGS[spelling], heads=3).to(dtype)

    inputs = {"input_ids": torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(2))}
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, inputs, loss_fn=lambda out: out)
    assert f_loss <= 2 * e_loss + 1e-6 and f_grad <= 2 * e_grad, (e_loss, e_grad, f_loss, f_grad)


def test_l2_norm_over_another_dim_is_reported_as_such():
    """eps under the root, but the sum runs over dim 1 of [B, T, D]: no variant, and the reason does not
    claim the eps is missing (as it does for x / ||x||)."""
    report = fxfuse.explain(lambda x: x * torch.rsqrt((x * x).sum(1, keepdim=True) + 1e-6), torch.randn(2, 5, 8))
    assert report.counts()["rms_norm"] == 0
    (site,) = report.unmatched
    assert site.reason.startswith("an L2 norm with eps under the root, written in a way no l2norm"), site.reason
    report = fxfuse.explain(lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True)), torch.randn(2, 5, 8))
    (site,) = report.unmatched
    assert "with no eps under the root" in site.reason, site.reason


def test_l2_norm_over_a_symbolic_dim_is_reported():
    """With the normalised dim dynamic, the 1 / sqrt(D) weight has no value to build: unfused, reported."""
    def fn(x):
        return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).sum()

    x = torch.randn(4, 16, requires_grad=True)
    torch._dynamo.mark_dynamic(x, 1)
    n0 = len(fxfuse.compiled_reports())
    torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"})(x).backward()
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    assert report.counts()["rms_norm"] == 0
    (site,) = report.unmatched
    assert site.reason.startswith("an L2 norm over a symbolic dim"), site.reason
    assert torch.allclose(x.grad, torch.func.grad(fn)(x.detach()), rtol=1e-5, atol=1e-7)


NORM_DIVIDED_FORMS = {  # (x [..., D]) -> x divided by a root of its squares that is no RMSNorm; reason prefix
    "paper_reference": (lambda x: x / (x.norm(2, dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + 1e-8),
                        "eps added to the root"),
    "mean_root_plus_eps": (lambda x: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6), "eps added to the root"),
    "normalize_sqrt_d": (lambda x: F.normalize(x, dim=-1) * x.shape[-1] ** 0.5, "an L2 normalisation, F.normalize"),
    "vector_norm": (lambda x: x / torch.linalg.vector_norm(x, dim=-1, keepdim=True), "an L2 norm"),
}


@pytest.mark.parametrize("form", NORM_DIVIDED_FORMS)
def test_norm_dividing_its_source_is_reported(form):
    """Hand-written norms that divide x by a root of its squares but are another function than
    x * rsqrt(mean(x^2) + eps) (eps outside the root, F.normalize's floor on the norm, the plain L2
    norm) were no candidates at all, so the report said nothing; they are now near misses with the
    reason. ``x / (mean(x^2) + eps) ** 0.5`` next to them fuses (``** 0.5`` reads as sqrt)."""
    fn, reason = NORM_DIVIDED_FORMS[form]

    def model(x, w):
        return (fn(x) * w).sum() + (x / (x.pow(2).mean(-1, keepdim=True) + 1e-6) ** 0.5 * w).sum()

    report = fxfuse.explain(model, torch.randn(4, 16), torch.randn(16))
    assert report.counts()["rms_norm"] == 1, str(report)
    (site,) = [s for s in report.unmatched if s.pattern == "rms_norm"]
    assert site.reason.startswith(reason), site.reason


@pytest.mark.parametrize("variance", ["var_biased", "var_correction"])
def test_layer_norm_written_out_is_no_candidate(variance):
    """xLSTM's multi-head LayerNorm, ``(x - mean) * rsqrt(x.var(unbiased=False) + eps)``, is a LayerNorm:
    not an RMSNorm candidate, so not reported as a near miss either. (Written as the mean of the centred
    square, it is an RMSNorm of x - mean: refused with a reason, test_layer_norm_rms_part_is_refused.)"""
    def ln(x):
        xc = x - x.mean(-1, keepdim=True)
        v = {"var_biased": lambda: x.var(dim=-1, keepdim=True, unbiased=False),
             "var_correction": lambda: torch.var(x, dim=-1, keepdim=True, correction=0)}[variance]()
        return (xc * torch.rsqrt(v + 1e-5)).sum()

    report = fxfuse.explain(ln, torch.randn(4, 16))
    assert report.counts()["rms_norm"] == 0 and not [s for s in report.unmatched if s.pattern == "rms_norm"]


@pytest.mark.parametrize("upcast", [False, True])
def test_layer_norm_rms_part_is_refused(upcast):
    """I-BERT's IntLayerNorm: ``y = x - mean(x); y / sqrt(eps + mean(y^2)) * w + b``. Its RMS part is an
    RMSNorm of y, but fused alone it would write y and split the LayerNorm Inductor fuses whole: refused,
    with the reason. An RMSNorm of a difference that is no centring (a residual) still fuses."""
    w, b = torch.randn(16), torch.randn(16)

    def ln(x, r):
        xf = x.float() if upcast else x
        y = xf - xf.mean(-1, keepdim=True)
        layer = (y / torch.sqrt(1e-5 + y.pow(2).mean(-1, keepdim=True)) * w + b).sum()
        d = x - r
        return layer + (d * torch.rsqrt(d.pow(2).mean(-1, keepdim=True) + 1e-6) * w).sum()

    report = fxfuse.explain(ln, torch.randn(4, 16), torch.randn(4, 16))
    assert report.counts()["rms_norm"] == 1, str(report)
    (site,) = [s for s in report.unmatched if s.pattern == "rms_norm"]
    assert site.reason.startswith("the RMS part of a LayerNorm written out"), site.reason


def test_ibert_layer_norms_are_not_fused():
    from fxfuse.zoo import check_hf

    r = check_hf("ibert", bf16_steps=0, task="masked-lm")
    assert r.matched["rms_norm"] == 0 and r.expected["rms_norm"] == 0 and r.parity_ok, (r.matched, r.expected)
    assert any(reason.startswith("the RMS part of a LayerNorm") for reason in r.reasons["rms_norm"]), r.reasons


def test_eps_floored_under_the_root_is_reported():
    """Gemma 3n's AltUp magnitude matching, ``x * target / sqrt(mean(x^2).clamp(min=1e-5))``: a floor, not
    an eps added under the root, so no RMSNorm; the report names the clamp."""
    def altup(x, target):
        return x * target / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))

    report = fxfuse.explain(altup, torch.randn(4, 16), torch.randn(4, 1))
    assert report.counts()["rms_norm"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "rms_norm"]
    assert site.reason.startswith("eps as a floor under the root"), site.reason


def test_inverse_rms_scaling_another_tensor_is_reported():
    """DeepSeek-V4 / HY-V4 hyper-connections multiply a matmul of x by x's inverse RMS: there is no
    normalized x to fuse, and the report says so; x * rsqrt(...) next to it still fuses."""
    fn = torch.randn(4, 16)

    def mixes(x):
        inv = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (F.linear(x, fn) * inv).sum() + normed.sum()

    report = fxfuse.explain(mixes, torch.randn(3, 16))
    assert report.counts()["rms_norm"] == 1
    (site,) = [s for s in report.unmatched if s.pattern == "rms_norm"]
    assert site.reason.startswith("the inverse RMS of x is not multiplied into x"), site.reason


def test_eps_computed_in_the_graph_is_specialised_with_a_guard():
    """Under dynamic=True a Python float argument becomes a graph input: eps is then a value in the
    graph, not a literal (it once matched as if absent and was lowered with the default eps). It is
    now read from its symbol with a guard: the norm fuses with the call's eps, a new eps compiles a
    new graph, a repeated one reuses its graph; every output equals eager's (small x, so eps matters)."""
    from torch._dynamo.utils import counters

    def f(x, w, eps):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    counters.clear()  # unique_graphs counts every test's compiles otherwise
    x, w = 0.01 * torch.randn(3, 16), torch.rand(16) + 0.5
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(f, backend="fxfuse", options={"inner": "aot_eager"}, dynamic=True)
    graphs = []
    for eps in (1e-3, 0.5, 1e-3):
        assert rel_err(compiled(x, w, eps), f(x, w, eps)) < 1e-6, eps
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 2], graphs
    reports = fxfuse.compiled_reports()[n0:]
    assert reports and all(r.counts()["rms_norm"] == 1 for r in reports if r.matched or r.unmatched)


class _TypeAsAfterNorm(nn.Module):
    """A norm's output used only as the dtype reference of a later type_as (NanoChat's
    ``_norm(x.float()).type_as(x)`` on a fused value): in fp32 ``x.float()`` is a no-op cast of the
    fused output and ``type_as(y, x.float())`` takes its dtype only, its value is y's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        h = self.lin(x).float()
        a = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w  # fused
        af = a.float()  # fp32: a no-op cast of the fused output
        return (af * 3.0 + af.pow(2)).type_as(af).sum()


def test_type_as_reference_of_a_fused_output_keeps_its_own_value():
    """Regression: the rewrite rerouted users of no-op casts of a fused output to the fused value,
    including a type_as that only reads the cast as its dtype reference, which silently dropped
    the computation in between (NanoChat's q/k norms after RoPE lost their normalisation)."""
    torch.manual_seed(0)
    model = _TypeAsAfterNorm()
    loss_err, grad_err, report, _ = compiled_parity(model, {"x": torch.randn(3, 5, 16)}, loss_fn=lambda out: out)
    assert report.counts()["rms_norm"] == 1, str(report)
    assert loss_err < 1e-6 and grad_err < 1e-5, (loss_err, grad_err)
