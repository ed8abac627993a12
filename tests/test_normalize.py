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
