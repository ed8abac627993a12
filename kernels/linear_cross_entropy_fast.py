"""The "fast" (3-matmul) algorithm of fxfuse::linear_cross_entropy: gradients made in the forward.

    torch.ops.fxfuse.linear_cross_entropy_fast(x, weight, bias, target, ignore_index, reduction,
        label_smoothing, softcap, logit_scale, eager_rounding, fp32_transform, need_dx, need_dw,
        need_db, vocab_scale=None, need_ds=False) -> (loss, dx, dweight, dbias, dvocab_scale)

loss is the op's 0-dim fp32 loss; dx, dweight, dbias, dvocab_scale are its gradients for an
upstream gradient of 1 (an empty tensor each where not needed). fxfuse::linear_cross_entropy
picks this op when a gradient is needed (algorithm "fast"); an eval / no_grad forward takes the
lean lse-only forward instead and never forms a gradient. Math as in kernels/linear_cross_entropy.py with
    w_n = 1 ("sum") or 1 / count ("mean"), 0 on ignored rows, count = sum(target != ignore_index),
count computed on the device (no host sync: an all-ignored "mean" batch gives w = inf on no row); a
target outside [0, V) other than ignore_index makes w nan (every gradient nan) and its row loss nan.

Forward, per pass of R tokens (rows n0:n0+R):
    zb = x_pass @ W.T (+ b)   [R, V] in the input dtype (matmul 1; eager rounds its logits likewise)
    row kernel, one program per row (many under the interpreter), two sweeps over V in tiles, fp32
    math on the upcast zb:
        sweep 1: online max / sum-exp (and logit sum for label smoothing) -> lse_n, row_n
        sweep 2: dzr_n (grad of the raw x @ W.T + b), rounded to the input dtype, over zb in place
    with a vocab_scale whose grad is needed, sweep 2 runs instead as a column kernel (one program
    per row group of a column tile, its rows in a loop, the row kernel's lse read back): dzr in
    place, and the scale's grad summed over the group's rows in fp32 registers; the host adds the
    groups' [V] partials to dvocab_scale (deterministic). A frozen scale (need_ds False, as under
    LoRA) keeps sweep 2 in the row kernel, the scale in its chain rule
    dx[pass] = dzr @ W (matmul 2, into dx's rows), dW (+)= dzr.T @ x_pass (matmul 3: the first pass
    writes, later ones addmm with beta=1: dW is rounded to the weight dtype once per pass), and
    db += dzr.sum(0) in fp32 (cast to the bias dtype at the end).
Backward, with g the 0-dim upstream gradient: (dx * g, dW * g, db * g); no test of g on the host.

Memory above the dx + dW floor: R * V * element_size (the logits block, reused by every pass) +
4 V (fp32 db) + 4 N (row losses). R = max(ceil(N / 8), rows of a 64 MiB block), capped at N, so
the block is max(64 MiB, 1/8 of eager's logits): N=8192, V=128256 bf16 -> R=1024, 250.5 MiB (the
lean algorithm: ~104 MiB). dx and dW live from forward to backward. Backward's scaling is out of
place, so that retain_graph=True stays correct: eager autograd briefly holds a second dx + dW
there; under torch.compile + Inductor the saved grads are donated buffers, scaled in place.
Precision: as eager, logits are rounded to the input dtype once and their gradient once; the
softmax is fp32; dW is rounded once per pass, so at most 8 times. Against an fp64 reference, the
CPU test shape over 30 seeds: errors ~1x eager's (median), worst 1.6x (bf16 dx, 1 pass) and
1.85x (fp16 dW, 8 passes); the tests' bound is 2x.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from . import _lce_chunks as _chunks
from ._dispatch import no_double_backward, num_sms, use_triton
from ._round import rne_by_bits, round_code
from ._lce_chunks import _block, _dense, _num_warps, _rows_per_program, _view
from ._lce_logits import (_bad_targets, _dlogits, _dlogits_reference, _dlogits_vscaled, _dlogits_vscaled_reference,
                          _logits, _logits_reference, _reduce_like_eager, _vocab_scale)

_FAST_BLOCK_BYTES = 64 << 20
_FAST_MAX_PASSES = 8
_FAST_TILE = 4096


@triton.jit
def _lce_fast_rows_kernel(
    z_ptr,  # [R, V] in/out: raw logits x @ W.T (+ b) of one pass in the input dtype; becomes dzr
    target_ptr,  # [N] int64 targets
    loss_ptr,  # [N] fp32 out: row losses (0 on ignored rows)
    w_ptr,  # [1] fp32 per-row weight of the reduction: 1 ("sum") or 1 / count ("mean")
    vs_ptr,  # [V] fp32 per-vocabulary logit scale; unused unless HAS_VSCALE
    lse_ptr,  # [R] fp32 out: the pass's row logsumexps, for _lce_fast_cols_kernel; unused unless SUM_DS
    n0, R, V, stride_z, ignore_index, scale, softcap, on_target, off_target, smoothing,
    HAS_VSCALE: tl.constexpr, SUM_DS: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr,
    ROUND: tl.constexpr, ROUND_OPS: tl.constexpr, ROUND_OUT: tl.constexpr, RNE_BY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # [BLOCK_N, 1] rows of the pass
    r_ok = r < R
    row = n0 + r
    z_row = z_ptr + r.to(tl.int64) * stride_z
    t = tl.load(target_ptr + row, mask=r_ok, other=ignore_index)
    ignored = t == ignore_index
    # sweep 1: online max and sum-exp (and logit sum) over the row
    m = tl.full([BLOCK_N, 1], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N, 1], tl.float32)
    zsum = tl.zeros([BLOCK_N, 1], tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
        mask = r_ok & (cols < V)
        zr = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = _logits(zr, z_row, vs_ptr, cols, mask, scale, softcap, False, HAS_VSCALE, SOFTCAP, ROUND, ROUND_OPS,
                       RNE_BY_BITS)
        if SMOOTHING:
            zsum += tl.sum(tl.where(mask, z, 0.0), axis=1, keep_dims=True)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1, keep_dims=True))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=1, keep_dims=True)
        m = m_new
    lse = m + tl.log(s)
    # the target logit: one load (a target outside [0, V) is clamped, not checked: no host syncs)
    tc = tl.minimum(tl.maximum(t, 0), V - 1)
    zt, _ = _logits(tl.load(z_row + tc, mask=r_ok, other=0.0).to(tl.float32), z_row, vs_ptr, tc, r_ok, scale,
                    softcap, False, HAS_VSCALE, SOFTCAP, ROUND, ROUND_OPS, RNE_BY_BITS)
    loss = lse - zt
    if SMOOTHING:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - zsum / V)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, loss), mask=r_ok)
    if SUM_DS:  # the scale's grad sums over rows: sweep 2 runs by columns (_lce_fast_cols_kernel)
        tl.store(lse_ptr + r, lse, mask=r_ok)
    else:
        # sweep 2: dzr = w * (softmax - on_target * onehot - off_target) through _logits' chain rule
        # (a frozen scale's grad is not summed: its chain rule alone, as the column kernel's)
        w = tl.where(ignored, 0.0, tl.load(w_ptr))
        for v0 in range(0, V, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)[None, :]
            mask = r_ok & (cols < V)
            zr = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
            z, th = _logits(zr, z_row, vs_ptr, cols, mask, scale, softcap, False, HAS_VSCALE, SOFTCAP, ROUND,
                            ROUND_OPS, RNE_BY_BITS)
            dz = (tl.exp(z - lse) - off_target - tl.where(cols == t, on_target, 0.0)) * w
            if HAS_VSCALE:  # (its ds terms unused; a name of their own: `_` is sweep 1's [BLOCK_N, 1])
                dz, unused_terms = _dlogits_vscaled(dz, th, zr, vs_ptr, cols, mask, scale, softcap, SOFTCAP,
                                                    ROUND_OUT, RNE_BY_BITS)
            else:
                dz = _dlogits(dz, th, scale, softcap, SOFTCAP, ROUND, ROUND_OPS, RNE_BY_BITS)
            tl.store(z_row + cols, dz.to(z_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _lce_fast_cols_kernel(
    z_ptr,  # [R, V] in/out: raw logits x @ W.T (+ b) of one pass in the input dtype; becomes dzr
    target_ptr,  # [N] int64 targets
    lse_ptr,  # [R] fp32 row logsumexps of the pass (_lce_fast_rows_kernel)
    w_ptr,  # [1] fp32 per-row weight of the reduction
    vs_ptr,  # [V] fp32 per-vocabulary logit scale
    part_ptr,  # [G, V] fp32 out: the scale's grad summed over each of the G row groups' rows
    n0, R, V, rows_per_group, stride_z, ignore_index, scale, softcap, on_target, off_target,
    SOFTCAP: tl.constexpr, ROUND_OUT: tl.constexpr, RNE_BY_BITS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Sweep 2 of a pass with a per-vocabulary scale, by [row group, column tile]: dzr over the
    group's rows, and the scale's grad as their column sums in registers (each partial has one
    program; the host sums the G partials: deterministic)."""
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]  # [1, BLOCK_V]
    c_ok = cols < V
    group = tl.program_id(1)
    r_end = tl.minimum(R, (group + 1) * rows_per_group)
    w_all = tl.load(w_ptr)
    dvs = tl.zeros([BLOCK_V], tl.float32)
    for r0 in range(group * rows_per_group, r_end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)[:, None]  # [BLOCK_R, 1]
        r_ok = r < r_end
        mask = r_ok & c_ok
        t = tl.load(target_ptr + n0 + r, mask=r_ok, other=ignore_index)
        w = tl.where(t == ignore_index, 0.0, w_all)
        lse = tl.load(lse_ptr + r, mask=r_ok, other=0.0)
        zr = tl.load(z_ptr + r.to(tl.int64) * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        z, th = _logits(zr, z_ptr, vs_ptr, cols, mask, scale, softcap, False, True, SOFTCAP, 0, 0, False)
        dz = (tl.exp(z - lse) - off_target - tl.where(cols == t, on_target, 0.0)) * w
        dzr, terms = _dlogits_vscaled(dz, th, zr, vs_ptr, cols, mask, scale, softcap, SOFTCAP, ROUND_OUT, RNE_BY_BITS)
        tl.store(z_ptr + r.to(tl.int64) * stride_z + cols, dzr.to(z_ptr.dtype.element_ty), mask=mask)
        dvs += tl.sum(tl.where(mask, terms, 0.0), axis=0)
    c = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    tl.store(part_ptr + group.to(tl.int64) * V + c, dvs, mask=c < V)


def _fast_rows_per_pass(n: int, v: int, element_size: int) -> int:
    # <= 8 passes (each rounds dW once; precision) and a logits block >= 64 MiB (big matmuls).
    if _chunks._CHUNK_OVERRIDE is not None:
        return max(1, min(n, _chunks._CHUNK_OVERRIDE[0]))
    rows = max(triton.cdiv(n, _FAST_MAX_PASSES), triton.cdiv(_FAST_BLOCK_BYTES, v * element_size))
    return max(1, min(n, rows))


def _fast_tile(v: int) -> int:
    # Columns per step of a row sweep: 4096 = 8 warps x 16 elements; tests force small tiles.
    if _chunks._CHUNK_OVERRIDE is not None:
        return _block(_chunks._CHUNK_OVERRIDE[1])
    return min(triton.next_power_of_2(v), _FAST_TILE)


def _cols_tiles(rows: int, v: int) -> tuple[int, int]:
    # (BLOCK_R, BLOCK_V) of the column sweep: 32 x 512, the fastest of the eleven tiles probed on an
    # H100 at [1024, 128256] bf16 (bench/probe_lce_vscale.py); tests force small tiles (both loops run).
    if _chunks._CHUNK_OVERRIDE is not None:
        return 4, _block(_chunks._CHUNK_OVERRIDE[1])
    return min(triton.next_power_of_2(rows), 32), min(triton.next_power_of_2(v), 512)


def _cols_rows_per_group(rows: int, block_r: int, col_tiles: int, device: torch.device) -> int:
    # Rows per program of the column sweep (a multiple of BLOCK_R): about 8 programs per SM, as
    # one column tile per program leaves an H100 half idle at 128256 / 512 = 251 programs.
    groups = max(1, min(triton.cdiv(rows, block_r), triton.cdiv(8 * num_sms(device), col_tiles)))
    if _chunks._CHUNK_OVERRIDE is not None:  # tests: two groups, so the partials are summed
        groups = min(2, triton.cdiv(rows, block_r))
    return triton.cdiv(triton.cdiv(rows, groups), block_r) * block_r


def _fast_rows(z, target, loss_rows, w, vs, ds, n0, ignore_index, smoothing, softcap, scale, rounding, round_ops,
               on_triton):
    """One pass's row losses into loss_rows[n0:n0+R]; z (the pass's raw logits) becomes dzr;
    rounding: eager's roundings of the logit ops in z's dtype; round_ops: also of the scale and
    softcap (they run in z's dtype, before the .float()); vs: the [V] fp32 per-vocabulary scale or
    None, whose grad the pass adds to ds [V] fp32 unless ds is None (a frozen scale: no column sweep)."""
    rows, vocab = z.shape
    sum_ds = vs is not None and ds is not None
    if not on_triton:
        loss, dz, dvs = _fast_rows_reference(z, target[n0:n0 + rows], w, vs, ignore_index, smoothing, softcap,
                                             scale, rounding, round_ops, sum_ds)
        loss_rows[n0:n0 + rows] = loss
        z.copy_(dz)
        if sum_ds:
            ds += dvs
        return
    block = _fast_tile(vocab)
    block_n = _rows_per_program(rows, block, z.device)
    lse = torch.empty(rows, device=z.device, dtype=torch.float32) if sum_ds else None
    _lce_fast_rows_kernel[(triton.cdiv(rows, block_n),)](
        z, target, loss_rows, w, vs if vs is not None else w, lse if sum_ds else w, n0, rows, vocab,
        z.stride(0), ignore_index, scale, softcap, 1.0 - smoothing, smoothing / vocab, smoothing,
        HAS_VSCALE=vs is not None, SUM_DS=sum_ds, SOFTCAP=softcap > 0, SMOOTHING=smoothing > 0,
        ROUND=round_code(z.dtype, rounding), ROUND_OPS=round_code(z.dtype, rounding and round_ops),
        ROUND_OUT=round_code(z.dtype), RNE_BY_BITS=rne_by_bits(z.device), BLOCK_N=block_n, BLOCK=block,
        num_warps=_num_warps(block),
    )
    if sum_ds:
        block_r, block_v = _cols_tiles(rows, vocab)
        col_tiles = triton.cdiv(vocab, block_v)
        per_group = _cols_rows_per_group(rows, block_r, col_tiles, z.device)
        part = torch.empty(triton.cdiv(rows, per_group), vocab, device=z.device, dtype=torch.float32)
        _lce_fast_cols_kernel[(col_tiles, part.shape[0])](
            z, target, lse, w, vs, part, n0, rows, vocab, per_group, z.stride(0), ignore_index, scale, softcap,
            1.0 - smoothing, smoothing / vocab,
            SOFTCAP=softcap > 0, ROUND_OUT=round_code(z.dtype), RNE_BY_BITS=rne_by_bits(z.device), BLOCK_R=block_r,
            BLOCK_V=block_v, num_warps=_num_warps(block_r * block_v),
        )
        ds += part.sum(0)


@torch.library.custom_op("fxfuse::linear_cross_entropy_fast", mutates_args=())
def linear_cross_entropy_fast(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], target: torch.Tensor,
    ignore_index: int, reduction: str, label_smoothing: float, softcap: float, logit_scale: float,
    eager_rounding: bool, fp32_transform: bool, need_dx: bool, need_dw: bool, need_db: bool,
    vocab_scale: Optional[torch.Tensor] = None, need_ds: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dx, dweight, dbias, dvocab_scale) for an upstream gradient of 1; each one not needed is
    empty (the scale's grad only with need_ds: without it a scaled pass skips the column sweep)."""
    x, weight, target, bias = _dense(x, weight, target, bias)
    vs = _vocab_scale(vocab_scale, weight, eager_rounding)
    n, h = x.shape
    vocab = weight.shape[0]
    need_db = need_db and bias is not None
    ds = torch.zeros(vocab, device=x.device, dtype=torch.float32) if need_ds and vs is not None else None
    on_triton = x.is_cuda or use_triton(x)
    if reduction == "mean":  # on the device: 1 / 0 = inf on an all-ignored batch weighs no row
        count = (target != ignore_index).sum()
        w = (1.0 / count.float()).reshape(1)
    else:
        w = torch.ones(1, device=x.device, dtype=torch.float32)
    bad = _bad_targets(target, ignore_index, vocab)  # nan row losses, and every gradient nan (no host sync)
    w = w.masked_fill(bad.any(), float("nan"))
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = (weight.new_zeros if n == 0 else weight.new_empty)(weight.shape) if need_dw else weight.new_empty(0)
    db = torch.zeros(vocab, device=x.device, dtype=torch.float32) if need_db else None
    loss_rows = torch.empty(n, device=x.device, dtype=torch.float32)
    rows = _fast_rows_per_pass(n, vocab, x.element_size())
    zbuf = torch.empty(min(rows, n) * vocab, device=x.device, dtype=x.dtype)
    b = bias.to(x.dtype) if bias is not None else None  # cast once, not per pass
    for n0 in range(0, n, rows):
        xs = x[n0:n0 + rows]
        z = _view(zbuf, xs.shape[0], vocab)
        if b is not None:
            torch.addmm(b, xs, weight.T, out=z)
        else:
            torch.mm(xs, weight.T, out=z)
        _fast_rows(z, target, loss_rows, w, vs, ds, n0, ignore_index, label_smoothing, softcap, logit_scale,
                   eager_rounding, not fp32_transform, on_triton)
        if need_dx:
            torch.mm(z, weight, out=dx[n0:n0 + rows])
        if need_dw and n0 == 0:
            torch.mm(z.T, xs, out=dw)
        elif need_dw:
            dw.addmm_(z.T, xs)
        if need_db:
            db += z.sum(0, dtype=torch.float32)
    loss = _reduce_like_eager(loss_rows.masked_fill_(bad, float("nan")), target, ignore_index, reduction)
    ds = ds if ds is not None else x.new_empty(0)
    return loss, dx, dw, db.to(bias.dtype) if need_db else x.new_empty(0), ds


@linear_cross_entropy_fast.register_fake
def _(x, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, logit_scale,
      eager_rounding, fp32_transform, need_dx, need_dw, need_db, vocab_scale=None, need_ds=False):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    db = bias.new_empty(bias.shape) if need_db and bias is not None else x.new_empty(0)
    need_ds = need_ds and vocab_scale is not None
    ds = x.new_empty(weight.shape[0], dtype=torch.float32) if need_ds else x.new_empty(0)
    return x.new_empty((), dtype=torch.float32), dx, dw, db, ds


def _setup_context(ctx, inputs, output):
    # vocab_scale and need_ds where the call passed them
    bias, (need_dx, need_dw, need_db) = inputs[2], inputs[11:14]
    vocab_scale, need_ds = (*inputs[14:], None, False)[:2]
    ctx.computed = (need_dx, need_dw, need_db and bias is not None, need_ds and vocab_scale is not None)
    target, ignore_index = inputs[3], inputs[4]
    ctx.save_for_backward(*output[1:], (target != ignore_index).any())  # [4 grads], 0-dim bool: a row counts
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, dloss, _ddx, _ddw, _ddb, _dds):
    *grads, counted = ctx.saved_tensors
    needs = ctx.needs_input_grad  # one per input the call passed: 14, or 15 / 16 with vocab_scale
    wanted = [need and have for need, have in zip((*needs[:3], len(needs) > 14 and needs[14]), ctx.computed)]
    if dloss is None or not any(wanted):
        return (None,) * len(needs)
    # every row ignored: the grads are zeros and stay zeros, as eager's, whatever dloss is (an
    # all-ignored micro-batch's sum / its own count of 0 gives dloss = inf, and 0 * inf = nan)
    dloss = torch.where(counted, dloss, 0.0)
    out = [g * dloss if want else None for g, want in zip(grads, wanted)]
    if torch.is_grad_enabled():  # create_graph=True: the precomputed grads have no derivative
        kept = [g for g in out if g is not None]
        it = iter(no_double_backward(torch.ops.fxfuse.linear_cross_entropy_fast.default, tuple(kept)))
        out = [next(it) if g is not None else None for g in out]
    dx, dw, db, ds = out
    return ((dx, dw, db) + (None,) * 11 + (ds, None))[:len(needs)]


linear_cross_entropy_fast.register_autograd(_backward, setup_context=_setup_context)


def _fast_rows_reference(zr, target, w, vs, ignore_index, smoothing, softcap, scale, rounding, round_ops,
                         sum_ds=True):
    """PyTorch twin of _lce_fast_rows_kernel (and, with a scale vs, _lce_fast_cols_kernel): (row
    losses [R] fp32, dzr [R, V] fp32, the scale's grad [V] fp32, or None without a scale or sum_ds) of
    one pass."""
    rows, vocab = zr.shape
    low = zr.dtype if rounding else None
    z, t = _logits_reference(zr.float(), None, 0, softcap, scale, low, round_ops, vs)
    ignored = target == ignore_index
    lse = z.logsumexp(1)
    zt = z.gather(1, target.clamp(0, vocab - 1)[:, None])[:, 0]
    loss = lse - zt
    if smoothing > 0:
        loss = (1.0 - smoothing) * loss + smoothing * (lse - z.sum(1) / vocab)
    onehot = torch.arange(vocab, device=z.device)[None, :] == target[:, None]
    dz = (z - lse[:, None]).exp() - smoothing / vocab - onehot * (1.0 - smoothing)
    dz = dz * torch.where(ignored, 0.0, w)[:, None]
    if vs is None:
        return torch.where(ignored, 0.0, loss), _dlogits_reference(dz, t, scale, softcap, low, round_ops), None
    dzr, terms = _dlogits_vscaled_reference(dz, t, zr.float(), vs, 0, scale, softcap, sum_ds)
    return torch.where(ignored, 0.0, loss), dzr, terms.sum(0) if sum_ds else None
