"""RMSNorm forward for wide rows: one program per row, two loops over column chunks.

The row forward of kernels/rms_norm.py holds a whole row in one register tile padded to a power of
two; past 16K elements that tile is 32K+ lanes (2048x18432 bf16: 44% of the lanes masked, one row
per SM in flight, 64% of the copy ceiling on the H200). Here a program walks its row twice in
chunks of BLOCK columns:

    loop 1:  acc += float32(x[c0:c0+BLOCK]) ** 2          (elementwise fp32 accumulator [BLOCK])
             rstd = 1 / sqrt(sum(acc) / D + eps)
    loop 2:  y[c0:c0+BLOCK] = the row math of kernels/rms_norm.py on the reloaded chunk

Loop 1 loads with evict_last, so loop 2's reload of the same row (a few tens of KiB, just read)
hits L2 and DRAM sees x once; loop 2's loads are evict_first. The math and roundings are the row
forward's (module doc of kernels/rms_norm.py); only the fp32 summation order of sum(x * x) differs.
Launch: kernels/_rms_norm_launch.py, ``fwd_chunked`` and ``fwd_chunked_config``.
"""
import triton
import triton.language as tl

from ._round import round_dtype


@triton.jit
def scale_row(xf, rstd, w, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
              CAST_BEFORE_WEIGHT: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """y (Y_DTYPE) = xhat = xf * rstd, rounded to X_DTYPE first on the cast-before-weight path, times w'
    (the forward of kernels/rms_norm.py's module doc; w' already float32(weight) + offset)."""
    xhat = xf * rstd
    if CAST_BEFORE_WEIGHT:
        xhat = round_dtype(xhat, X_DTYPE, RNE_BY_BITS)
    if HAS_WEIGHT:
        xhat = xhat * w
    return round_dtype(xhat, Y_DTYPE, RNE_BY_BITS).to(Y_DTYPE)


@triton.jit
def _rms_norm_fwd_chunked_kernel(
    x_ptr,  # [M, D] x.dtype, row stride stride_x, col stride 1
    w_ptr,  # [D] weight.dtype, contiguous (dummy pointer when HAS_WEIGHT is False)
    y_ptr,  # [M, D] out_dtype, contiguous (row stride D)
    D,
    stride_x,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK: tl.constexpr,  # columns per chunk
    NUM_STAGES: tl.constexpr,  # chunks in flight in each loop
):
    row64 = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row64 * stride_x
    y_row = y_ptr + row64 * D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for c0 in tl.range(0, D, BLOCK, num_stages=NUM_STAGES):
        cols = c0 + tl.arange(0, BLOCK)
        xf = tl.load(x_row + cols, mask=cols < D, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += xf * xf
    rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for c0 in tl.range(0, D, BLOCK, num_stages=NUM_STAGES):
        cols = c0 + tl.arange(0, BLOCK)
        mask = cols < D
        xf = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        w = 0.0
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
        y = scale_row(xf, rstd, w, x_ptr.dtype.element_ty, y_ptr.dtype.element_ty, HAS_WEIGHT, CAST_BEFORE_WEIGHT,
                      RNE_BY_BITS)
        tl.store(y_row + cols, y, mask=mask)


def chunked_forward(x2, w, y2, eps, offset, has_weight, cast_before_weight, rne, cfg):
    """Launch on [m, d] rows x2 into y2 ([m, d], contiguous): cfg = (BLOCK, num_warps, num_stages)
    from fwd_chunked_config."""
    m, d = x2.shape
    block, num_warps, num_stages = cfg
    _rms_norm_fwd_chunked_kernel[(m,)](
        x2, w, y2, d, x2.stride(0), eps, offset, HAS_WEIGHT=has_weight, CAST_BEFORE_WEIGHT=cast_before_weight,
        RNE_BY_BITS=rne, BLOCK=block, NUM_STAGES=num_stages, num_warps=num_warps,
    )
