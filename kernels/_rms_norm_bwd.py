"""RMSNorm row backward: the persistent kernel of ``fxfuse::rms_norm_backward`` for rows of up to 8K
elements (the math is in kernels/rms_norm.py's module doc; wider rows: kernels/_rms_norm_split.py).

Each program walks row tiles pid, pid + P, ... (P programs), holds whole rows of x and dy in
registers and keeps an fp32 [D] dw partial sum over its rows, written to partial[pid, :] at the end
for kernels/_rms_norm_dw.py to reduce. Two folds of fxfuse/fold_add.py ride on the same pass:

    dy = dy + dy2 (+ dy3)   NUM_DY > 1: the gradients of the matmuls that read the norm's output
                            (q, k, v; gate, up), summed here instead of by an add kernel
    dx = dx + residual      HAS_RES: the residual stream's gradient

each add rounded once to its dtype in eager's order, so results are bit-identical to the unfolded
graph's eager adds.
"""
import triton
import triton.language as tl

from ._rms_norm_split import dw_term, grad_out
from ._round import add_rounded, round_dtype, round_to


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,  # [M, D] out_dtype, contiguous (row stride D)
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype, contiguous (dummy pointer when HAS_WEIGHT is False)
    dx_ptr,  # [M, D] x.dtype, contiguous (row stride D)
    dw_partial_ptr,  # [P, D] fp32, contiguous; P = number of programs (only read if COMPUTE_DW)
    M,
    D,
    stride_x,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ROUND: tl.constexpr,  # eager's roundings of w * xhat.to(x.dtype)'s grads (x.dtype; _rms_norm_split.dw_term)
    RNE_BY_BITS: tl.constexpr,
    INDEPENDENT_SUMS: tl.constexpr,  # sum(g * xhat) as rstd * sum(g * xf) (module doc)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,  # the dw reduction is launched dependent: let its blocks launch now
    res_ptr=None,  # [M, D] x.dtype, contiguous, added to dx (rms_norm_backward_add); last: probes pass the rest
    HAS_RES: tl.constexpr = False,
    ADD_RN: tl.constexpr = False,  # CUDA: sums as inline add.rn.f32 (_round.add_rounded)
    dy2_ptr=None,  # [M, D] dy's dtype, contiguous: dy is dy + dy2 (+ dy3), each add rounded as eager's
    dy3_ptr=None,
    NUM_DY: tl.constexpr = 1,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < D
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for row_block in tl.range(pid, tl.cdiv(M, BLOCK_M), num_progs, num_stages=NUM_STAGES):
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        mask = (rows < M)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        offs = rows64[:, None] * D + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0)
        if NUM_DY > 1:  # the sum of the branch gradients that met at the norm's output (fold_add.py)
            dy = add_rounded(dy, tl.load(dy2_ptr + offs, mask=mask, other=0.0), dy_ptr.dtype.element_ty,
                             RNE_BY_BITS, ADD_RN)
        if NUM_DY > 2:
            dy = add_rounded(dy, tl.load(dy3_ptr + offs, mask=mask, other=0.0), dy_ptr.dtype.element_ty,
                             RNE_BY_BITS, ADD_RN)
        xf = x.to(tl.float32)
        dyf = dy.to(tl.float32)
        g = grad_out(dyf, w, HAS_WEIGHT, ROUND, RNE_BY_BITS)  # w [BLOCK_N] broadcast over the rows
        sxx = tl.sum(xf * xf, axis=1)
        if INDEPENDENT_SUMS:
            sgx = tl.sum(g * xf, axis=1)
        # 0 on the tile's padded rows (x = 0): at eps = 0 their rsqrt(0) = inf made 0 * inf = nan in dw
        rstd = tl.where(rows < M, tl.math.rsqrt(sxx / D + eps), 0.0)
        xhat = xf * rstd[:, None]
        if INDEPENDENT_SUMS:
            c = sgx * rstd / D
        else:
            c = tl.sum(g * xhat, axis=1) / D
        dx = rstd[:, None] * (g - xhat * c[:, None])
        dx = round_dtype(dx, dx_ptr.dtype.element_ty, RNE_BY_BITS).to(dx_ptr.dtype.element_ty)
        if HAS_RES:  # as eager's add of the two x.dtype gradients
            r = tl.load(res_ptr + offs, mask=mask, other=0.0)
            dx = add_rounded(dx, r, dx_ptr.dtype.element_ty, RNE_BY_BITS, ADD_RN)
        tl.store(dx_ptr + offs, dx, mask=mask)
        if COMPUTE_DW:
            dw_acc += dw_term(dyf, round_to(xhat, ROUND, RNE_BY_BITS), dy_ptr.dtype.element_ty, ROUND, RNE_BY_BITS)

    if COMPUTE_DW:
        tl.store(dw_partial_ptr + pid.to(tl.int64) * D + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
