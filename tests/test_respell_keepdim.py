"""RMSNorm written with a mean (or sum) without keepdim and the dim put back later (respell.py):
fused with parity, under dynamic shapes too; left as written where the shape change would show."""
import pytest
import torch
import torch.nn as nn

import fxfuse
from helpers import bf16_errors, compiled_parity, rel_err
from test_rms_norm_graph import FP32_TOL, Block

NO_KEEPDIM = {
    "unsqueeze": lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1) + eps).unsqueeze(-1) * w,
    "none_index": lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1) + eps)[..., None] * w,
    "unsqueeze_mean": lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1).unsqueeze(-1) + eps) * w,
    "view": lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(-1) + eps).view(*x.shape[:-1], 1) * w,
    "reshape_dim_arg": lambda x, w, eps: x * torch.rsqrt(x.pow(2).mean(dim=x.dim() - 1) + eps).reshape(
        *x.shape[:-1], 1) * w,
    "sum_over_n": lambda x, w, eps: x * torch.rsqrt(x.pow(2).sum(-1) / x.shape[-1] + eps)[..., None] * w,
    "div_sqrt": lambda x, w, eps: x / torch.sqrt((x * x).mean(dim=-1) + eps).unsqueeze(-1) * w,
    "llama_upcast": lambda x, w, eps: w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1) + eps)[..., None]
                                           ).to(x.dtype),
}


@pytest.mark.parametrize("heads", [None, 3], ids=["rows", "per_head"])
@pytest.mark.parametrize("spelling", NO_KEEPDIM)
def test_no_keepdim_spellings_fused_with_parity(spelling, heads):
    torch.manual_seed(0)
    model = Block(NO_KEEPDIM[spelling], heads=heads)
    loss_err, grad_err, report, _ = compiled_parity(model, {"input_ids": torch.randint(0, 50, (2, 7))},
                                                    loss_fn=lambda out: out)
    assert report.counts()["rms_norm"] == 1, str(report)
    assert not report.unmatched, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_no_keepdim_bf16_within_twice_eagers_error():
    def make(dtype):
        torch.manual_seed(0)
        return Block(NO_KEEPDIM["llama_upcast"], heads=3).to(dtype)

    inputs = {"input_ids": torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(2))}
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, inputs, loss_fn=lambda out: out)
    assert f_loss <= 2 * e_loss + 1e-6 and f_grad <= 2 * e_grad, (e_loss, e_grad, f_loss, f_grad)


@pytest.mark.parametrize("spelling", ["none_index", "view"])
def test_no_keepdim_dynamic_one_compile(spelling):
    """dynamic=True: the view to [*x.shape[:-1], 1] has symbolic sizes; it still reads as the keepdim
    shape, every length runs the one graph, and each output equals eager's."""
    norm = NO_KEEPDIM[spelling]
    w = torch.rand(16) + 0.5
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(lambda x: norm(x, w, 1e-6), backend="fxfuse", options={"inner": "aot_eager"},
                             dynamic=True)
    for t in (5, 9, 13):
        x = torch.randn(2, t, 16)
        assert rel_err(compiled(x), norm(x, w, 1e-6)) < FP32_TOL
    reports = fxfuse.compiled_reports()[n0:]
    assert len(reports) == 1 and reports[0].counts()["rms_norm"] == 1, [str(r) for r in reports]


class _RstdReturned(nn.Module):
    """The inverse RMS without keepdim is also an output: its shape must stay [B, T]."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)
        return h * rstd[..., None], rstd


def test_reduction_with_another_reader_is_left_as_written():
    model = _RstdReturned()
    x = torch.randn(2, 5, 16)
    n0 = len(fxfuse.compiled_reports())
    out, rstd = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(x)
    ref_out, ref_rstd = model(x)
    assert rstd.shape == ref_rstd.shape == (2, 5)
    assert rel_err(out, ref_out) < FP32_TOL and rel_err(rstd, ref_rstd) < FP32_TOL
    (report,) = fxfuse.compiled_reports()[n0:]
    assert report.counts()["rms_norm"] == 0 and not report.errors, report.errors
    (site,) = report.unmatched
    assert site.reason.startswith("the mean of x^2 is taken without keepdim"), site.reason


def _broadcast_against_a_vector(x, b):
    """mean over D is [T]; + b ([T]) keeps [T]; unsqueeze(-1) -> [T, 1]. With keepdim the add would
    broadcast [T, 1] + [T] to [T, T]: not rewritten."""
    return x * torch.rsqrt(x.pow(2).mean(-1) + b).unsqueeze(-1)


def _unsqueeze_elsewhere(x, y):
    """mean over the last dim of [T, D] is [T]; unsqueeze(0) makes it a row [1, T], not the keepdim
    column [T, 1]: not rewritten."""
    return y * torch.rsqrt(x.pow(2).mean(-1) + 1e-6).unsqueeze(0)


@pytest.mark.parametrize("fn, other", [(_broadcast_against_a_vector, (7,)), (_unsqueeze_elsewhere, (3, 7))],
                         ids=["broadcast_operand", "other_dim"])
def test_shape_changing_candidates_are_left_as_written(fn, other):
    x, o = torch.randn(7, 16), torch.rand(*other) + 0.5
    n0 = len(fxfuse.compiled_reports())
    got = torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"})(x, o)
    assert got.shape == fn(x, o).shape and rel_err(got, fn(x, o)) < FP32_TOL
    (report,) = fxfuse.compiled_reports()[n0:]
    assert report.counts()["rms_norm"] == 0 and not report.errors, report.errors  # no unfused fallback
