"""Views traced against eager's layouts (fxfuse/layout.py): a rewrite that changes a layout no
longer fails the graph's compile, and views of tensors mutated in place stay views."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from fxfuse.harness import FP32_TOL
from fxfuse.layout import relax_views
from tests.helpers import compiled_parity

aten = torch.ops.aten


class _NormOnTransposedHeads(nn.Module):
    """Per-head RMSNorm (HF Llama's math) on q viewed [B, T, H, D] and transposed to [B, H, T, D],
    then transposed back, ``.contiguous()`` and viewed [B, T, H*D]. Eager's elementwise math keeps
    the transposed layout, so the trace drops the no-op contiguous and keeps a bare view; the fused
    op returns a contiguous [B, H, T, D], which that view cannot read."""

    def __init__(self, heads=4, head_dim=8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.proj = nn.Linear(heads * head_dim, heads * head_dim)
        self.weight = nn.Parameter(torch.randn(head_dim))

    def forward(self, x):
        b, t, _ = x.shape
        q = self.proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        qf = q.float()
        y = self.weight * (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(q.dtype)
        return y.transpose(1, 2).contiguous().view(b, t, -1).square().mean()


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_fused_norm_with_another_layout_than_eagers_still_compiles_fused(inner):
    torch.manual_seed(0)
    loss_err, grad_err, report, _ = compiled_parity(_NormOnTransposedHeads(), {"x": torch.randn(2, 9, 32)},
                                                    inner=inner, loss_fn=lambda out: out)
    assert report.counts()["rms_norm"] == 1 and not report.errors, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)



def test_norm_whose_output_is_viewed_back_and_written_stays_unfused_alone():
    """A norm of x.transpose(1, 2), transposed back and .view()-ed (valid on eager's layout), then
    written in place: the view must stay a view, which the fused op's contiguous output cannot give.
    That site is refused with the reason; the graph's other norm still fuses (before, the rewritten
    graph failed in the inner compiler and the whole graph compiled unfused, while explain said 1)."""
    import fxfuse

    def f(x, w, u):
        h = x.transpose(1, 2)
        z = (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))).transpose(1, 2).view(2, 4, 40)
        z.mul_(2.0)
        other = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return z, other

    g = torch.Generator().manual_seed(0)
    args = [torch.randn(2, 4, 5, 8, generator=g), torch.randn(8, generator=g), torch.randn(3, 8, generator=g)]
    report = fxfuse.explain(f, *args)
    assert report.counts()["rms_norm"] == 1 and not report.errors, str(report)
    assert any("written in place" in s.reason for s in report.unmatched if s.pattern == "rms_norm"), str(report)
    torch._dynamo.reset()
    leaves = [a.clone().requires_grad_() for a in args]
    out = torch.compile(f, backend="fxfuse", options={"inner": "aot_eager"})(*leaves)
    assert fxfuse.last_report().counts()["rms_norm"] == 1 and not fxfuse.last_report().errors
    ref = f(*[a.clone() for a in args])
    assert all(torch.allclose(o, r, rtol=1e-6, atol=1e-6) for o, r in zip(out, ref))


def test_rotation_copied_into_a_kv_cache_still_fuses():
    """The refusal above follows a non-contiguous output to in-place ops that write it or a tensor
    made from it, not to ops that only read it: k's rotation ([B, H, T, D] views of [B, T, H, D])
    index_copy_-ed into a cache buffer, as HF's StaticCache does, still fuses with q's."""
    import fxfuse

    def rot(x):
        return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)

    def f(q, k, cos, sin, cache):
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)
        qr, kr = qt * cos + rot(qt) * sin, kt * cos + rot(kt) * sin
        cache.index_copy_(2, torch.arange(2, 7), kr)
        return qr

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 4, 16, generator=g), torch.randn(2, 5, 2, 16, generator=g)
    angles = torch.randn(5, 8, generator=g).repeat(1, 2)
    cos, sin = angles.cos(), angles.sin()
    caches = [torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)]
    ref = f(q, k, cos, sin, caches[0])
    out = torch.compile(f, backend="fxfuse", options={"inner": "aot_eager"})(q, k, cos, sin, caches[1])
    report = fxfuse.last_report()
    assert report.counts()["rope"] == 1 and not report.unmatched and not report.errors, str(report)
    assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(caches[1], caches[0], atol=1e-6)

def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.target in (aten.view.default, aten.reshape.default)]


def test_views_of_mutated_tensors_stay_views():
    """x's view is added to in place (through a view of a view, and a split's piece): x's whole
    alias set keeps its views; the view of a fresh product becomes a reshape with equal values."""
    def f(x):
        a = x.view(-1).view(2, 6)
        a.add_(1)
        x.split(2)[0].mul_(2)
        b = (x * 3).view(-1)
        return a, b

    gm = make_fx(f)(torch.randn(4, 3))
    assert _targets(gm) == [aten.view.default] * 3
    assert relax_views(gm) == 1
    assert _targets(gm) == [aten.view.default, aten.view.default, aten.reshape.default]
    x = torch.randn(4, 3)
    want, got = f(x.clone()), gm(x.clone())
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_graph_without_mutation_turns_every_view():
    gm = make_fx(lambda x: (x.view(2, 6) + 1).view(-1))(torch.randn(3, 4))
    assert relax_views(gm) == 2 and _targets(gm) == [aten.reshape.default] * 2

