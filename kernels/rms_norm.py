"""RMSNorm as one fused op: ``torch.ops.fxfuse.rms_norm`` (+ ``fxfuse::rms_norm_backward``).

Shapes: x [..., D] viewed as [M, D] (M = product of the leading dims); weight [D] or None.

Forward, per row (all math in fp32 registers, one pass over x):
    xf   = float32(x)                                   [M, D]
    rstd = 1 / sqrt(sum(xf * xf) / D + eps)             [M]
    xhat = xf * rstd                                    [M, D]
    w'   = float32(weight) + offset  (1 if weight None) [D]
    cast_before_weight=True  (HF Llama/Mistral/Qwen2/Phi-3, ``w * (xf * rstd).to(x.dtype)``):
        out = to_out_dtype(float32(to_x_dtype(xhat)) * w')
    cast_before_weight=False (Gemma ``(xf * rstd * (1 + w.float())).type_as(x)``, GPT-OSS):
        out = to_out_dtype(xhat * w')

Backward (rstd is recomputed from x: the backward kernel reads the whole row of x anyway, so
this costs a reduction in registers and saves an [M] buffer and an extra op output; the
to_x_dtype rounding of the cast_before_weight path is treated as identity, as autograd does):
    g   = float32(dy) * w'                                         [M, D]
    dx  = rstd * (g - xhat * sum(g * xhat) / D)                     [M, D], x.dtype
    (launch.bwd_independent_sums: for 8K+-element rows sum(g * xhat) is taken as rstd * sum(g * xf),
    both row sums straight from the loaded row instead of one waiting on the other's rstd)
    dw  = sum over rows of float32(dy) * xhat                       [D], weight.dtype
With eager_rounding (backend option numerics="eager") on the cast_before_weight path, g and each
dw term are rounded to dy's dtype as eager's bf16 ``w * xhat.to(dtype)`` backward stores them:
    g = rnd(float32(dy) * w'),   dw = sum over rows of rnd(float32(dy) * rnd(xhat))
dw is reduced without atomics (deterministic): each program of the persistent backward grid keeps
an fp32 [D] partial sum in registers over its rows and writes it to partial[pid, :]; a second small
kernel (kernels/_rms_norm_dw.py) sums the [P, D] partials over P and rounds to weight.dtype.
``fxfuse::rms_norm_backward_add(dy, x, w, r, ..., dy2, dy3)`` returns (dx + r, dw) for the gradient
dy + dy2 + dy3: a pre-norm block's residual-gradient add and the sum of the branch gradients that
meet at the norm's output, each rounded as eager's add, in the same pass (kernels/_rms_norm_bwd.py;
fxfuse/fold_add.py puts them there).

Launch (kernels/_rms_norm_launch.py): the forward runs one program per tile of rows, or, for rows
of 8K+ elements, a persistent grid of 1-D row steps whose loop loads the next rows while one is
reduced, or, past 16K elements where a power-of-two tile would be mostly padding, one program per
row walking it in chunks twice (kernels/_rms_norm_chunked.py); the backward is always persistent
(its programs own the dw partial sums): whole rows per program up to 8K elements, wider rows
shared by S programs that own D / S columns each (kernels/_rms_norm_split.py), where a whole row
and its dw sum outgrow one program's registers.

Layout: rows must have a contiguous last dim (stride(-1) == 1); other inputs are copied once by
the host wrapper. D up to ``_MAX_BLOCK_N`` (one row per register tile); wider rows take the
PyTorch reference path.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import _rms_norm_launch as launch
from ._rms_norm_bwd import _rms_norm_bwd_kernel
from ._rms_norm_chunked import chunked_forward, scale_row
from ._rms_norm_dw import reduce_dw
from ._rms_norm_split import split_backward
from ._dispatch import no_double_backward, register_autograd, use_triton
from ._round import rne_by_bits, round_code, round_ref

_MAX_BLOCK_N = 65536


@triton.jit
def _fwd_row_math(x, w, eps, D, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                  CAST_BEFORE_WEIGHT: tl.constexpr, AXIS: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """y (Y_DTYPE) of an x tile whose rows lie along AXIS (the module doc's forward)."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=AXIS, keep_dims=True) / D + eps)
    return scale_row(xf, rstd, w, X_DTYPE, Y_DTYPE, HAS_WEIGHT, CAST_BEFORE_WEIGHT, RNE_BY_BITS)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype, contiguous (dummy pointer when HAS_WEIGHT is False)
    y_ptr,  # [M, D] out_dtype, contiguous (row stride D)
    M,
    D,
    stride_x,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One [BLOCK_M, BLOCK_N] tile of rows per program (rows narrower than 8K elements).
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :] + offset
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (rows < M)[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    y = _fwd_row_math(x, w, eps, D, x_ptr.dtype.element_ty, y_ptr.dtype.element_ty, HAS_WEIGHT,
                      CAST_BEFORE_WEIGHT, 1, RNE_BY_BITS)
    tl.store(y_ptr + rows64[:, None] * D + cols[None, :], y, mask=mask)


@triton.jit
def _rms_norm_fwd_rows_kernel(
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype, contiguous (dummy pointer when HAS_WEIGHT is False)
    y_ptr,  # [M, D] out_dtype, contiguous (row stride D)
    M,
    D,
    stride_x,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Persistent grid for wide rows: program p takes rows p, p + P, p + 2P, ... (P = grid size), one
    # 1-D row per step (no row mask, a scalar row offset), the loop loading the next NUM_STAGES - 1
    # rows while this one is reduced and stored.
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=NUM_STAGES):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(x_ptr + row64 * stride_x + cols, mask=col_mask, other=0.0)
        y = _fwd_row_math(x, w, eps, D, x_ptr.dtype.element_ty, y_ptr.dtype.element_ty, HAS_WEIGHT,
                          CAST_BEFORE_WEIGHT, 0, RNE_BY_BITS)
        tl.store(y_ptr + row64 * D + cols, y, mask=col_mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as an [M, D] view with contiguous last dim (copied only when no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _fits_triton(x: torch.Tensor) -> bool:
    # is_cuda first: an attribute read, where use_triton also reads the environment.
    return (x.is_cuda or use_triton(x)) and x.dim() > 0 and 0 < x.shape[-1] <= _MAX_BLOCK_N and x.numel() > 0


_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "rms_norm(Tensor x, Tensor? weight, float eps, float offset, bool cast_before_weight, ScalarType out_dtype, "
    "bool eager_rounding=False) -> Tensor",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.define(
    "rms_norm_backward(Tensor dy, Tensor x, Tensor? weight, float eps, float offset, bool compute_dw, "
    "bool eager_rounding=False) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.define(
    "rms_norm_backward_add(Tensor dy, Tensor x, Tensor? weight, Tensor? residual, float eps, float offset, "
    "bool compute_dw, bool eager_rounding=False, Tensor? dy2=None, Tensor? dy3=None) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
    eager_rounding: bool = False,
) -> torch.Tensor:
    """y [x.shape] out_dtype, contiguous (module doc); eager_rounding only changes the backward."""
    if not _fits_triton(x):  # contiguous as the fake's: the reference keeps a transposed x's strides
        return rms_norm_reference(x, weight, eps, offset, cast_before_weight, out_dtype).contiguous()
    x2 = _rows(x)
    m, d = x2.shape
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    w = weight.contiguous() if weight is not None else x2
    chunked = launch.fwd_chunked_launch(d, x.element_size())
    if chunked is not None:
        chunked_forward(x2, w, y.view(m, d), eps, offset, weight is not None, cast_before_weight,
                        rne_by_bits(x.device), chunked)
        return y
    persistent, grid, block_m, block_n, num_warps, num_stages = launch.fwd_launch(m, d, x.element_size(), x.device)
    flags = dict(HAS_WEIGHT=weight is not None, CAST_BEFORE_WEIGHT=cast_before_weight,
                 RNE_BY_BITS=rne_by_bits(x.device), BLOCK_N=block_n, num_warps=num_warps)
    if persistent:
        _rms_norm_fwd_rows_kernel[(grid,)](x2, w, y, m, d, x2.stride(0), eps, offset, NUM_STAGES=num_stages, **flags)
    else:
        _rms_norm_fwd_kernel[(grid,)](x2, w, y, m, d, x2.stride(0), eps, offset, BLOCK_M=block_m, **flags)
    return y


def _rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    compute_dw: bool,
    eager_rounding: bool = False,
    residual: Optional[torch.Tensor] = None,
    dy_more: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [x.shape] x.dtype, dw [D] weight.dtype); dw is an empty [0] tensor unless compute_dw.
    eager_rounding: the grads of ``w * xhat.to(dtype)`` round as eager's product (dy's dtype).
    residual [x.shape] x.dtype: dx + residual instead of dx (one rounding more, as eager's add).
    dy_more (up to two [dy.shape] dy.dtype): the gradient is (dy + dy_more[0]) + dy_more[1], each add
    rounded as eager's."""
    compute_dw = compute_dw and weight is not None
    for name, t, like in [("residual", residual, x)] + [(f"dy{i}", t, dy) for i, t in enumerate(dy_more, 2)]:
        if t is not None and (t.shape != like.shape or t.dtype != like.dtype):
            what = "x" if like is x else "dy"
            raise ValueError(f"fxfuse::rms_norm_backward_add: {name} {t.dtype}{list(t.shape)} must have "
                             f"{what}'s shape and dtype, {like.dtype}{list(like.shape)}")
    fits = _fits_triton(x)
    split = launch.bwd_split_launch(x.numel() // x.shape[-1], x.shape[-1], x.element_size(), x.device) if fits else None
    if not fits or split is not None:  # dy_more summed by separate adds, as unfused
        for part in dy_more:
            dy = dy + part
        dy_more = ()
    if not fits:
        dx, dw = _rms_norm_backward_reference(dy, x, weight, eps, offset, compute_dw, eager_rounding)
        dx = (dx if residual is None else dx + residual).contiguous()  # as the fake's, whatever x's strides
        return dx, dw if compute_dw else x.new_empty((0,))
    x2 = _rows(x)
    m, d = x2.shape
    dy2 = dy.reshape(m, d).contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    w = weight.contiguous() if weight is not None else x2
    round_ = round_code(x.dtype, eager_rounding and weight is not None)  # dy's dtype: dw_term
    pdl = compute_dw and launch.dw_pdl(x.device)  # the dw reduction waits on the GPU (split backward: exit trigger)
    if split is not None:
        grid = split[0]  # row groups: one [D] partial each
        partial = torch.empty((grid, d) if compute_dw else (1,), dtype=torch.float32, device=x.device)
        split_backward(dy2, x2, w, dx, partial, eps, offset, weight is not None, compute_dw, round_,
                       rne_by_bits(x.device), split)
        if residual is not None:  # rows past 8K elements: a separate add, as unfused
            dx.add_(residual)
    else:
        # rows of x, dy (dy_more, residual) staged per row of the tile
        loads = 2 + len(dy_more) + (residual is not None)
        grid, block_m, block_n, num_warps, num_stages = launch.bwd_launch(m, d, x.element_size(), x.device, loads)
        partial = torch.empty((grid, d) if compute_dw else (1,), dtype=torch.float32, device=x.device)
        res = dict(ADD_RN=x.is_cuda, NUM_DY=1 + len(dy_more),
                   **{f"dy{i}_ptr": t.reshape(m, d).contiguous() for i, t in enumerate(dy_more, 2)})
        if residual is not None:
            res.update(res_ptr=residual.reshape(m, d).contiguous(), HAS_RES=True)
        _rms_norm_bwd_kernel[(grid,)](
            dy2, x2, w, dx, partial, m, d, x2.stride(0), eps, offset,
            HAS_WEIGHT=weight is not None, COMPUTE_DW=compute_dw, ROUND=round_, RNE_BY_BITS=rne_by_bits(x.device),
            INDEPENDENT_SUMS=launch.bwd_independent_sums(block_n), BLOCK_M=block_m, BLOCK_N=block_n,
            NUM_STAGES=num_stages, num_warps=num_warps, PDL=pdl, **res,
        )
    return dx, reduce_dw(partial, weight.dtype, pdl) if compute_dw else x.new_empty((0,))


def _rms_norm_backward_add(dy, x, weight, residual, eps, offset, compute_dw, eager_rounding=False, dy2=None,
                           dy3=None):
    """fxfuse::rms_norm_backward_add: the backward of dy + dy2 + dy3 (those given), plus residual (if
    given) on dx, in one pass: fxfuse/fold_add.py folds the adds around a pre-norm block's norm into it."""
    more = tuple(t for t in (dy2, dy3) if t is not None)
    return _rms_norm_backward(dy, x, weight, eps, offset, compute_dw, eager_rounding, residual, more)


# Plain Library registration, not torch.library.custom_op: custom_op's Python dispatch and
# autograd wrapper cost ~100 us of CPU per call on the H200 host (more than the kernels at
# medium sizes). CompositeExplicitAutograd, as custom_op registers: every backend runs _rms_norm.
_lib.impl("rms_norm", _rms_norm, "CompositeExplicitAutograd")
_lib.impl("rms_norm_backward", _rms_norm_backward, "CompositeExplicitAutograd")
_lib.impl("rms_norm_backward_add", _rms_norm_backward_add, "CompositeExplicitAutograd")


@torch.library.register_fake("fxfuse::rms_norm", lib=_lib)
def _(x, weight, eps, offset, cast_before_weight, out_dtype, eager_rounding=False):
    return x.new_empty(x.shape, dtype=out_dtype)


@torch.library.register_fake("fxfuse::rms_norm_backward", lib=_lib)
def _fake_backward(dy, x, weight, eps, offset, compute_dw, eager_rounding=False):
    dw = weight.new_empty(weight.shape) if compute_dw and weight is not None else x.new_empty((0,))
    return x.new_empty(x.shape), dw


@torch.library.register_fake("fxfuse::rms_norm_backward_add", lib=_lib)
def _(dy, x, weight, residual, eps, offset, compute_dw, eager_rounding=False, dy2=None, dy3=None):
    return _fake_backward(dy, x, weight, eps, offset, compute_dw)


_RMS_NORM = torch.ops.fxfuse.rms_norm.default
_RMS_NORM_BACKWARD = torch.ops.fxfuse.rms_norm_backward.default
_RMS_NORM_BACKWARD_ADD = torch.ops.fxfuse.rms_norm_backward_add.default


class _RMSNormFunction(torch.autograd.Function):
    """Autograd of fxfuse::rms_norm; saves x and weight (rstd is recomputed in backward)."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, cast_before_weight, out_dtype, eager_rounding=False):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        ctx.offset = offset
        ctx.eager_rounding = eager_rounding and cast_before_weight  # Gemma's fp32 math rounds once
        with torch._C._AutoDispatchBelowAutograd():
            return _RMS_NORM(x, weight, eps, offset, cast_before_weight, out_dtype, eager_rounding)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dx or need_dw):
            return None, None, None, None, None, None, None
        dx, dw = _RMS_NORM_BACKWARD(grad, x, weight, ctx.eps, ctx.offset, need_dw, ctx.eager_rounding)
        if torch.is_grad_enabled() and (grad.requires_grad or x.requires_grad
                                        or (weight is not None and weight.requires_grad)):
            dx, dw = no_double_backward(_RMS_NORM_BACKWARD, (dx, dw))
        return (dx if need_dx else None), (dw if need_dw else None), None, None, None, None, None


register_autograd(_lib, "rms_norm", _RMS_NORM, _RMSNormFunction)

# The public callables: the ops (dispatch, autograd, torch.compile), not the bare host wrappers.
rms_norm = _RMS_NORM
rms_norm_backward = _RMS_NORM_BACKWARD
rms_norm_backward_add = _RMS_NORM_BACKWARD_ADD


def rms_norm_reference(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    offset: float,
    cast_before_weight: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Eager PyTorch with the op's exact rounding points (also the CPU path without Triton)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        y = y.to(x.dtype).float()
    if weight is not None:
        y = y * (weight.float() + offset)
    return y.to(out_dtype)


def _rms_norm_backward_reference(dy, x, weight, eps, offset, compute_dw, eager_rounding=False):
    """Closed-form fp32 backward matching the kernel (rounding of the cast path as identity)."""
    on = eager_rounding and weight is not None
    rnd_x = lambda y: round_ref(y, x.dtype, on)  # noqa: E731  xhat.to(x.dtype) and its grad
    rnd_dy = lambda y: round_ref(y, dy.dtype, on)  # noqa: E731  the product w * xr, made in y's dtype
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    dyf = dy.float()
    g = rnd_x(dyf * (weight.float() + offset)) if weight is not None else dyf
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = rnd_dy(dyf * rnd_x(xhat)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) if compute_dw else None
    return dx.to(x.dtype), dw
