"""SwiGLU / GeGLU end to end: every gated-MLP activation fused, parity with eager, near misses and
no false matches."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from helpers import batch, bf16_errors, compiled_parity, count_calls, hf_model, rel_err

FP32_TOL = 1e-5


def is_gated_mlp(m: nn.Module) -> bool:
    """A module whose forward computes act(gate) * up: separate or fused gate/up projections."""
    names = {n for n, _ in m.named_children()} | {n for n, _ in m.named_parameters(recurse=False)}
    return {"gate_proj", "up_proj"} <= names or "gate_up_proj" in names


@pytest.mark.parametrize("model_type,act", [("llama", "silu"), ("qwen2", "silu"), ("phi3", "silu"),
                                            ("gemma", "gelu_tanh"), ("gemma2", "gelu_tanh"), ("bitnet", "relu2")])
def test_hf_gated_mlps_fused(model_type, act):
    model = hf_model(model_type)
    inputs = batch()
    expected = count_calls(model, is_gated_mlp, **inputs)
    loss_err, grad_err, report, names = compiled_parity(model, inputs)
    assert report.counts()["swiglu"] == expected, str(report)
    assert not [s for s in report.unmatched if s.pattern == "swiglu"], str(report)
    assert all(s.module.endswith("mlp") or s.module.endswith("act_fn") for s in report.matched if s.pattern == "swiglu")
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert any("gate" in n for n in names)


def test_phi3_fused_gate_up_chunk_is_matched_in_swapped_order():
    report = fxfuse.explain(hf_model("phi3", num_hidden_layers=1), **batch())
    (site,) = [s for s in report.matched if s.pattern == "swiglu"]
    assert site.variant == "swiglu_silu" and site.module.startswith("model.layers.0.mlp")


def test_mixtral_experts_fused_where_the_graph_exposes_them():
    model = hf_model("mixtral", num_local_experts=4, num_experts_per_tok=2)
    inputs = batch()
    loss_err, grad_err, report, _ = compiled_parity(model, inputs)
    sites = [s for s in report.matched if s.pattern == "swiglu"]
    # the expert loop is data dependent: Dynamo compiles its body once per layer and reuses it for
    # every expert; each compiled body holds one fused activation
    assert len(sites) == model.config.num_hidden_layers, str(report)
    assert all(".experts" in s.module for s in sites)
    assert not [s for s in report.unmatched if s.pattern == "swiglu"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


class HandMLP(nn.Module):
    """A hand-written model: SiLU spelled x * sigmoid(x), gate and up from one linear's halves."""

    def __init__(self, d=24, hidden=40, spelling="sigmoid"):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.spelling = spelling

    def forward(self, input_ids):
        g, u = self.gate_up(self.emb(input_ids)).split(self.gate_up.out_features // 2, dim=-1)
        if self.spelling == "sigmoid":
            h = g * torch.sigmoid(g) * u
        elif self.spelling == "up_first":
            h = u * F.silu(g)
        elif self.spelling == "relu":
            h = F.relu(g) * u
        elif self.spelling == "relu_pow":
            h = F.relu(g).pow(2) * u
        elif self.spelling == "silu_definition":  # x / (1 + exp(-x))
            h = u * (g / (1 + torch.exp(-g)))
        elif self.spelling == "gelu_new":  # HF NewGELUActivation, as T5's gated-gelu writes it
            h = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0)))) * u
        elif self.spelling == "relu_self_mul":
            r = torch.relu(g)
            h = u * (r * r)
        else:
            h = F.gelu(g) * u
        return self.down(h).pow(2).mean()


@pytest.mark.parametrize("spelling,variant", [("sigmoid", "swiglu_sigmoid"), ("up_first", "swiglu_silu"),
                                              ("gelu", "geglu"), ("relu", "reglu"),
                                              ("gelu_new", "geglu_gelu_new_t5"),
                                              ("relu_pow", "reglu_squared_bitnet"),
                                              ("relu_self_mul", "reglu_squared_bitnet"),
                                              ("silu_definition", "swiglu_sigmoid")])
def test_hand_written_spellings(spelling, variant):
    torch.manual_seed(0)
    model = HandMLP(spelling=spelling)
    loss_err, grad_err, report, _ = compiled_parity(model, {"input_ids": torch.randint(0, 50, (2, 7))},
                                                    loss_fn=lambda out: out)
    assert [s.variant for s in report.matched] == [variant]
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


def _mt5(dtype=torch.float32):
    """mT5 from a tiny config: T5's LayerNorm (an RMSNorm) and its gated-gelu MLP (wi_0, wi_1: HF's
    gelu_new, the tanh GELU written out), encoder and decoder."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    cfg = AutoConfig.for_model("mt5", vocab_size=96, d_model=32, d_ff=48, d_kv=8, num_layers=2, num_heads=4,
                               dropout_rate=0.0, relative_attention_num_buckets=8, decoder_start_token_id=0)
    torch.manual_seed(0)
    return AutoModelForSeq2SeqLM.from_config(cfg).to(dtype)


def test_t5_gated_gelu_fused_with_parity():
    model, inputs = _mt5(), batch()
    expected = count_calls(model, lambda m: hasattr(m, "wi_0"), **inputs)
    loss_err, grad_err, report, _ = compiled_parity(model, inputs)
    assert expected == 4 and report.counts()["swiglu"] == expected, str(report)
    assert {s.variant for s in report.matched if s.pattern == "swiglu"} == {"geglu_gelu_new_t5"}
    assert report.counts()["rms_norm"] == 12  # T5LayerNorm: 2 per encoder, 3 per decoder layer, 2 final
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(_mt5, inputs, patterns=["swiglu"])
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


class ActUsedTwice(nn.Module):
    """Near miss: the activation output also feeds a second branch."""

    def __init__(self, d=16):
        super().__init__()
        self.g, self.u = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        a = F.silu(self.g(x))
        return (a * self.u(x)).sum() + a.sum()


def test_near_miss_silu_definition_reported():
    """x / (1 + exp(-x)) * up whose activation also feeds a second branch: a candidate, unmatched
    with the reason (before the canonical view read it as x * sigmoid(x) it was not even a candidate)."""
    g, u = torch.randn(3, 16), torch.randn(3, 16)

    def fn(g, u):
        a = g / (1 + torch.exp(-g))
        return (a * u).sum() + a.sum()

    report = fxfuse.explain(fn, g, u)
    assert report.counts()["swiglu"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "swiglu"]
    assert "also used outside" in site.reason, site.reason


def test_near_miss_reassociated_silu_reported():
    """gate * (sigmoid(gate) * up) is left unfused (another rounding order than the fused op's), with
    the reason; before, it was not even a candidate and the report said nothing."""
    g, u = torch.randn(3, 16), torch.randn(3, 16)
    report = fxfuse.explain(lambda g, u: g * (torch.sigmoid(g) * u), g, u)
    assert report.counts()["swiglu"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "swiglu"]
    assert "reassociated" in site.reason, site.reason


def test_near_miss_activation_used_elsewhere():
    model = ActUsedTwice()
    x = torch.randn(3, 16)
    report = fxfuse.explain(model, x)
    assert report.counts()["swiglu"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "swiglu"]
    assert "also used outside" in site.reason
    out = torch.compile(model, backend="fxfuse", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)


@pytest.mark.parametrize("model_type,overrides", [("gpt_neox", {"intermediate_size": 64, "rotary_pct": 0.25}),
                                                  ("nanochat", {})], ids=["gelu", "relu2_ungated"])
def test_no_false_match_on_plain_mlp(model_type, overrides):
    """An ungated MLP (GPT-NeoX's gelu, nanochat's relu(x)^2) is no site and no candidate."""
    model = hf_model(model_type, **overrides)
    report = fxfuse.explain(model, **batch())
    assert report.counts()["swiglu"] == 0
    assert not [s for s in report.unmatched if s.pattern == "swiglu"]


@pytest.mark.parametrize("alpha", [1.0, 1.702], ids=["silu_written_out", "quick_gelu"])
def test_written_out_activation_of_an_ungated_mlp_is_no_candidate(alpha):
    """x * sigmoid(alpha * x) between two linears (CLIP's quick_gelu in LLaVA's vision tower, a SiLU
    written out) is a plain activation: no site, and not reported as a gated-MLP near miss."""
    fc1, fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def mlp(x):
        h = fc1(x)
        return fc2(h * torch.sigmoid(alpha * h) if alpha != 1.0 else h * torch.sigmoid(h)).sum()

    report = fxfuse.explain(mlp, torch.randn(4, 8))
    assert report.counts()["swiglu"] == 0
    assert not [s for s in report.unmatched if s.pattern == "swiglu"], str(report)


def test_broadcast_product_is_not_a_gated_mlp():
    class Broadcast(nn.Module):
        def forward(self, g, u):
            return F.silu(g) * u

    report = fxfuse.explain(Broadcast(), torch.randn(4, 8), torch.randn(1, 8))
    assert report.counts()["swiglu"] == 0
    assert "differ in shape" in report.unmatched[0].reason


def gpt_oss(dtype=torch.float32, **overrides) -> nn.Module:
    """A tiny gpt-oss (fxfuse.zoo's config: 4 experts, top 2) with random weights."""
    from transformers import AutoModelForCausalLM

    from fxfuse.zoo import hf_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config("gpt_oss", **overrides)).to(dtype)


def test_gpt_oss_clamped_swiglu_fused():
    """gpt-oss's experts (HF GptOssExperts._apply_gate on gate_up[..., ::2] / [..., 1::2]): one
    fused clamped SwiGLU per layer, fp32 parity of the loss and every gradient."""
    model = gpt_oss()
    loss_err, grad_err, report, _ = compiled_parity(model, batch())
    sites = [s for s in report.matched if s.pattern == "swiglu"]
    assert len(sites) == model.config.num_hidden_layers, str(report)
    assert all(s.variant == "swiglu_clamped_gpt_oss" and s.module.endswith("mlp.experts") for s in sites)
    assert not [s for s in report.unmatched if s.pattern == "swiglu"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


class ClampedGLU(nn.Module):
    """A hand-written gpt-oss MLP: interleaved gate_up with a bias, values well past the clamps."""

    def __init__(self, d=24, hidden=40, alpha=1.702, limit=1.5, low=None):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.gate_up = nn.Linear(d, 2 * hidden)
        self.down = nn.Linear(hidden, d)
        nn.init.normal_(self.gate_up.weight, std=0.6)
        self.alpha, self.limit, self.low = alpha, limit, -limit if low is None else low

    def forward(self, input_ids):
        gate_up = self.gate_up(self.emb(input_ids))
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=self.low, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        return self.down((up + 1) * glu).pow(2).mean()


def test_hand_written_clamped_glu():
    torch.manual_seed(0)
    model = ClampedGLU()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        gate_up = model.gate_up(model.emb(ids))
    assert (gate_up[..., ::2] > model.limit).any() and (gate_up[..., 1::2].abs() > model.limit).any()
    loss_err, grad_err, report, _ = compiled_parity(model, {"input_ids": ids}, loss_fn=lambda out: out)
    assert [s.variant for s in report.matched] == ["swiglu_clamped_gpt_oss"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_near_miss_asymmetric_up_clamp():
    """up clamped to [-1, 1.5] with the gate at max 1.5: not the op's [-limit, limit]; reported, and
    the graph still computes the model's own values."""
    torch.manual_seed(0)
    model = ClampedGLU(low=-1.0)
    ids = torch.randint(0, 50, (2, 7))
    report = fxfuse.explain(model, ids)
    assert report.counts()["swiglu"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "swiglu"]
    assert "[-1.0, 1.5]" in site.reason, site.reason
    out = torch.compile(model, backend="fxfuse", options={"inner": "eager"})(ids)
    torch.testing.assert_close(out, model(ids), rtol=0, atol=0)


class UnclampedScaledGLU(ClampedGLU):
    """gate * sigmoid(1.702 * gate) * up with no clamps and no `up + 1`: a gated quick-GELU that no
    fused kernel computes."""

    def forward(self, input_ids):
        gate_up = self.gate_up(self.emb(input_ids))
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return self.down(gate * torch.sigmoid(gate * self.alpha) * up).pow(2).mean()


def test_unclamped_scaled_gate_is_reported():
    torch.manual_seed(0)
    model = UnclampedScaledGLU()
    ids = torch.randint(0, 50, (2, 7))
    report = fxfuse.explain(model, ids)
    assert report.counts()["swiglu"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "swiglu"]
    assert "gpt-oss's clamped form" in site.reason, site.reason


def _inkling(gate_cap=20.0, up_cap=30.0, upcast=True):
    def mlp(gate, up):
        dtype = gate.dtype
        if upcast:
            gate, up = gate.float(), up.float()
        return (torch.tanh(gate / gate_cap) * gate_cap * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)).to(dtype)
    return mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcapped_swiglu_inkling2_fused_with_parity(dtype):
    """Inkling 2's softcapped SwiGLU (fp32 math after .float()) becomes fxfuse::softcapped_swiglu: the
    output and both gradients match eager in fp32 (< 1e-5); in bf16 they are no further from an fp64
    run than 2x eager's own bf16 result."""
    torch.manual_seed(0)
    g, u = (torch.randn(3, 7, 40) * 8 for _ in range(2))
    mlp = _inkling()

    def fn(g, u):
        return (mlp(g, u).float() * torch.linspace(-1, 1, 40)).sum()

    def run(call, dt):
        a, b = (t.to(dt).requires_grad_() for t in (g, u))
        out = call(a, b)
        out.backward()
        return out.detach(), a.grad, b.grad

    ref = run(fn, torch.float64 if dtype != torch.float32 else dtype)
    base = run(fn, dtype)
    torch._dynamo.reset()
    got = run(torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"}), dtype)
    report = fxfuse.last_report()
    assert [s.variant for s in report.matched] == ["swiglu_softcapped_inkling2"], str(report)
    for x, e, r in zip(got, base, ref):
        assert rel_err(x, r) < 1e-5 if dtype == torch.float32 else rel_err(x, r) <= 2 * rel_err(e, r)


def test_softcapped_swiglu_without_upcast_is_reported():
    """The same gate computed in bf16 (no .float()): eager rounds after every op, the fp32 kernel would
    not; unmatched with that reason."""
    report = fxfuse.explain(lambda g, u: _inkling(upcast=False)(g, u).sum(),
                            *(torch.randn(3, 16, dtype=torch.bfloat16) for _ in range(2)))
    assert report.counts()["swiglu"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "swiglu"]
    assert "computed in torch.bfloat16" in site.reason, site.reason


def test_other_transformed_gate_is_reported():
    """A softcapped gate times an uncapped up, c * tanh(gate / c) * sigmoid(gate) * up, is no spelling
    a fused kernel computes: reported unmatched with the reason, not passed over silently."""
    def mlp(gate, up):
        return (torch.tanh(gate / 20.0) * 20.0 * torch.sigmoid(gate) * up).sum()

    report = fxfuse.explain(mlp, torch.randn(3, 16), torch.randn(3, 16))
    assert report.counts()["swiglu"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "swiglu"]
    assert "not in Inkling 2's softcapped form" in site.reason, site.reason
