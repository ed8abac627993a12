"""Fused lm_head + cross-entropy that never materialises the [N, V] logits.

    torch.ops.fxfuse.linear_cross_entropy(x, weight, bias, target, ignore_index=-100,
        reduction="mean", label_smoothing=0.0, softcap=0.0, logit_scale=1.0, algorithm="lean",
        eager_rounding=False, fp32_transform=False, vocab_scale=None) -> fp32 0-dim tensor

x [N, H], weight [V, H] (fp32/bf16/fp16, same dtype), bias [V] or None, target [N] int64,
vocab_scale [V] fp32 or None.

Forward, per row n (eps = label_smoothing, c = softcap, s = logit_scale, t = target[n]):
    z_n   = (x_n @ weight.T + bias) * s                   [V] fp32 (z = c * tanh(z / c) if c > 0)
    lse_n = logsumexp(z_n)
    row_n = (1 - eps) * (lse_n - z_n[t]) + eps * (lse_n - mean(z_n)),  0 where t == ignore_index
    loss  = sum(row)  ("sum"),  sum(row) / count(t != ignore_index)  ("mean"),  or row  ("none")
With a per-vocabulary fp32 scale vs [V] (vocab_scale: Dory's learned one), z_n = (x_n @ weight.T +
bias) * s * vs before the softcap, and its grad dvs = sum_n du_n * (x_n @ weight.T + bias) * s, du
the grad of z before the softcap; summed in fp32 in the kernels (lean: per chunk, the column sums of
the chunk's terms; fast: _lce_fast_cols_kernel), never through a [V, H] weight * vs.
This is F.cross_entropy(float32(z), target, ignore_index, reduction, label_smoothing) exactly,
including an all-ignored batch: "mean" gives nan (0 / 0, as PyTorch), "sum" gives 0, and every
gradient is 0. A target outside [0, V) other than ignore_index, where eager raises, makes its row's
loss nan and the gradients nan (a check that raises would need a host sync).

Backward, with w_n = dloss/drow_n (grad / count or grad; 0 on ignored rows):
    dz_n  = w_n * (softmax(z_n) - (1 - eps) * onehot(t) - eps / V)          [V]
    dzr_n = dz_n * s * (1 - (z_n / c)^2 if c > 0 else 1)                     [V] grad of x @ W.T + b
    dx = dzr @ weight [N, H],  dweight = dzr.T @ x [V, H],  dbias = dzr.sum(0) [V]

Algorithms: "fast" (3 matmuls, kernels/linear_cross_entropy_fast.py) forms the gradients in the
forward from [R, V] logits blocks in the input dtype (R*V*element_size above dW + dx: 250 MiB at
N=8192, V=128256 bf16) and backward only scales them; "lean" (4 matmuls, below) keeps ~104 MiB
above dW + dx. The backend's option ``loss_head`` picks; its default "auto" takes "fast" under
Inductor (its compiled backward scales the saved gradients in place) and "lean" (which meets the
1.1x memory bound also in eager autograd) otherwise; "fast" trades R*V*element_size of memory for
the fourth matmul. A forward that needs no gradient (eval, no_grad, nothing requiring grad) always
runs the lean forward (one matmul).

Lean design: chunk rows into passes of R tokens and the vocabulary into chunks of C columns. Forward
computes each [R, C] logits chunk with one cuBLAS matmul (fp32 output, so no bf16 rounding of
logits; in x's dtype under eager_rounding, so each logit rounds as eager's) and a Triton kernel
folds it into a running (max, sum-exp, target logit, logit sum) per row: 1 matmul of x @ W.T in
total. Backward recomputes each chunk (matmul 2) and a Triton kernel
writes dzr in the input dtype into a group buffer of G >= C columns; per group, dx_pass +=
dzr @ W_group (matmul 3, into an fp32 [R, H] accumulator; a wide G keeps its read-modify-writes
few) and dW_group (+)= dzr.T @ x_pass (matmul 4, K = R tokens reduced in fp32 inside cuBLAS,
rounded to the weight dtype once per pass: once when N <= R). The logits recompute buys small
memory (forming dW in the forward needs lse final, so a whole [R, V] row block per pass, which
is what "fast" pays). Peak extra memory is dW + dx + the fp32 dx accumulator of one pass
(64 MiB) + one fp32 logits chunk (16 MiB) + one gradient group (24 MiB). Measured on an H200
(torch 2.11, bf16, N=8192, H=4096, V=128256, fwd+bwd): 58 ms and +1170 MiB (1.10x the 1066 MiB
floor); the four matmuls alone take 49 ms at ~700 TFLOP/s (eager: 50 ms, +12 GiB; Inductor:
39 ms, +3070 MiB). Precision: logits, softmax and every matmul accumulate in fp32; dzr is
rounded to the input dtype once (as eager rounds its logits' grad). eager_rounding=True (backend
option numerics="eager") rounds like the unfused graph in the input dtype: the lm_head output, the
scale, z / c, tanh and * c each, and their gradients in reverse order (_lce_logits.py); with
fp32_transform (the graph casts to fp32 before its scale / softcap, as nanochat does) only the
lm_head output and the gradient reaching it. Loss and gradients then equal eager's low-precision
ones (tests: < 2e-4, one pass). With more than one pass
(N > R = 4096 tokens at H = 4096) dW is rounded to bf16/fp16 once per pass: at 8 passes the
fp16 test measures ~1.9x eager's dW error (the bound is 2x), so very long batches lose some.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import linear_cross_entropy_fast  # noqa: F401  registers the fast op (algorithm="fast" calls it)
from ._dispatch import use_triton
from ._lce_chunks import (_addmm_f32_, _block, _cols_per_chunk, _cols_per_group, _dense, _num_warps, _raw_logits,
                          _rows_per_pass, _rows_per_program, _view)
from ._lce_logits import (_bad_targets, _dlogits, _dlogits_reference, _dlogits_vscaled, _dlogits_vscaled_reference,
                          _logits, _logits_reference, _reduce_like_eager, _vocab_scale,
                          linear_cross_entropy_eager)  # noqa: F401  the unfused definition (tests, bench)
from ._round import rne_by_bits, round_code


@triton.jit
def _lce_fwd_chunk_kernel(
    z_ptr,  # [R, C] raw logits x[n0:n0+R] @ W[v0:v0+C].T (fp32, or x's dtype), row stride stride_z
    bias_ptr,  # [V] bias (any float dtype), offset to v0 by the host; unused unless HAS_BIAS
    vs_ptr,  # [V] fp32 per-vocabulary logit scale, offset to v0 by the host; unused unless HAS_VSCALE
    target_ptr,  # [N] int64 targets
    state_ptr,  # [4, N] fp32, contiguous: running max, running sum-exp, target logit, logit sum
    n0, v0, R, C, N, stride_z, scale, softcap,
    HAS_BIAS: tl.constexpr, HAS_VSCALE: tl.constexpr, SOFTCAP: tl.constexpr, ROUND: tl.constexpr,
    ROUND_OPS: tl.constexpr, RNE_BY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # [BLOCK_N, 1] rows of the chunk
    r_ok = r < R
    row = n0 + r
    z_row = z_ptr + r.to(tl.int64) * stride_z
    t = tl.load(target_ptr + row, mask=r_ok, other=0) - v0
    m = tl.load(state_ptr + row, mask=r_ok, other=0.0)
    s = tl.load(state_ptr + N + row, mask=r_ok, other=0.0)
    zt = tl.zeros([BLOCK_N, 1], tl.float32)
    zsum = tl.zeros([BLOCK_N, 1], tl.float32)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
        mask = r_ok & (cols < C)
        zr = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = _logits(zr, bias_ptr, vs_ptr, cols, mask, scale, softcap, HAS_BIAS, HAS_VSCALE, SOFTCAP, ROUND,
                       ROUND_OPS, RNE_BY_BITS)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1, keep_dims=True))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=1, keep_dims=True)
        m = m_new
        zt += tl.sum(tl.where(cols == t, z, 0.0), axis=1, keep_dims=True)
        zsum += tl.sum(tl.where(mask, z, 0.0), axis=1, keep_dims=True)
    tl.store(state_ptr + row, m, mask=r_ok)
    tl.store(state_ptr + N + row, s, mask=r_ok)
    tl.store(state_ptr + 2 * N + row, tl.load(state_ptr + 2 * N + row, mask=r_ok) + zt, mask=r_ok)
    tl.store(state_ptr + 3 * N + row, tl.load(state_ptr + 3 * N + row, mask=r_ok) + zsum, mask=r_ok)


@triton.jit
def _lce_bwd_chunk_kernel(
    z_ptr,  # [R, C] raw logits chunk (as in the forward), row stride stride_z; with HAS_VSCALE (fp32
            # then) overwritten by each element's term of the scale's grad, summed over rows by the host
    g_ptr,  # [R, C] out: grad of the raw logits in the input dtype, row stride stride_g (may be z
            # unless HAS_VSCALE)
    bias_ptr,  # [V] bias offset to v0 by the host; unused unless HAS_BIAS
    vs_ptr,  # [V] fp32 per-vocabulary logit scale offset to v0 by the host; unused unless HAS_VSCALE
    target_ptr,  # [N] int64 targets
    lse_ptr,  # [N] fp32 logsumexp of each row's logits
    drow_ptr,  # [N] fp32 grad of each row's loss (may be inf on ignored rows: masked here)
    n0, v0, R, C, stride_z, stride_g, ignore_index, scale, softcap, on_target, off_target,
    HAS_BIAS: tl.constexpr, HAS_VSCALE: tl.constexpr, SOFTCAP: tl.constexpr, ROUND: tl.constexpr,
    ROUND_OPS: tl.constexpr, ROUND_G: tl.constexpr, RNE_BY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # [BLOCK_N, 1] rows of the chunk
    r_ok = r < R
    row = n0 + r
    z_row = z_ptr + r.to(tl.int64) * stride_z
    g_row = g_ptr + r.to(tl.int64) * stride_g
    t = tl.load(target_ptr + row, mask=r_ok, other=ignore_index)
    w = tl.where(t == ignore_index, 0.0, tl.load(drow_ptr + row, mask=r_ok, other=0.0))
    t = t - v0
    lse = tl.load(lse_ptr + row, mask=r_ok, other=0.0)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
        mask = r_ok & (cols < C)
        zr = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        z, th = _logits(zr, bias_ptr, vs_ptr, cols, mask, scale, softcap, HAS_BIAS, HAS_VSCALE, SOFTCAP, ROUND,
                        ROUND_OPS, RNE_BY_BITS)
        dz = (tl.exp(z - lse) - off_target - tl.where(cols == t, on_target, 0.0)) * w
        if HAS_VSCALE:
            if HAS_BIAS:
                zr += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            dz, dvs = _dlogits_vscaled(dz, th, zr, vs_ptr, cols, mask, scale, softcap, SOFTCAP, ROUND_G, RNE_BY_BITS)
            tl.store(z_row + cols, dvs, mask=mask)
        else:
            dz = _dlogits(dz, th, scale, softcap, SOFTCAP, ROUND, ROUND_OPS, RNE_BY_BITS)
        tl.store(g_row + cols, dz.to(g_ptr.dtype.element_ty), mask=mask)


def _fwd_chunk(z, bias, vs, target, state, n0, v0, ignore_index, softcap, scale, low, round_ops, on_triton):
    """low: the dtype whose roundings eager's logit ops make (None: none); round_ops: also those of
    the scale and softcap (they run in low precision, before the .float()); vs: [V] fp32 or None."""
    rows, cols = z.shape
    if not on_triton:
        return _fwd_chunk_reference(z, bias, vs, target, state, n0, v0, softcap, scale, low, round_ops)
    b = bias[v0:] if bias is not None else z
    block = _block(cols)
    block_n = _rows_per_program(rows, block, z.device)
    _lce_fwd_chunk_kernel[(triton.cdiv(rows, block_n),)](
        z, b, vs[v0:] if vs is not None else z, target, state, n0, v0, rows, cols, target.shape[0], z.stride(0),
        scale, softcap, HAS_BIAS=bias is not None, HAS_VSCALE=vs is not None, SOFTCAP=softcap > 0,
        ROUND=round_code(low, low is not None), ROUND_OPS=round_code(low, low is not None and round_ops),
        RNE_BY_BITS=rne_by_bits(z.device),
        BLOCK_N=block_n, BLOCK=block, num_warps=_num_warps(block),
    )


def _bwd_chunk(z, g, bias, vs, target, lse, drow, n0, v0, ignore_index, smoothing, vocab, softcap, scale,
               low, round_ops, on_triton):
    """g = grad of the raw logits chunk z; with a scale vs, z becomes the scale's grad terms."""
    rows, cols = z.shape
    on_target, off_target = 1.0 - smoothing, smoothing / vocab
    if not on_triton:
        dz, dvs = _bwd_chunk_reference(z, bias, vs, target, lse, drow, n0, v0, ignore_index, on_target,
                                       off_target, softcap, scale, low, round_ops)
        g.copy_(dz)
        if vs is not None:
            z.copy_(dvs)
        return
    b = bias[v0:] if bias is not None else z
    block = _block(cols)
    block_n = _rows_per_program(rows, block, z.device)
    _lce_bwd_chunk_kernel[(triton.cdiv(rows, block_n),)](
        z, g, b, vs[v0:] if vs is not None else z, target, lse, drow, n0, v0, rows, cols, z.stride(0),
        g.stride(0), ignore_index, scale, softcap, on_target, off_target,
        HAS_BIAS=bias is not None, HAS_VSCALE=vs is not None, SOFTCAP=softcap > 0,
        ROUND=round_code(low, low is not None), ROUND_OPS=round_code(low, low is not None and round_ops),
        ROUND_G=round_code(g.dtype), RNE_BY_BITS=rne_by_bits(z.device),
        BLOCK_N=block_n, BLOCK=block, num_warps=_num_warps(block),
    )


@torch.library.custom_op("fxfuse::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
    ignore_index: int, label_smoothing: float, softcap: float, logit_scale: float, eager_rounding: bool,
    fp32_transform: bool, vocab_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row losses [N] fp32 (0 on ignored rows) and logsumexp [N] fp32 (saved for backward)."""
    x, weight, target, bias = _dense(x, weight, target, bias)
    vs = _vocab_scale(vocab_scale, weight, eager_rounding)
    n, h = x.shape
    vocab = weight.shape[0]
    on_triton = x.is_cuda or use_triton(x)
    low = x.dtype if eager_rounding else None
    state = torch.zeros(4, n, device=x.device, dtype=torch.float32)
    state[0].fill_(float("-inf"))
    rows = _rows_per_pass(n, h)
    cols = _cols_per_chunk(rows, vocab)
    zbuf = torch.empty(min(rows, n) * cols, device=x.device, dtype=torch.float32)
    for n0 in range(0, n, rows):
        xs = x[n0:n0 + rows]
        for v0 in range(0, vocab, cols):
            wc = weight[v0:v0 + cols]
            z, b = _raw_logits(xs, wc, bias, v0, zbuf, low)
            _fwd_chunk(z, b, vs, target, state, n0, v0, ignore_index, softcap, logit_scale, low,
                       not fp32_transform, on_triton)
    lse = state[0] + state[1].log()
    eps = label_smoothing
    loss = (1.0 - eps) * (lse - state[2]) + eps * (lse - state[3] / vocab)
    loss = torch.where(target == ignore_index, 0.0, loss)
    loss = loss.masked_fill(_bad_targets(target, ignore_index, vocab), float("nan"))
    return loss, lse


@linear_cross_entropy_fwd.register_fake
def _(x, weight, bias, target, ignore_index, label_smoothing, softcap, logit_scale, eager_rounding,
      fp32_transform, vocab_scale=None):
    n = x.shape[0]
    return x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)


@torch.library.custom_op("fxfuse::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd(
    drow: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
    target: torch.Tensor, lse: torch.Tensor, ignore_index: int, label_smoothing: float,
    softcap: float, logit_scale: float, eager_rounding: bool, fp32_transform: bool, need_dx: bool,
    need_dw: bool, need_db: bool, vocab_scale: Optional[torch.Tensor] = None, need_ds: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias, dvocab_scale); each one not needed is an empty tensor."""
    x, weight, target, bias = _dense(x, weight, target, bias)
    vs = _vocab_scale(vocab_scale, weight, eager_rounding)
    need_ds = need_ds and vs is not None
    n, h = x.shape
    vocab = weight.shape[0]
    drow = drow.contiguous().float().masked_fill(_bad_targets(target, ignore_index, vocab), float("nan"))
    on_triton = x.is_cuda or use_triton(x)
    low = x.dtype if eager_rounding else None
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    # no pass runs on an empty batch (N = 0): dW is then zeros, as eager's
    dw = (weight.new_zeros if n == 0 else weight.new_empty)(weight.shape) if need_dw else weight.new_empty(0)
    db = torch.zeros(vocab, device=x.device, dtype=torch.float32) if need_db else x.new_empty(0)
    ds = torch.zeros(vocab, device=x.device, dtype=torch.float32) if need_ds else x.new_empty(0)
    ones = torch.ones(min(_rows_per_pass(n, h), n) if need_ds else 0, device=x.device, dtype=torch.float32)
    rows = _rows_per_pass(n, h)
    cols = _cols_per_chunk(rows, vocab)
    group = _cols_per_group(rows, cols, vocab, x.element_size())
    zbuf = torch.empty(min(rows, n) * cols, device=x.device, dtype=torch.float32)
    gbuf = torch.empty(min(rows, n) * group, device=x.device, dtype=x.dtype)
    accbuf = torch.empty(min(rows, n) * h, device=x.device, dtype=torch.float32) if need_dx else None
    for n0 in range(0, n, rows):
        xs = x[n0:n0 + rows]
        acc = _view(accbuf, xs.shape[0], h).zero_() if need_dx else None
        for g0 in range(0, vocab, group):
            wg = weight[g0:g0 + group]
            g = _view(gbuf, xs.shape[0], wg.shape[0])
            for v0 in range(g0, g0 + wg.shape[0], cols):
                wc = weight[v0:min(v0 + cols, g0 + wg.shape[0])]
                z, b = _raw_logits(xs, wc, bias, v0, zbuf, low)
                _bwd_chunk(z, g[:, v0 - g0:v0 - g0 + wc.shape[0]], b, vs, target, lse, drow, n0, v0,
                           ignore_index, label_smoothing, vocab, softcap, logit_scale, low,
                           not fp32_transform, on_triton)
                if need_ds:  # z holds the chunk's scale-grad terms: their column sums (fp32 matrix-vector
                    ds[v0:v0 + wc.shape[0]].addmv_(z.T, ones[:z.shape[0]])  # product: 1.4x z.sum(0), H100)
            if need_dx:
                _addmm_f32_(acc, g, wg)
            if need_dw and n0 == 0:
                torch.mm(g.T, xs, out=dw[g0:g0 + group])
            elif need_dw:
                dw[g0:g0 + group].addmm_(g.T, xs)
            if need_db:
                db[g0:g0 + group] += g.sum(0, dtype=torch.float32)
        if need_dx:
            dx[n0:n0 + rows].copy_(acc)
    return dx, dw, db.to(bias.dtype) if need_db else db, ds


@linear_cross_entropy_bwd.register_fake
def _(drow, x, weight, bias, target, lse, ignore_index, label_smoothing, softcap, logit_scale,
      eager_rounding, fp32_transform, need_dx, need_dw, need_db, vocab_scale=None, need_ds=False):
    # contiguous as the real op's (it makes x and weight contiguous first), whatever their strides here
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    db = torch.empty_like(bias) if need_db else x.new_empty(0)
    ds = x.new_empty(weight.shape[0], dtype=torch.float32) if need_ds and vocab_scale is not None else x.new_empty(0)
    return dx, dw, db, ds


def _setup_context(ctx, inputs, output):
    x, weight, bias, target, *args = inputs  # vocab_scale last, where the call passed it
    vocab_scale = args[6] if len(args) > 6 else None
    ctx.save_for_backward(x, weight, bias, target, output[1], vocab_scale)
    ctx.args = tuple(args[:6])  # ignore_index, label_smoothing, softcap, logit_scale, eager_rounding, fp32_transform
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, drow, dlse):
    x, weight, bias, target, lse, vocab_scale = ctx.saved_tensors
    needs = ctx.needs_input_grad  # one per input the call passed: 10, or 11 with vocab_scale
    need_dx, need_dw, need_db = needs[0], needs[1], needs[2] and bias is not None
    need_ds = len(needs) > 10 and needs[10] and vocab_scale is not None
    if drow is None or not (need_dx or need_dw or need_db or need_ds):
        return (None,) * len(needs)
    dx, dw, db, ds = torch.ops.fxfuse.linear_cross_entropy_bwd(
        drow, x, weight, bias, target, lse, *ctx.args, need_dx, need_dw, need_db, vocab_scale, need_ds)
    grads = (dx if need_dx else None, dw if need_dw else None, db if need_db else None, *(None,) * 7,
             ds if need_ds else None)
    return grads[:len(needs)]


linear_cross_entropy_fwd.register_autograd(_backward, setup_context=_setup_context)

torch.library.define(
    "fxfuse::linear_cross_entropy",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor target, int ignore_index=-100, "
    "str reduction=\"mean\", float label_smoothing=0.0, float softcap=0.0, float logit_scale=1.0, "
    "str algorithm=\"lean\", bool eager_rounding=False, bool fp32_transform=False, Tensor? vocab_scale=None) "
    "-> Tensor",
)


@torch.library.impl("fxfuse::linear_cross_entropy", "CompositeImplicitAutograd")
def linear_cross_entropy(x, weight, bias, target, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, softcap=0.0, logit_scale=1.0, algorithm="lean",
                         eager_rounding=False, fp32_transform=False, vocab_scale=None):
    """0-dim fp32 loss ([N] fp32 row losses for reduction "none", 0 on ignored rows, as PyTorch's):
    the fast op if asked for, a gradient is needed and the loss is one scalar, else the lean fwd op
    (whose backward takes any per-row upstream gradient).
    eager_rounding: the logit ops (lm_head output, scale, softcap) and their gradients are rounded to
    x's dtype where eager rounds them, as the unfused graph computes them in that dtype;
    fp32_transform: the graph casts the lm_head's output to fp32 before its scale / softcap, so only
    that output and the gradient reaching it are rounded; vocab_scale: a per-vocabulary fp32 [V] logit
    scale (a learned one, Dory's), times the scaled logits before the softcap, with its gradient."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if algorithm not in ("fast", "lean"):
        raise ValueError(f"linear_cross_entropy: algorithm must be 'lean' or 'fast', got {algorithm!r}")
    need = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    need_ds = vocab_scale is not None and vocab_scale.requires_grad
    if algorithm == "fast" and reduction != "none" and torch.is_grad_enabled() and (any(need) or need_ds):
        loss, _, _, _, _ = torch.ops.fxfuse.linear_cross_entropy_fast(
            x, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, logit_scale,
            eager_rounding, fp32_transform, *need, vocab_scale, need_ds)
        return loss
    rows, _ = torch.ops.fxfuse.linear_cross_entropy_fwd(
        x, weight, bias, target, ignore_index, label_smoothing, softcap, logit_scale, eager_rounding,
        fp32_transform, vocab_scale)
    return rows if reduction == "none" else _reduce_like_eager(rows, target, ignore_index, reduction)


def _fwd_chunk_reference(z, bias, vs, target, state, n0, v0, softcap, scale, low, round_ops):
    """PyTorch twin of _lce_fwd_chunk_kernel: folds one chunk into state[:, n0:n0+R]."""
    rows, cols = z.shape
    z, _ = _logits_reference(z.float(), bias, v0, softcap, scale, low, round_ops, vs)
    st = state[:, n0:n0 + rows]
    m_new = torch.maximum(st[0], z.amax(1))
    st[1] = st[1] * (st[0] - m_new).exp() + (z - m_new[:, None]).exp().sum(1)
    st[0] = m_new
    t = target[n0:n0 + rows] - v0
    hit = (t >= 0) & (t < cols)
    st[2] += torch.where(hit, z.gather(1, t.clamp(0, cols - 1)[:, None])[:, 0], 0.0)
    st[3] += z.sum(1)


def _bwd_chunk_reference(zr, bias, vs, target, lse, drow, n0, v0, ignore_index, on_target, off_target,
                         softcap, scale, low, round_ops):
    """PyTorch twin of _lce_bwd_chunk_kernel: (fp32 grad of one raw logits chunk, the scale's grad
    terms or None)."""
    rows, cols = zr.shape
    z, th = _logits_reference(zr.float(), bias, v0, softcap, scale, low, round_ops, vs)
    t = target[n0:n0 + rows]
    w = torch.where(t == ignore_index, 0.0, drow[n0:n0 + rows])
    onehot = torch.arange(v0, v0 + cols, device=z.device)[None, :] == t[:, None]
    dz = (z - lse[n0:n0 + rows, None]).exp() - off_target - onehot * on_target
    if vs is None:
        return _dlogits_reference(dz * w[:, None], th, scale, softcap, low, round_ops), None
    zr = zr.float() + (bias[v0:v0 + cols].float() if bias is not None else 0.0)
    return _dlogits_vscaled_reference(dz * w[:, None], th, zr, vs, v0, scale, softcap)

