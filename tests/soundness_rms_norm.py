"""RMSNorm soundness cases (tests/soundness.py): the spellings models use, which must fuse, and
look-alikes changed in one detail, which must keep eager's value (most must not fuse at all).

x is [2, 5, 32] (rows of very different scale: awkward(), so eps matters), w is [32]; the eps is
1e-6 unless a case is about it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import Case, awkward, randn

D = 32
EPS = 1e-6


def _xw():
    return awkward(2, 5, D, seed=11), randn(D, seed=12) + 1


def llama(x, w):
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def gemma(x, w):
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).type_as(x)


def offset_two(x, w):
    """(2 + w): an offset other than Gemma's 1 is still a weight of (offset + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (2.0 + w)


def one_minus_w(x, w):
    """(1 - w): not (offset + w), but a [D] tensor, so the fused op's weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 - w)


def sum_over_d(x, w):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) / D + EPS) * w


def sum_times_inverse_d(x, w):
    return x * (torch.square(x).sum(-1, keepdim=True) * (1.0 / D) + EPS) ** -0.5 * w


def functional(x, w):
    return F.rms_norm(x, (D,), w, EPS)


def module_default_eps(x, w):
    """torch.nn.RMSNorm's eps=None: fp32's machine epsilon."""
    return F.rms_norm(x, (D,), w)


def per_head(x, w):
    """Qwen3's q / k norm: x [2, 5, 32] viewed as [2, 5, 4, 8] heads, w [8]."""
    h = x.view(2, 5, 4, 8)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w[:8]


def transposed_input(x, w):
    """The norm of a transposed view: rows are x's dim 1 here, [2, 32, 5] -> normalised over 5."""
    h = x.transpose(1, 2)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w[:5]


def bias_after(x, w):
    """RMSNorm then a bias add (the add stays outside the fused op)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w + w.flip(0)


def no_keepdim_unsqueezed(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1) + EPS).unsqueeze(-1) * w


def no_keepdim_wrong_axis(x, w):
    """x [2, 32, 32]: the mean over the last dim put back at dim 1 scales column j by row j's
    statistic. A broadcast, not a norm."""
    return x * torch.rsqrt(x.pow(2).mean(-1) + EPS).unsqueeze(1) * w


def no_keepdim_viewed_back(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1) + EPS).view(2, 5, 1) * w


def sum_over_d_plus_one(x, w):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / (D + 1) + EPS) * w


def mean_over_rows(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + EPS) * w


def mean_over_two_dims(x, w):
    return x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + EPS) * w


def two_dim_functional(x, w):
    """F.rms_norm over the last two dims, weight [5, 32]."""
    return F.rms_norm(x, (5, D), w.expand(5, D) * 1.0, EPS)


def eps_outside_root(x, w):
    return x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + EPS) * w


def no_eps(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w


def eps_tensor(x, w):
    """eps read from a tensor (a buffer): not a constant."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + w[:1].abs() * 1e-3) * w


def root_not_inverse(x, w):
    return x * torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def quarter_power(x, w):
    return x * (x.pow(2).mean(-1, keepdim=True) + EPS) ** -0.25 * w


def abs_not_square(x, w):
    return x * torch.rsqrt(x.abs().mean(-1, keepdim=True) + EPS) * w


def cube_not_square(x, w):
    return x * torch.rsqrt(x.pow(3).abs().mean(-1, keepdim=True) + EPS) * w


def square_of_another(x, w):
    """The statistic of x + 1, applied to x."""
    z = x + 1.0
    return x * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + EPS) * w


def numerator_another(x, w):
    """x's statistic applied to 2 * x - 1."""
    return (2 * x - 1) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def product_of_two(x, w):
    """mean(x * y) with y another tensor: no square."""
    y = x.flip(-1)
    return x * torch.rsqrt((x * y).abs().mean(-1, keepdim=True) + EPS) * w


def centred_variance(x, w):
    """torch.var (centred): a LayerNorm's statistic, not RMSNorm's."""
    return x * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + EPS) * w


def per_row_weight(x, w):
    """weight [5, 32]: one per row, not one per channel; the norm fuses, the multiply stays outside."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * torch.outer(w[:5], w)


def weight_over_rows(x, w):
    """weight [5, 1], broadcast over the channels: the norm fuses, the multiply stays outside."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w[:5, None]


def rounded_to_bf16(x, w):
    """An fp32 model whose input is rounded to bf16 and back first: the round trip is no no-op cast
    (the norm reads the rounded x). (Rounding the norm's output instead made any last-bit difference
    between two correct fp32 norms a bf16 step: 1.4e-3 under Inductor on CUDA.)"""
    h = x.to(torch.bfloat16).float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w


def statistic_returned(x, w):
    """rstd is also an output: it must stay written (reported as a near miss)."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x * r * w, r


def l2norm_fla(x, w):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + EPS)


def l2_normalize(x, w):
    """F.normalize: x / max(||x||, eps), the eps a clamp, not under the root."""
    return F.normalize(x, dim=-1, eps=1e-3) * w


def l2_norm_method(x, w):
    return x / x.norm(dim=-1, keepdim=True) * w


def statistic_detached(x, w):
    """Stop-gradient statistics: no gradient through the mean square (RMSNorm's has one)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).detach() + EPS) * w


def statistic_under_no_grad(x, w):
    with torch.no_grad():
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return x * r * w


def norm_under_no_grad(x, w):
    """The whole norm under no_grad, its weight applied outside: the norm may fuse (no gradient)."""
    with torch.no_grad():
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return h * w


def global_mean(x, w):
    """The mean square of the whole tensor (no dim): one statistic for every row."""
    return x * torch.rsqrt(x.pow(2).mean() + EPS) * w


def mean_dim_list(x, w):
    return x * torch.rsqrt(x.pow(2).mean(dim=[-1], keepdim=True) + EPS) * w


def rows_2d(x, w):
    """[10, 32] rows, the batch flattened first (torchtitan's norm on flattened tokens)."""
    h = x.flatten(0, 1)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w


def one_row(x, w):
    """A 1-D x [32]: its own row (the global mean is the row's)."""
    h = x[0, 0]
    return h * torch.rsqrt(h.pow(2).mean() + EPS) * w


def view_written_before(x, w):
    """h written through a view before the norm: the norm reads the written h, not x * 1.0's x."""
    h = x * 1.0
    h[..., :16].mul_(2.0)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w


def rows_written_before(x, w):
    h = x * 1.0
    h.view(10, D)[3:5].mul_(0.01)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * w


def written_between_reads(x, w):
    """The statistic read before a write to h, the product after it (no gradient through h: eager's
    own backward would refuse the write)."""
    h = x.detach() * 2.0
    ms = h.pow(2).mean(-1, keepdim=True)
    h[..., :16].mul_(3.0)
    return h * torch.rsqrt(ms + EPS) * w


def weight_written_between(x, w):
    """The weight's copy written after the norm, before the weight multiply: the norm alone fuses."""
    w2 = w * 1.0
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    w2[:4].zero_()
    return y * w2


def prenorm_block(x, w, wq, wk, wv):
    """h = x + q(n) + k(n) * v(n), n = norm(x): under Inductor the residual add and the sum of the
    branch gradients fold into the norm's backward (fxfuse/fold_add.py)."""
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w
    return x + F.linear(n, wq) + F.linear(n, wk) * F.linear(n, wv)


def _block():
    return (*_xw(), *(randn(D, D, seed=s) * D ** -0.5 for s in (15, 16, 17)))


def _square():
    return awkward(2, D, D, seed=14), randn(D, seed=12) + 1


def _case(fn, fuses):
    inputs = {no_keepdim_wrong_axis: _square, prenorm_block: _block}.get(fn, _xw)
    return Case(f"rms_norm/{fn.__name__}", fn, inputs, fuses)


CASES = [
    *(_case(fn, True) for fn in (llama, gemma, offset_two, sum_over_d, sum_times_inverse_d, functional,
                                 module_default_eps, per_head, transposed_input, bias_after,
                                 no_keepdim_unsqueezed, no_keepdim_viewed_back, l2norm_fla, one_minus_w,
                                 per_row_weight, weight_over_rows, rounded_to_bf16, mean_dim_list, rows_2d,
                                 view_written_before, rows_written_before, weight_written_between,
                                 prenorm_block)),
    *(_case(fn, False) for fn in (no_keepdim_wrong_axis, sum_over_d_plus_one, mean_over_rows,
                                  mean_over_two_dims, two_dim_functional, eps_outside_root, eps_tensor,
                                  root_not_inverse, quarter_power, abs_not_square, cube_not_square,
                                  square_of_another, numerator_another, product_of_two, centred_variance,
                                  statistic_returned, l2_normalize, statistic_detached,
                                  statistic_under_no_grad, global_mean, written_between_reads)),
    *(_case(fn, None) for fn in (no_eps, l2_norm_method, norm_under_no_grad, one_row)),
]
