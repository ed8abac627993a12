"""Soundness cases (tests/soundness.py) about the layouts, aliases, gradient sets and special values
that reach the gated MLP: strided, offset, transposed and stride-0 (expanded) inputs and weights, one
tensor in two roles, outputs returned twice or as views, gradients asked of only some inputs,
rows of zeros / inf / nan, degenerate sizes. Each fn is spelled as models write the op; the layout
or alias is built inside fn (run() makes every floating input a leaf with a gradient). fp32 only.

Shapes: hidden 32, intermediate 48.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import Case, awkward, randn


I = 48


def _silu_mlp(g, u):
    return F.silu(g) * u


def swiglu_gate_strided_columns(x, wg2, wu):
    """gate = (x @ Wg2.T)[..., ::2] of a [2, 5, 96] projection (column stride 2), up a separate [2, 5, 48]."""
    return F.silu(F.linear(x, wg2)[..., ::2]) * F.linear(x, wu)


def swiglu_both_transposed(x, wg, wu):
    """gate and up [2, 5, 48] transposed to [5, 2, 48] (rows of stride 48 * 5 and 48): the rows do not merge."""
    return F.silu(F.linear(x, wg).transpose(0, 1)) * F.linear(x, wu).transpose(0, 1)


def swiglu_packed_chunk_of_transposed(x, wgu):
    """gate_up [2, 5, 96] transposed to [5, 2, 96], then chunk(2, -1) (Phi-3 on a time-major layout)."""
    g, u = F.linear(x, wgu).transpose(0, 1).chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu_packed_interleaved_offset(x, wbig):
    """gate_up = (x @ Wbig.T)[..., 2:98] of a [2, 5, 100] projection (storage offset 2, row stride 100), then
    gpt-oss's interleaved halves [..., ::2] / [..., 1::2] with a plain SiLU."""
    gu = F.linear(x, wbig)[..., 2:98]
    return F.silu(gu[..., ::2]) * gu[..., 1::2]


def swiglu_packed_interleaved_odd_offset(x, wbig):
    """As above from offset 1: gate_up[..., 1:97] (gate at odd storage columns)."""
    gu = F.linear(x, wbig)[..., 1:97]
    return F.silu(gu[..., ::2]) * gu[..., 1::2]


def swiglu_interleaved_explicit_end(x, wbig):
    """h [2, 5, 100]: gate h[..., 0:96:2], up h[..., 1:96:2] (explicit end short of the row)."""
    h = F.linear(x, wbig)
    return F.silu(h[..., 0:96:2]) * h[..., 1:96:2]


def swiglu_halves_of_wider(x, wbig):
    """h [2, 5, 100]: gate h[..., :48], up h[..., 48:96] (halves of the first 96 columns only)."""
    h = F.linear(x, wbig)
    return F.silu(h[..., :I]) * h[..., I:2 * I]


def swiglu_overlapping_windows(x, wbig):
    """gate h[..., 0:48] and up h[..., 8:56] of one [2, 5, 100] tensor: overlapping views; both gradients
    land in h's columns 8..47."""
    h = F.linear(x, wbig)
    return F.silu(h[..., 0:I]) * h[..., 8:8 + I]


def swiglu_gate_expanded(x, wg, wu):
    """gate [2, 1, 48] (the first position's) expanded to [2, 5, 48] (stride 0 over T), up [2, 5, 48]."""
    return F.silu(F.linear(x[:, :1], wg).expand(2, 5, I)) * F.linear(x, wu)


def swiglu_up_expanded(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x[:, :1], wu).expand(2, 5, I)


def swiglu_packed_chunk_of_input(gu):
    """gate_up [2, 5, 96] is the input itself (a leaf; no linear in the graph), chunked."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu_only_up_grad(x, wg, wu):
    """The gate projection frozen (x and Wg detached on the gate path): only dup."""
    return F.silu(F.linear(x.detach(), wg.detach())) * F.linear(x, wu)


def swiglu_only_gate_grad(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x.detach(), wu.detach())


def swiglu_frozen(x, wg, wu):
    return F.silu(F.linear(x, wg)).detach() * F.linear(x, wu).detach()


def swiglu_packed_only_up_grad(x, wgu):
    """Packed gate_up [2, 5, 96] whose gate half is detached: the gradient reaches up's half only."""
    g, u = F.linear(x, wgu).chunk(2, dim=-1)
    return F.silu(g.detach()) * u


def swiglu_output_returned_twice_and_view(x, wg, wu):
    p = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    return p, p, p[..., ::3]


def swiglu_output_scaled_in_place(x, wg, wu):
    """The product scaled in place afterwards (its backward saved act(g) and u, not the product)."""
    p = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    p[:, :2].mul_(0.5)
    return p


def swiglu_single_column(x, wg, wu):
    """I = 1: gate and up [2, 5, 1]."""
    return F.silu(F.linear(x, wg[:1])) * F.linear(x, wu[:1])


def swiglu_single_token(x, wg, wu):
    """One token: x [1, 32]."""
    return F.silu(F.linear(x[0, :1], wg)) * F.linear(x[0, :1], wu)


def swiglu_empty_batch(g, u):
    """gate, up [0, 48]."""
    return F.silu(g) * u


def swiglu_gelu_tanh_inf_nan_gate(g, u):
    """GeGLU-tanh with gates +inf, -inf, nan and +-100 in places (eager: gelu_tanh(-inf) = nan)."""
    bump = torch.zeros_like(g)
    bump[0, 0, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 100.0, -100.0], device=g.device)
    return F.gelu(g + bump, approximate="tanh") * u


def swiglu_silu_inf_nan_gate(g, u):
    bump = torch.zeros_like(g)
    bump[1, 2, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), 100.0, -100.0], device=g.device)
    return F.silu(g + bump) * u


def swiglu_relu_zero_gate(g, u):
    """ReGLU with gates exactly 0 (relu's derivative there: 0 in eager's threshold_backward)."""
    return F.relu(g * (g.abs() > 0.5)) * u


def _sep(seed, wg_rows=I, wu_rows=I):
    return lambda: (awkward(2, 5, 32, seed=seed), randn(wg_rows, 32, seed=seed + 1) * 0.4,
                    randn(wu_rows, 32, seed=seed + 2) * 0.4)


def _big(seed, rows):
    return lambda: (awkward(2, 5, 32, seed=seed), randn(rows, 32, seed=seed + 1) * 0.4)


def _gu(*shape, seed):
    return lambda: (awkward(*shape, seed=seed) * 3, randn(*shape, seed=seed + 1))


def _sw(fn, inputs, fuses):
    return Case(f"swiglu/{fn.__name__.removeprefix('swiglu_')}", fn, inputs, fuses)


SWIGLU_CASES = [
    _sw(swiglu_gate_strided_columns, _sep(3000, wg_rows=2 * I), True),
    _sw(swiglu_both_transposed, _sep(3010), True),
    _sw(swiglu_packed_chunk_of_transposed, _big(3020, 2 * I), True),
    _sw(swiglu_packed_interleaved_offset, _big(3030, 100), True),
    _sw(swiglu_packed_interleaved_odd_offset, _big(3040, 100), True),
    _sw(swiglu_interleaved_explicit_end, _big(3050, 100), True),
    _sw(swiglu_halves_of_wider, _big(3060, 100), True),
    _sw(swiglu_overlapping_windows, _big(3070, 100), True),
    _sw(swiglu_gate_expanded, _sep(3080), True),
    _sw(swiglu_up_expanded, _sep(3090), True),
    _sw(swiglu_packed_chunk_of_input, lambda: (awkward(2, 5, 2 * I, seed=3100) * 3,), True),
    _sw(swiglu_only_up_grad, _sep(3110), True),
    _sw(swiglu_only_gate_grad, _sep(3120), True),
    _sw(swiglu_frozen, _sep(3130), None),
    _sw(swiglu_packed_only_up_grad, _big(3140, 2 * I), True),
    _sw(swiglu_output_returned_twice_and_view, _sep(3150), True),
    _sw(swiglu_output_scaled_in_place, _sep(3160), True),
    _sw(swiglu_single_column, _sep(3170), True),
    _sw(swiglu_single_token, _sep(3180), True),
    _sw(swiglu_empty_batch, _gu(0, I, seed=3190), None),
    _sw(swiglu_gelu_tanh_inf_nan_gate, _gu(2, 5, I, seed=3200), True),
    _sw(swiglu_silu_inf_nan_gate, _gu(2, 5, I, seed=3210), True),
    _sw(swiglu_relu_zero_gate, _gu(2, 5, I, seed=3220), True),
]

CASES: list[Case] = SWIGLU_CASES
