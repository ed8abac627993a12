"""The loss head written as nll_loss of a log_softmax (respell.py): read as cross_entropy, so the fused
head applies, with eager's loss and gradients; left as written where the log_softmax has another reader
or is taken over another dim than the classes."""
import pytest
import torch
import torch.nn.functional as F

import fxfuse
from helpers import assert_bf16_head_within_twice_eager, compiled_parity, rel_err
from probe_spellings import head_fn

FP32_TOL = 1e-5
V = 70


class NllHead(torch.nn.Module):
    """x [B, T, H] -> lm_head -> log_softmax -> nll_loss, in the spellings training loops use."""

    def __init__(self, spelling, h=24, v=V):
        super().__init__()
        self.spelling = spelling
        self.lin = torch.nn.Linear(h, v, bias=spelling == "bias_sum")

    def forward(self, x, labels):
        z = self.lin(x)
        if self.spelling == "view":  # fairseq / classic loops: flatten the log-probs, then nll
            return F.nll_loss(F.log_softmax(z.float(), dim=-1).view(-1, V), labels.view(-1))
        if self.spelling == "softmax_dtype":  # log_softmax(..., dtype=torch.float32), ignore_index -1
            return F.nll_loss(F.log_softmax(z.flatten(0, 1), -1, dtype=torch.float32), labels.flatten(),
                              ignore_index=-1)
        if self.spelling == "class_dim_second":  # [B, T, V] log-probs -> [B, V, T] for nll_loss
            return F.nll_loss(torch.log_softmax(z, -1).transpose(1, 2), labels)
        if self.spelling == "bias_sum":
            return F.nll_loss(z.reshape(-1, V).log_softmax(-1), labels.reshape(-1), reduction="sum") / 9
        raise ValueError(self.spelling)


def _labels(ignore=-100):
    labels = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(1))
    labels[0, :2] = ignore
    return labels


@pytest.mark.parametrize("spelling,variant", [("view", "lce_hf"), ("softmax_dtype", "lce_hf"),
                                              ("class_dim_second", "lce_class_dim_second"),
                                              ("bias_sum", "lce_hf_bias")])
def test_nll_of_log_softmax_fused_with_parity(spelling, variant):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 24)
    labels = _labels(-1 if spelling == "softmax_dtype" else -100)
    loss_err, grad_err, report, names = compiled_parity(NllHead(spelling), {"x": x, "labels": labels},
                                                        loss_fn=lambda out: out)
    assert [s.variant for s in report.matched] == [variant], str(report)
    assert not report.unmatched and not report.errors, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert "lin.weight" in names


def test_nll_head_bf16_within_twice_eagers_error():
    """bf16 head, fp32 log_softmax (dtype=): loss and gradients within 2x eager bf16's error against the
    fp32 computation on the same values."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(48, 32, generator=g), 0.5 * torch.randn(96, 32, generator=g)
    t = torch.randint(0, 96, (48,), generator=g)
    t[::7] = -100

    def head(x, w, t):
        return F.nll_loss(F.log_softmax(F.linear(x, w), -1, dtype=torch.float32), t)

    assert_bf16_head_within_twice_eager(head, x, w, t)


def _log_probs_also_read(x, w, t):
    """The log-probs feed an entropy bonus too: no cross_entropy can stand for the nll alone."""
    lp = F.log_softmax(F.linear(x, w), -1)
    return F.nll_loss(lp, t) + 0.1 * (lp.exp() * lp).sum(-1).mean()


def _softmax_over_tokens(x, w, t):
    """log_softmax over dim 1 of [B, T, V] (the tokens), then the transpose nll_loss wants: the classes
    were never normalised, so this is no cross-entropy."""
    return F.nll_loss(F.log_softmax(F.linear(x, w), 1).transpose(1, 2), t)


@pytest.mark.parametrize("fn", [_log_probs_also_read, _softmax_over_tokens])
def test_nll_that_is_no_cross_entropy_is_left_as_written(fn):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g)
    w = torch.randn(V, 16, generator=g).requires_grad_()
    t = torch.randint(0, V, (2, 6) if fn is _softmax_over_tokens else (12,), generator=g)
    x = x if fn is _softmax_over_tokens else x.view(12, 16)
    n0 = len(fxfuse.compiled_reports())
    got = torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"})(x, w, t)
    (report,) = fxfuse.compiled_reports()[n0:]
    assert report.counts()["linear_cross_entropy"] == 0 and not report.errors, str(report)
    assert rel_err(got, fn(x, w, t)) < FP32_TOL
    (site,) = report.unmatched
    assert site.reason.startswith("a log_softmax of a linear layer's logits that no cross_entropy"), site.reason


def test_log_probs_gathered_at_two_tokens_per_row_are_reported():
    """Log-probs gathered at two indices per row (no cross_entropy computes that): the report names the
    head and why. One index per row is fused (tests/test_linear_cross_entropy_spellings.py)."""
    def top2_log_probs(x, w, t):
        return F.log_softmax(F.linear(x, w).float(), -1).gather(-1, t)

    report = fxfuse.explain(top2_log_probs, torch.randn(12, 16), torch.randn(V, 16), torch.randint(0, V, (12, 2)))
    assert report.counts()["linear_cross_entropy"] == 0
    (site,) = report.unmatched
    assert site.pattern == "linear_cross_entropy" and "gathered at more than" in site.reason, str(report)


@pytest.mark.parametrize("layout", ["2d", "view", "flatten"])
@pytest.mark.parametrize("transform", ["none", "scale", "divide", "softcap"])
def test_nll_of_log_softmax_fuses_with_every_head_option(layout, transform):
    """The same heads with F.nll_loss(F.log_softmax(z, -1), t) in place of F.cross_entropy (bf16, a
    bias, .float() after the transform): one fused site each, nothing unmatched."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*((16,) if layout == "2d" else (2, 8)), 16, generator=g).bfloat16().requires_grad_()
    w, b = (torch.randn(*s, generator=g).bfloat16().requires_grad_() for s in ((40, 16), (40,)))
    t = torch.randint(0, 40, (16,), generator=g)
    report = fxfuse.explain(head_fn(layout, transform, True, "after", loss="nll"), x, w, b, t)
    assert report.counts()["linear_cross_entropy"] == 1 and not report.unmatched, str(report)


def test_view_of_log_probs_of_a_transposed_head():
    """z = lm_head(x).transpose(0, 1) has strides no .view(-1, V) can take; the log_softmax's fresh output
    has. Moved before the softmax the view becomes a reshape, so the graph still compiles, with eager's
    value (the transposed head itself is no fused spelling)."""
    w = torch.randn(V, 16, requires_grad=True)

    def head(x, t):
        return F.nll_loss(F.log_softmax(F.linear(x, w).transpose(0, 1), -1).view(-1, V), t.reshape(-1))

    x, t = torch.randn(2, 8, 16), torch.randint(0, V, (8, 2))
    n0 = len(fxfuse.compiled_reports())
    got = torch.compile(head, backend="fxfuse", options={"inner": "aot_eager"})(x, t)
    (report,) = fxfuse.compiled_reports()[n0:]
    assert not report.errors, report.errors
    assert rel_err(got, head(x, t)) < FP32_TOL
