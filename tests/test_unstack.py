"""A Python loop over the batch rows, stacked back (fxfuse/unstack.py): batched where every row is the
same expression of its row, so the per-token log-probs it computes fuse as one loss head; left as
written otherwise, with eager's values, and the report names a per-row loss head that stays."""
import pytest
import torch
import torch.nn.functional as F

import fxfuse
from helpers import rel_err

FP32_TOL = 1e-5
V, H = 50, 16


def _compiled(fn, *args):
    """fn compiled by fxfuse (aot_eager), its value and its graph's report."""
    n0 = len(fxfuse.compiled_reports())
    got = torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"})(*args)
    (report,) = fxfuse.compiled_reports()[n0:]
    return got, report


def _inputs(b: int = 3, t: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(b, t, H, generator=g), torch.randn(V, H, generator=g).requires_grad_()
    return x, w, torch.randint(0, V, (b, t), generator=g)


def trl_bf16_branch(z, t):
    """TRL's selective_log_softmax for bf16 logits, as written there."""
    per_token_logps = []
    for row_logits, row_labels in zip(z, t):
        row_logps = F.log_softmax(row_logits, dim=-1)
        per_token_logps.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(per_token_logps)


def positive_dims(z, t):
    """Rows spelled with positive dims (row [T, V]: dim 1 is the classes), and a shared [V] bias."""
    bias = torch.linspace(-1, 1, V)
    return torch.stack([torch.log_softmax(zr + bias, 1).gather(1, tr.unsqueeze(1)).squeeze(1) for zr, tr in zip(z, t)])


def logsumexp_loop(z, t):
    """TRL's fp32 branch: the logsumexp row by row, the gather batched."""
    return z.gather(-1, t[..., None]).squeeze(-1) - torch.stack([torch.logsumexp(r, dim=-1) for r in z])


@pytest.mark.parametrize("logps", [trl_bf16_branch, positive_dims, logsumexp_loop])
def test_row_loops_are_batched_and_fuse(logps):
    x, w, t = _inputs()

    def head(x, w, t):
        return -(logps(F.linear(x, w), t) * torch.arange(5.0)).mean()

    got, report = _compiled(head, x, w, t)
    assert report.counts()["linear_cross_entropy"] == 1 and not report.unmatched, str(report)
    ref = head(x, w, t)
    assert rel_err(got, ref) < FP32_TOL
    assert rel_err(torch.autograd.grad(got, w)[0], torch.autograd.grad(ref, w)[0]) < FP32_TOL


def rows_differ(z, t):
    """Each row its own temperature: no one expression of the batch."""
    return torch.stack([F.log_softmax(zr / (i + 1), -1).gather(-1, tr[:, None]).squeeze(-1)
                        for i, (zr, tr) in enumerate(zip(z, t))])


def shared_of_higher_rank(z, t):
    """A shared [2, T, V] operand against rows [T, V]: each row broadcasts to [2, T, V]; against the batch
    [B, T, V] it would not broadcast at all, so it stays a loop."""
    shift = torch.linspace(0, 1, 2 * z.shape[1] * V).view(2, z.shape[1], V)
    return torch.stack([(F.log_softmax(zr, -1) * shift).logsumexp(-1) for zr in z])


def some_rows(z, t):
    """The first rows only: no stack of every row."""
    return torch.stack([F.log_softmax(z[i], -1).gather(-1, t[i][:, None]).squeeze(-1) for i in range(2)])


def shared_expression_of_one_row(z, t):
    """exp(z[0]), computed once, read by every row: batched, it stays exp(z[0]) (not exp(z) row by row)."""
    z0 = z[0].exp()
    return torch.stack([F.log_softmax(zr - z0, -1).gather(-1, tr[:, None]).squeeze(-1) for zr, tr in zip(z, t)])


@pytest.mark.parametrize("logps", [rows_differ, shared_of_higher_rank, some_rows, shared_expression_of_one_row])
def test_loops_that_are_no_batch_are_left_as_written(logps):
    """No loss head fuses (shared_expression_of_one_row's logits are no lm_head's), and the values are
    eager's whether the loop was batched or not."""
    x, w, t = _inputs()

    def head(x, w, t):
        return logps(F.linear(x, w), t).sum()

    got, report = _compiled(head, x, w, t)
    assert report.counts()["linear_cross_entropy"] == 0 and not report.errors, str(report)
    assert rel_err(got, head(x, w, t)) < FP32_TOL


def test_per_row_loss_heads_are_reported():
    """Rows that stay a loop (rows_differ): each row's head reads the one lm_head output, so none is
    fused; the report says so and how to write the log-probs instead."""
    x, w, t = _inputs(b=2)
    report = fxfuse.explain(lambda x, w, t: rows_differ(F.linear(x, w), t), x, w, t)
    assert report.counts()["linear_cross_entropy"] == 0
    assert len(report.unmatched) == 2 and all("one row at a time" in s.reason for s in report.unmatched), str(report)
