"""RMSNorm backward for wide rows: S programs share each row (the backward of kernels/rms_norm.py).

The persistent row backward keeps a whole row of x, dy (and w) plus an fp32 [D] dw partial per
program in registers. Past 8K elements per row (16K-lane tiles) that outgrows the register file
(H200, 2048x16384 bf16: 82.6 us with dw, 58.9 us without). Here S programs share each row; program
(q, side) owns the columns [side * C, side * C + C), C = cdiv(D, S), of rows q, q + Q, q + 2Q, ...
(Q row groups). It holds its own part of x, dy and w, and reads the other S - 1 parts only to finish
the row's two sums; those reads are mostly L2 hits, since the partner programs read the same row at
about the same time. Per row, with g = float32(dy) * w' (w' = float32(weight) + offset, 1 without
weight):

    sxx  = sum over the row of xf * xf        sgx = sum over the row of g * xf
    rstd = 1 / sqrt(sxx / D + eps)            c   = sgx * rstd / D     (= sum(g * xhat) / D)
    dx[own]             = rstd * (g - xhat * c),   xhat = xf * rstd
    dw_partial[q, own] += float32(dy) * xhat        (summed over the group's rows)

Two-pass (SUMS_GIVEN): from three parts on, where the re-reads by S programs and their staged loads
no longer pay, a first kernel writes each row's (sxx, sgx) to a [M, 2] fp32 buffer, looping over the
row in column blocks, and the split kernel then reads only its own part of x and dy: 5 row-sized
transfers instead of 3, but none through an oversized register tile or unstaged loads.

The math and roundings are the row kernel's (module doc of kernels/rms_norm.py, ROUND included);
only the fp32 summation order of the two row sums differs. The [Q, D] partials go to rms_norm.py's
dw reduction like the row kernel's [P, D]. Launch: kernels/_rms_norm_launch.py,
``bwd_split_launch``.
"""
import torch
import triton
import triton.language as tl

from ._round import round_dtype, round_to


@triton.jit
def grad_out(dyf, w, HAS_WEIGHT: tl.constexpr, ROUND: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """g = dy * w' rounded to x's dtype under ROUND (the grad of xhat.to(x.dtype), as eager's: one rounding
    whether the product is made in x's dtype or, with an fp32 weight, in fp32), or dy without weight."""
    if HAS_WEIGHT:
        return round_to(dyf * w, ROUND, RNE_BY_BITS)
    return dyf


@triton.jit
def dw_term(dyf, xr, DY_DTYPE: tl.constexpr, ROUND: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """One row's dw term dy * xr (xr = xhat rounded to x's dtype under ROUND), rounded as eager's product,
    which is made in dy's dtype: bf16 / fp16 when w is, not at all with an fp32 weight (fp32 dy)."""
    if DY_DTYPE == tl.float32:
        return dyf * xr
    return round_to(dyf * xr, ROUND, RNE_BY_BITS)


@triton.jit
def _rms_norm_row_sums_kernel(
    dy_ptr,  # [M, D] dy.dtype, contiguous (row stride D)
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype, contiguous (dummy pointer when HAS_WEIGHT is False)
    sums_ptr,  # [M, 2] fp32 out: (sxx, sgx) of each row
    D,
    stride_x,
    offset,
    HAS_WEIGHT: tl.constexpr,
    ROUND: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # One row per program, in column blocks: elementwise fp32 accumulators, reduced once at the end.
    row64 = tl.program_id(0).to(tl.int64)
    acc_xx = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_gx = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in tl.range(0, D, BLOCK, num_stages=NUM_STAGES):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < D
        xf = tl.load(x_ptr + row64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dyf = tl.load(dy_ptr + row64 * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = 0.0
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        acc_xx += xf * xf
        acc_gx += grad_out(dyf, w, HAS_WEIGHT, ROUND, RNE_BY_BITS) * xf
    tl.store(sums_ptr + row64 * 2, tl.sum(acc_xx, axis=0))
    tl.store(sums_ptr + row64 * 2 + 1, tl.sum(acc_gx, axis=0))


@triton.jit
def _rms_norm_bwd_split_kernel(
    dy_ptr,  # [M, D] dy.dtype, contiguous (row stride D)
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype, contiguous (dummy pointer when HAS_WEIGHT is False)
    dx_ptr,  # [M, D] x.dtype, contiguous (row stride D)
    dw_partial_ptr,  # [Q, D] fp32, contiguous; Q = programs / S (only written if COMPUTE_DW)
    sums_ptr,  # [M, 2] fp32 (sxx, sgx) per row from _rms_norm_row_sums_kernel (only read if SUMS_GIVEN)
    M,
    D,
    stride_x,
    eps,
    offset,
    CHUNK,  # columns per part: cdiv(D, S)
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ROUND: tl.constexpr,  # eager's roundings of w * xhat.to(x.dtype)'s grads (x.dtype; dw_term)
    RNE_BY_BITS: tl.constexpr,
    S: tl.constexpr,  # programs per row
    PART: tl.constexpr,  # register tile of one part: a power of two >= CHUNK
    SUMS_GIVEN: tl.constexpr,  # two-pass: the row sums are read, the other parts are not
    NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    side = pid % S
    groups = tl.num_programs(0) // S
    lanes = tl.arange(0, PART)
    own = side * CHUNK + lanes
    own_mask = (lanes < CHUNK) & (own < D)
    w_own = 0.0
    if HAS_WEIGHT:
        w_own = tl.load(w_ptr + own, mask=own_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((PART,), dtype=tl.float32)

    for row in tl.range(pid // S, M, groups, num_stages=NUM_STAGES):
        row64 = tl.cast(row, tl.int64)
        xo = tl.load(x_ptr + row64 * stride_x + own, mask=own_mask, other=0.0).to(tl.float32)
        dyo = tl.load(dy_ptr + row64 * D + own, mask=own_mask, other=0.0).to(tl.float32)
        go = grad_out(dyo, w_own, HAS_WEIGHT, ROUND, RNE_BY_BITS)
        if SUMS_GIVEN:
            sxx = tl.load(sums_ptr + row64 * 2)
            sgx = tl.load(sums_ptr + row64 * 2 + 1)
        else:
            sxx = tl.sum(xo * xo, axis=0)
            sgx = tl.sum(go * xo, axis=0)
            for j in tl.static_range(1, S):
                # another program's part of this row: read for the sums only, nothing kept
                oth = ((side + j) % S) * CHUNK + lanes
                oth_mask = (lanes < CHUNK) & (oth < D)
                xt = tl.load(x_ptr + row64 * stride_x + oth, mask=oth_mask, other=0.0).to(tl.float32)
                dyt = tl.load(dy_ptr + row64 * D + oth, mask=oth_mask, other=0.0).to(tl.float32)
                wt = 0.0
                if HAS_WEIGHT:
                    wt = tl.load(w_ptr + oth, mask=oth_mask, other=0.0).to(tl.float32) + offset
                sxx += tl.sum(xt * xt, axis=0)
                sgx += tl.sum(grad_out(dyt, wt, HAS_WEIGHT, ROUND, RNE_BY_BITS) * xt, axis=0)
        rstd = tl.math.rsqrt(sxx / D + eps)
        c = sgx * rstd / D
        xhat = xo * rstd
        dx = rstd * (go - xhat * c)
        dx = round_dtype(dx, dx_ptr.dtype.element_ty, RNE_BY_BITS).to(dx_ptr.dtype.element_ty)
        tl.store(dx_ptr + row64 * D + own, dx, mask=own_mask)
        if COMPUTE_DW:
            dw_acc += dw_term(dyo, round_to(xhat, ROUND, RNE_BY_BITS), dy_ptr.dtype.element_ty, ROUND, RNE_BY_BITS)

    if COMPUTE_DW:
        tl.store(dw_partial_ptr + (pid // S).to(tl.int64) * D + own, dw_acc, mask=own_mask)


def split_backward(dy2, x2, w, dx, partial, eps, offset, has_weight, compute_dw, round_code_, rne, cfg):
    """Launch on [m, d] rows: cfg = (groups, S, PART, num_warps, num_stages, row_sums) from
    bwd_split_launch, row_sums = (BLOCK, num_warps, num_stages) of the two-pass path's first kernel
    or None; partial is [groups, d] fp32 (any [1] tensor when not compute_dw)."""
    m, d = x2.shape
    groups, s, part, num_warps, num_stages, row_sums = cfg
    sums = partial
    if row_sums is not None:
        block, sums_warps, sums_stages = row_sums
        sums = torch.empty((m, 2), dtype=torch.float32, device=x2.device)
        _rms_norm_row_sums_kernel[(m,)](
            dy2, x2, w, sums, d, x2.stride(0), offset, HAS_WEIGHT=has_weight, ROUND=round_code_,
            RNE_BY_BITS=rne, BLOCK=block, NUM_STAGES=sums_stages, num_warps=sums_warps,
        )
    _rms_norm_bwd_split_kernel[(groups * s,)](
        dy2, x2, w, dx, partial, sums, m, d, x2.stride(0), eps, offset, triton.cdiv(d, s),
        HAS_WEIGHT=has_weight, COMPUTE_DW=compute_dw, ROUND=round_code_, RNE_BY_BITS=rne,
        S=s, PART=part, SUMS_GIVEN=row_sums is not None, NUM_STAGES=num_stages, num_warps=num_warps,
    )
