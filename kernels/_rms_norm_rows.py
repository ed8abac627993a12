"""RMSNorm's forward for wide rows (8K+ elements; kernels/rms_norm.py has the math and the op).

Persistent grids: program p takes rows p, p + P, p + 2P, ... (P = grid size), one row per step, the
loop loading the next NUM_STAGES - 1 rows while one is reduced and stored. Rows arrive by per-thread
async copies (_rms_norm_fwd_rows_kernel, any width) or by bulk tensor copies (TMA, Hopper+:
_rms_norm_fwd_tma_kernel, D a multiple of 256). Launch choices: kernels/_rms_norm_launch.py.
"""
import triton
import triton.language as tl

from ._round import round_fp32


@triton.jit
def _fwd_row_math(x, w, eps, D, X_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                  CAST_BEFORE_WEIGHT: tl.constexpr, AXIS: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """y (Y_DTYPE) of an x tile whose rows lie along AXIS (rms_norm.py's forward math; AXIS None:
    the whole tile is one row)."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=AXIS, keep_dims=True) / D + eps)
    xhat = xf * rstd
    if CAST_BEFORE_WEIGHT:
        xhat = round_fp32(xhat, X_DTYPE, RNE_BY_BITS)
    if HAS_WEIGHT:
        xhat = xhat * w
    return round_fp32(xhat, Y_DTYPE, RNE_BY_BITS).to(Y_DTYPE)


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
    # One 1-D row per step (no row mask, a scalar row offset).
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


@triton.jit
def _rms_norm_fwd_tma_kernel(
    x_desc,  # TensorDescriptor of x [M, D] as [M, D // CHUNK, CHUNK], box [1, NB, CHUNK]: one row
    w_ptr,  # [D] weight.dtype, contiguous (dummy pointer when HAS_WEIGHT is False)
    y_ptr,  # [M, D] out_dtype, contiguous (row stride D)
    M,
    D,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    NB: tl.constexpr,  # next_power_of_2(D // CHUNK); the box's rows past D // CHUNK read as zeros
    CHUNK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # Rows fetched by bulk tensor copies into the pipeline's shared-memory stages; a row is an
    # [NB, CHUNK] tile (a box dim holds at most 256 elements).
    cols = tl.arange(0, NB)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    col_mask = cols < D
    w = 0.0
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=NUM_STAGES):
        x = x_desc.load([row, 0, 0]).reshape(NB, CHUNK)
        y = _fwd_row_math(x, w, eps, D, x_desc.dtype, y_ptr.dtype.element_ty, HAS_WEIGHT,
                          CAST_BEFORE_WEIGHT, None, RNE_BY_BITS)
        tl.store(y_ptr + tl.cast(row, tl.int64) * D + cols, y, mask=col_mask)
