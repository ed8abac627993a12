"""normalize.py's re-trace of Dynamo's graph: spellings it unifies (torch's alias ops) and what make_fx
alone would get wrong (``p.data``), end to end through the backend, with parity against eager."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.normalize import _ALIASES, _unaliased
from helpers import compiled_parity, loss_and_grads, rel_err

FP32_TOL = 1e-5


def _plain_ops():
    return dict(mul=torch.mul, div=torch.div, cat=torch.cat, neg=torch.neg, sigmoid=torch.sigmoid)


def _alias_ops():  # the names JAX / NumPy ports use (Gemma 3n gates with torch.multiply)
    return dict(mul=torch.multiply, div=torch.divide, cat=torch.concat, neg=torch.negative,
                sigmoid=torch.special.expit)


class Block(nn.Module):
    """RMSNorm (x / sqrt), RoPE (rotate_half), causal attention, a SwiGLU (x * sigmoid(x)) and a GeGLU,
    every product, quotient, cat and negation spelled through ``ops``."""

    def __init__(self, ops, d=32, heads=4, hidden=40, vocab=50, t=7):
        super().__init__()
        self.o, self.heads = ops, heads
        self.emb = nn.Embedding(vocab, d)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.gate2, self.up2 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        hd = d // heads
        freqs = torch.outer(torch.arange(t).float(), 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))
        emb = torch.cat((freqs, freqs), dim=-1)[None, None]  # [1, 1, T, hd]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def rotate(self, x):  # HF's apply_rotary_pos_emb
        o, half = self.o, x.shape[-1] // 2
        rotated = o["cat"]((o["neg"](x[..., half:]), x[..., :half]), dim=-1)
        return o["mul"](x, self.cos) + o["mul"](rotated, self.sin)

    def forward(self, input_ids):
        o = self.o
        xf = self.emb(input_ids).float()
        h = o["mul"](self.w, o["div"](xf, torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)))
        b, t, d = h.shape
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(self.rotate(q), self.rotate(k), v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(b, t, d)
        g = self.gate(h)
        mlp = o["mul"](o["mul"](g, o["sigmoid"](g)), self.up(h))
        mlp = mlp + o["mul"](F.gelu(self.gate2(h), approximate="tanh"), self.up2(h))
        return self.down(mlp).pow(2).mean()


def test_alias_ops_match_as_their_plain_spelling():
    inputs = {"input_ids": torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))}
    results = {}
    for name, ops in (("plain", _plain_ops()), ("aliases", _alias_ops())):
        torch.manual_seed(0)
        loss_err, grad_err, report, _ = compiled_parity(Block(ops), inputs, loss_fn=lambda out: out)
        assert loss_err < FP32_TOL and grad_err < FP32_TOL, (name, loss_err, grad_err)
        results[name] = sorted((s.pattern, s.variant) for s in report.matched)
    assert results["plain"] == [("rms_norm", "rmsnorm_llama"), ("rope", "rope_rotate_half"),
                                ("swiglu", "geglu_tanh"), ("swiglu", "swiglu_sigmoid")], results
    assert results["aliases"] == results["plain"]


@pytest.mark.parametrize("alias", sorted(_ALIASES))
def test_every_alias_maps_to_an_op_with_its_arguments(alias):
    packet = getattr(torch.ops.aten, alias)
    mapped = {o: _unaliased(getattr(packet, o)) for o in packet.overloads()}
    functional = [o for o in mapped if "out" not in o and o != "names"]
    assert functional and all(mapped[o] is not None for o in functional), mapped
    for o in functional:
        assert mapped[o].name().split("::")[1].split(".")[0] == _ALIASES[alias]
    assert _unaliased(torch.ops.aten.mul.Tensor) is None  # canonical ops stay


class ClampsInForward(nn.Module):
    """Gemma 3n's AltUp: ``coefs.weight.data.clamp_()`` inside forward, then the clamped weight used."""

    def __init__(self, d=16, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.coefs = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.coefs.weight.mul_(8)  # most entries beyond the clip

    def forward(self, input_ids):
        self.coefs.weight.data.clamp_(-0.2, 0.2)
        xf = self.emb(input_ids).float()
        h = self.w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
        return self.coefs(h).pow(2).mean()


def test_data_mutation_in_forward_is_fused_and_applied():
    inputs = {"input_ids": torch.randint(0, 50, (2, 7))}
    torch.manual_seed(0)
    model = ClampsInForward()
    eager, mine = copy.deepcopy(model), copy.deepcopy(model)
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(mine, backend="fxfuse", options={"inner": "aot_eager"})
    for step in range(2):  # the second call clamps the weights as they are then, not as traced
        ref_loss, ref_grads = loss_and_grads(eager, inputs, loss_fn=lambda out: out)
        loss, grads = loss_and_grads(mine, inputs, loss_fn=lambda out: out, call=compiled)
        assert rel_err(loss, ref_loss) < FP32_TOL
        assert max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < FP32_TOL
        assert torch.equal(mine.coefs.weight, eager.coefs.weight)
        assert mine.coefs.weight.abs().max() <= 0.2
        for m in (eager, mine):
            m.coefs.weight.data.mul_(4)
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    assert report.counts()["rms_norm"] == 1 and not report.errors, str(report)
    with torch.no_grad():  # inference: the same in-place update, with no autograd around it
        torch._dynamo.reset()
        out = torch.compile(mine, backend="fxfuse", options={"inner": "aot_eager"})(**inputs)
        assert rel_err(out, eager(**inputs)) < FP32_TOL
        assert torch.equal(mine.coefs.weight, eager.coefs.weight)
    assert fxfuse.last_report().counts()["rms_norm"] == 1 and not fxfuse.last_report().errors


class ReadsData(nn.Module):
    """``a.data`` read in forward: a scale that takes no gradient along that path."""

    def __init__(self, d=16, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.a = nn.Parameter(torch.randn(d))
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, input_ids):
        xf = self.emb(input_ids).float() * self.a.data
        h = self.w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
        return (h * self.a).pow(2).mean()


def test_data_read_in_forward_takes_no_gradient():
    inputs = {"input_ids": torch.randint(0, 50, (2, 7))}
    torch.manual_seed(0)
    model = ReadsData()
    loss_err, grad_err, report, names = compiled_parity(model, inputs, loss_fn=lambda out: out)
    assert report.counts()["rms_norm"] == 1 and not report.errors, str(report)
    assert "a" in names and loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    before = compiled(**inputs).detach()
    model.a.data.mul_(3)  # read at run time, not baked into the graph
    assert rel_err(compiled(**inputs).detach(), model(**inputs).detach()) < FP32_TOL
    assert not torch.allclose(before, model(**inputs).detach())


class InPlaceSpellings(nn.Module):
    """An RMSNorm whose weight multiplies in place, and SwiGLUs written in place three ways
    (``F.silu(g, inplace=True) * u``, ``a = F.silu(g); a.mul_(u)``, ``u.mul_(F.silu(g))``), a buffer
    counter bumped in place (an input: kept), and a write to a view (kept: the view's base reads it)."""

    def __init__(self, d=16, hidden=24, vocab=50):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(d))
        self.g, self.u = nn.ModuleList(nn.Linear(d, hidden, bias=False) for _ in range(3)), nn.ModuleList(
            nn.Linear(d, hidden, bias=False) for _ in range(3))
        self.down = nn.Linear(hidden, d, bias=False)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, input_ids):
        self.calls += 1
        x = self.emb(input_ids)
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        h.mul_(self.w)
        a = F.silu(self.g[0](h), inplace=True) * self.u[0](h)
        b = F.silu(self.g[1](h))
        b.mul_(self.u[1](h))
        c = self.u[2](h)
        c.mul_(F.silu(self.g[2](h)))
        out = self.down(a + b + c)
        out[..., :4].mul_(0.5)  # a view of out written: out stays as written
        return out.pow(2).mean()


class ClampsUnderNoGrad(nn.Module):
    """A write under no_grad to an activation that requires grad: eager leaves it out of the autograd
    history (the gradient flows as through an identity); written out of place its result would have
    no history at all and the first linear no gradient."""

    def __init__(self, d=8):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            h.clamp_(-0.1, 0.1)
        return self.b(h).pow(2).sum()


def test_a_write_under_no_grad_stays_in_place():
    torch.manual_seed(0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss_err, grad_err, _, names = compiled_parity(ClampsUnderNoGrad(), {"x": x}, loss_fn=lambda out: out)
    assert "a.weight" in names and loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_in_place_spellings_fuse_with_parity(inner):
    torch.manual_seed(0)
    model = InPlaceSpellings()
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    loss_err, grad_err, report, _ = compiled_parity(model, {"input_ids": ids}, inner=inner, loss_fn=lambda out: out)
    assert report.counts() == {"rms_norm": 1, "rope": 0, "swiglu": 3, "linear_cross_entropy": 0}, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_in_place_writes_that_stay_as_written():
    """What canonical_inplace leaves alone: a write to a graph input, one that would change the
    written tensor's dtype (in place keeps it; out of place promotes), random in-place ops."""
    from fxfuse.normalize import _functional, canonical_inplace

    assert _functional(torch.ops.aten.silu_.default) is torch.ops.aten.silu.default
    assert _functional(torch.ops.aten.mul_.Tensor) is torch.ops.aten.mul.Tensor
    assert _functional(torch.ops.aten.exponential_.default) is None  # random: as written
    assert _functional(torch.ops.aten.set_.source_Tensor) is None  # an alias of its source afterwards
    assert _functional(torch.ops.aten.resize_.default) is None
    assert _functional(torch.ops.aten.mul.Tensor) is None and _functional(torch.ops.aten.transpose_.default) is None

    def f(x, y):
        x.add_(1.0)  # an input
        a = torch.sin(y)  # bf16
        a.mul_(torch.ones(3, dtype=torch.float32))  # stays bf16 in place; a * fp32 would be fp32
        b = torch.cos(y)
        b.mul_(2.0)  # fresh, same dtype: becomes aten.mul
        return a, b

    def g(h, u):  # in an autocast region: exp_ stays (autocast runs exp in fp32), mul_ becomes mul
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = h @ u
            a.exp_()
            b = h @ u
            b.mul_(2.0)  # bf16 either way (b.mul_(u) would stay: u is fp32, b * u promotes)
            return a, b

    def traced_targets(fn, *args):
        gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake", pre_dispatch=True)(*args)
        canonical_inplace(gm.graph)
        return [n.target for n in gm.graph.nodes if n.op == "call_function"]

    targets = traced_targets(g, torch.randn(3, 3), torch.randn(3, 3))
    assert torch.ops.aten.exp_.default in targets and torch.ops.aten.exp.default not in targets
    assert torch.ops.aten.mul.Tensor in targets and torch.ops.aten.mul_.Tensor not in targets

    x, y = torch.zeros(3), torch.randn(3).to(torch.bfloat16)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(x, y)
    canonical_inplace(gm.graph)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.add_.Tensor in targets and torch.ops.aten.mul_.Tensor in targets
    assert torch.ops.aten.mul.Tensor in targets  # b's write, out of place now
    gm.recompile()
    a, b = gm(torch.zeros(3), y)
    ref = f(torch.zeros(3), y)
    assert a.dtype == torch.bfloat16 and torch.equal(a, ref[0]) and torch.equal(b, ref[1])


def test_a_cast_repeated_on_one_tensor_becomes_one():
    """canonical_casts: ``q.float()`` twice reads as one cast, but not across an in-place write to q (the
    second cast sees the new values) nor across a grad-mode switch."""
    from fxfuse.normalize import canonical_casts

    def twice(q):
        return q.float() * 2 + q.float().sin()

    def written_between(q):
        a = q.float()
        q.mul_(2)
        return a + q.float()

    def no_grad_between(q):
        a = q.float()
        with torch.no_grad():
            b = q.float()
        return a + b

    def casts(fn):
        gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode="fake", pre_dispatch=True)(
            torch.randn(3, dtype=torch.bfloat16))
        canonical_casts(gm.graph)
        gm.recompile()
        q = torch.randn(3, dtype=torch.bfloat16)
        torch.testing.assert_close(gm(q.clone()), fn(q.clone()), rtol=0, atol=0)
        return sum(n.target == torch.ops.aten.to.dtype for n in gm.graph.nodes)

    assert casts(twice) == 1
    assert casts(written_between) == 2
    assert casts(no_grad_between) == 2
