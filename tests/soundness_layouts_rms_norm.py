"""Soundness cases (tests/soundness.py) about the layouts, aliases, gradient sets and special values
that reach RMSNorm: strided, offset, transposed and stride-0 (expanded) inputs and weights, one
tensor in two roles, outputs returned twice or as views, gradients asked of only some inputs,
rows of zeros / inf / nan, degenerate sizes. Each fn is spelled as models write the op; the layout
or alias is built inside fn (run() makes every floating input a leaf with a gradient). fp32 only.

Shapes: hidden D = 32 (rows of a few tokens), eps 1e-6.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import Case, awkward, randn

D = 32
EPS = 1e-6


def _llama(h, w, eps=EPS):
    """HF LlamaRMSNorm.forward (fp32: the casts are no-ops)."""
    dtype = h.dtype
    hf = h.to(torch.float32)
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _plain(h, w, eps=EPS):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_strided_channels(x, w):
    """x [2, 5, 64]: the even channels x[..., ::2] (column stride 2) normalised, w [32]."""
    return _llama(x[..., ::2], w)


def rms_narrow_offset(x, w):
    """x [2, 5, 64]: channels 5..36 (storage offset 5, row stride 64)."""
    return _llama(x.narrow(-1, 5, D), w)


def rms_overlapping_windows(x, w):
    """x [41] unfolded into 10 overlapping rows of 32 (strides (1, 1)): a sliding window normalised per row;
    each element's gradient sums over the windows that read it."""
    return _llama(x.unfold(0, D, 1), w)


def rms_odd_width_strided(x, w):
    """x [2, 5, 66]: x[..., 1::2], 33 channels (not a power of two) at stride 2, offset 1."""
    return _llama(x[..., 1::2], w)


def rms_prenorm_block_time_major(x, w, wq, wk):
    """A pre-norm block on a time-major residual stream: x [5, 2, 32] transposed to [2, 5, 32] (not contiguous),
    h = x + q(n) + k(n), n = norm(x) (under Inductor the residual add folds into the norm's backward)."""
    r = x.transpose(0, 1)
    n = _llama(r, w)
    return r + F.linear(n, wq) + F.linear(n, wk)


def rms_expanded_rows(x, w):
    """x [2, 1, 32] expanded to [2, 5, 32] (stride 0 over T): five copies of each row; dx sums them."""
    return _llama(x.expand(2, 5, D), w)


def rms_weight_row_of_param(x, p):
    """p [3, 32] (a stacked parameter): the norm's weight is row 1 (offset 32)."""
    return _llama(x, p[1])


def rms_weight_column_of_param(x, p):
    """p [32, 3]: the weight is column 2 (stride 3, offset 2); its gradient lands in p's column."""
    return _llama(x, p[:, 2])


def rms_weight_strided(x, p):
    """p [64]: the weight p[1::2] (stride 2, offset 1)."""
    return _plain(x, p[1::2])


def rms_weight_expanded_scalar(x, s):
    """s [1] (one learned gain) expanded to a [32] weight: stride 0; its gradient is the sum over D."""
    return _plain(x, s.expand(D))


def rms_weight_t_t(x, p):
    """p [1, 32]: w = p.t().t()[0] (two transposes, a view of p)."""
    return _llama(x, p.t().t()[0])


def rms_qkv_split_qk_norm(x, wqkv, wq, wk):
    """Qwen3 on a packed projection: qkv = x @ Wqkv.T [2, 5, 64] split [32, 16, 16]; q viewed [2, 5, 4, 8]
    and k [2, 5, 2, 8] (rows of stride 64, not contiguous) each normalised over their 8 head dims."""
    q, k, v = F.linear(x, wqkv).split([32, 16, 16], dim=-1)
    return _llama(q.view(2, 5, 4, 8), wq), _llama(k.view(2, 5, 2, 8), wk), v


def rms_bhtd_as_bthd(x, w):
    """x [2, 4, 5, 8] (B, H, T, D) transposed to [B, T, H, D] without .contiguous(), normalised over D,
    then merged to [2, 5, 32] as o_proj's input: (eager's output keeps the transposed layout)."""
    y = _llama(x.transpose(1, 2), w)
    return y.reshape(2, 5, 32)


def rms_bthd_view_back(x, w):
    """x [2, 4, 5, 8]: norm of x.transpose(1, 2) then transposed back and viewed [2, 4, 40]: a view eager's
    layout allows (the output of the elementwise math keeps x's memory order)."""
    y = _llama(x.transpose(1, 2), w)
    return y.transpose(1, 2).view(2, 4, 40)


def rms_view_back_then_scaled_in_place(x, w):
    """As rms_bthd_view_back, the view then scaled in place (a mutated alias keeps the view a view)."""
    y = _llama(x.transpose(1, 2), w)
    z = y.transpose(1, 2).view(2, 4, 40)
    z.mul_(2.0)
    return z


def rms_input_also_returned(x, w):
    """The residual stream returned next to its norm (a pre-norm block's two outputs)."""
    return _llama(x, w), x


def rms_output_returned_twice(x, w):
    y = _llama(x, w)
    return y, y


def rms_output_and_views(x, w):
    """The output, a slice of it and a reshape of it: three outputs sharing one storage."""
    y = _llama(x, w)
    return y, y[..., :8], y.view(10, D)


def rms_output_scaled_in_place(x, w):
    """The norm's output written in place afterwards (y.mul_: a mul's backward saves its inputs, not y)."""
    y = _plain(x, w)
    y[:, 1:3].mul_(3.0)
    return y


def rms_shared_weight_two_norms(x, w):
    """One weight for two norms of x's halves along T: dw is the sum of both sites' partial sums."""
    return _llama(x[:, :2], w), _llama(x[:, 2:], w)


def rms_same_input_two_eps(x, w):
    """One x normalised twice with different eps (two sites on one input)."""
    return _llama(x, w, 1e-6), _llama(x, w, 1e-2)


def rms_norm_of_norm(x, w):
    """Two chained norms (the second's input is the first fused op's output)."""
    return _llama(_llama(x, w), w.flip(0))


def rms_only_weight_grad(x, w):
    """x frozen (detached), w learned: only dw."""
    return _llama(x.detach(), w)


def rms_only_x_grad(x, w):
    """w frozen: only dx."""
    return _llama(x, w.detach())


def rms_frozen(x, w):
    """Neither requires grad (an eval-mode / frozen tower inside a trained graph): no backward."""
    return _llama(x.detach(), w.detach())


def rms_zero_rows(x, w):
    """Rows 1 and 7 of the [10, 32] rows are all zeros: mean 0, rsqrt(eps) = 1000."""
    keep = torch.ones(2, 5, 1, device=x.device)
    keep[0, 1] = 0.0
    keep[1, 2] = 0.0
    return _llama(x * keep, w)


def rms_inf_in_one_row(x, w):
    """One element +inf (row [0, 3]): eager's row is nan at the inf, 0 elsewhere (x * rsqrt(inf) = x * 0)."""
    bump = torch.zeros(2, 5, D, device=x.device)
    bump[0, 3, 7] = float("inf")
    return _llama(x + bump, w)


def rms_nan_in_one_row(x, w):
    """One element nan (row [1, 0]): that row nan, the others untouched."""
    bump = torch.zeros(2, 5, D, device=x.device)
    bump[1, 0, 4] = float("nan")
    return _llama(x + bump, w)


def rms_huge_eps(x, w):
    """eps = 1e3: larger than every row's mean square (the output is ~ x / 31.6)."""
    return _llama(x, w, 1e3)


def rms_eps_zero(x, w):
    """eps = 0 (written + 0.0), every row nonzero: x / rms(x)."""
    return _plain(x, w, 0.0)


def rms_single_column(x, w):
    """D = 1: x [2, 5, 1], w [1]: y = x / sqrt(x^2 + eps) * w (a sign with a soft edge)."""
    return _llama(x, w)


def rms_single_row(x, w):
    """x [1, 32]: one row."""
    return _llama(x, w)


def rms_t1(x, w):
    """x [2, 1, 32]: one position (decode)."""
    return _llama(x, w)


def rms_empty_batch(x, w):
    """x [0, 5, 32]: a batch of size 0."""
    return _llama(x, w)


def rms_fp64(x, w):
    """fp64 x and w, no casts: no fused op computes fp64 (it must stay unfused and exact)."""
    return _plain(x, w)


def rms_fp64_llama_casts(x, w):
    """fp64 x and w through Llama's spelling: the norm itself runs in fp32 (h.to(float32)), the weight
    multiply in fp64; the fp32 part may fuse (as a weightless norm)."""
    return _llama(x, w)


def rms_functional_eps_zero(x, w):
    """F.rms_norm(..., eps=0.0), every row nonzero."""
    return F.rms_norm(x, (D,), w, eps=0.0)


def _xw(*shape, seed=11, dtype=torch.float32):
    return lambda: (awkward(*shape, seed=seed, dtype=dtype), (randn(shape[-1], seed=seed + 1) + 1).to(dtype))


def _xp(xshape, pshape, seed):
    return lambda: (awkward(*xshape, seed=seed), randn(*pshape, seed=seed + 1) + 1)


def _rms(fn, inputs, fuses):
    return Case(f"rms_norm/{fn.__name__.removeprefix('rms_')}", fn, inputs, fuses)


RMS_CASES = [
    _rms(rms_strided_channels, _xp((2, 5, 64), (D,), 1000), True),
    _rms(rms_narrow_offset, _xp((2, 5, 64), (D,), 1010), True),
    _rms(rms_expanded_rows, _xp((2, 1, D), (D,), 1020), True),
    _rms(rms_overlapping_windows, lambda: (randn(41, seed=1021), randn(D, seed=1022) + 1),
         True),
    _rms(rms_odd_width_strided, _xp((2, 5, 66), (33,), 1023), True),
    _rms(rms_prenorm_block_time_major, lambda: (awkward(5, 2, D, seed=1024), randn(D, seed=1025) + 1,
                                                randn(D, D, seed=1026) * D ** -0.5, randn(D, D, seed=1027) * D ** -0.5),
         True),
    _rms(rms_weight_row_of_param, _xp((2, 5, D), (3, D), 1030), True),
    _rms(rms_weight_column_of_param, _xp((2, 5, D), (D, 3), 1040), True),
    _rms(rms_weight_strided, _xp((2, 5, D), (2 * D,), 1050), True),
    _rms(rms_weight_expanded_scalar, _xp((2, 5, D), (1,), 1060), True),
    _rms(rms_weight_t_t, _xp((2, 5, D), (1, D), 1070), True),
    _rms(rms_qkv_split_qk_norm, lambda: (awkward(2, 5, D, seed=1080), randn(64, D, seed=1081) * D ** -0.5,
                                         randn(8, seed=1082) + 1, randn(8, seed=1083) + 1), True),
    _rms(rms_bhtd_as_bthd, _xp((2, 4, 5, 8), (8,), 1090), True),
    _rms(rms_bthd_view_back, _xp((2, 4, 5, 8), (8,), 1100), True),
    _rms(rms_view_back_then_scaled_in_place, _xp((2, 4, 5, 8), (8,), 1110), None),
    _rms(rms_input_also_returned, _xw(2, 5, D, seed=1120), True),
    _rms(rms_output_returned_twice, _xw(2, 5, D, seed=1130), True),
    _rms(rms_output_and_views, _xw(2, 5, D, seed=1140), True),
    _rms(rms_output_scaled_in_place, _xw(2, 5, D, seed=1150), True),
    _rms(rms_shared_weight_two_norms, _xw(2, 5, D, seed=1160), True),
    _rms(rms_same_input_two_eps, _xw(2, 5, D, seed=1170), True),
    _rms(rms_norm_of_norm, _xw(2, 5, D, seed=1180), True),
    _rms(rms_only_weight_grad, _xw(2, 5, D, seed=1190), True),
    _rms(rms_only_x_grad, _xw(2, 5, D, seed=1200), True),
    _rms(rms_frozen, _xw(2, 5, D, seed=1210), True),
    _rms(rms_zero_rows, _xw(2, 5, D, seed=1220), True),
    _rms(rms_inf_in_one_row, _xw(2, 5, D, seed=1230), True),
    _rms(rms_nan_in_one_row, _xw(2, 5, D, seed=1240), True),
    _rms(rms_huge_eps, _xw(2, 5, D, seed=1250), True),
    _rms(rms_eps_zero, _xw(2, 5, D, seed=1260), None),
    _rms(rms_single_column, _xw(2, 5, 1, seed=1270), True),
    _rms(rms_single_row, _xw(1, D, seed=1280), True),
    _rms(rms_t1, _xw(2, 1, D, seed=1290), True),
    _rms(rms_empty_batch, _xw(0, 5, D, seed=1300), None),
    _rms(rms_fp64, _xw(2, 5, D, seed=1310, dtype=torch.float64), False),
    _rms(rms_fp64_llama_casts, _xw(2, 5, D, seed=1320, dtype=torch.float64), None),
    _rms(rms_functional_eps_zero, _xw(2, 5, D, seed=1330), True),
]

CASES: list[Case] = RMS_CASES
