"""Shared by the gated-MLP kernels (swiglu.py, clamped_swiglu.py): gate / up tile loads and
gradient stores in either layout, rounding at the store, tile sizing, [M, I] row views.

Layouts of a [M, I] gate / up pair (and of the dgate / dup pair a backward writes):
    PAIR 0: two tensors, each with its own row and column strides (separate linears, the halves
            of chunk(2, -1), a stride-2 view taken alone)
    PAIR 1: one [M, 2I] tensor with contiguous columns, gate at the even columns and up at the odd
            (gpt-oss's gate_up[..., ::2], [..., 1::2]); PAIR 2: up at the even columns.
The paired layouts move one contiguous [BLOCK_M, 2 BLOCK_N] tile, split or joined in registers:
two stride-2 accesses use half of every 32-byte sector each, and stride-2 stores of the two
halves of one sector are two partial writes of it (H200, 65536x2880 bf16 fwd+bwd: 2.7 ms strided,
against 1.3 ms for Inductor's fused kernels).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._round import rne_by_bits


@triton.jit
def round_store(x, DTYPE: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even. The interpreter truncates fp32 -> bf16 (the GPU rounds),
    so under it bf16 is rounded by hand on the bits (NaN kept quiet) to test the GPU's numerics."""
    if RNE_BY_BITS:
        if DTYPE == tl.bfloat16:  # a mixed-dtype op also stores fp32 under the same flag
            bits = x.to(tl.uint32, bitcast=True)
            rne = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return tl.where(x != x, (bits >> 16) | 0x40, rne).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def load_tile(ptr, rows, pid_n, M, I, stride_m, stride_n, BLOCK_N: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile of an [M, I] tensor with strides (stride_m, stride_n): columns
    pid_n * BLOCK_N + [0, BLOCK_N) of rows; masked elements are 0."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    offs = rows.to(tl.int64)[:, None] * stride_m + cols.to(tl.int64)[None, :] * stride_n  # can pass 2**31
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_pair(
    a_ptr,  # PAIR 0: [M, I], strides (stride_am, stride_an); else [M, 2I], strides (stride_am, 1)
    b_ptr,  # PAIR 0: [M, I], strides (stride_bm, stride_bn); else unused
    rows,  # [BLOCK_M] row indices
    pid_n,  # column block: columns pid_n * BLOCK_N + [0, BLOCK_N) of a and b
    M,
    I,
    stride_am,
    stride_an,
    stride_bm,
    stride_bn,
    PAIR: tl.constexpr,  # layout (module docstring); a is the first of the pair (gate)
    LOAD_B: tl.constexpr,  # PAIR 0: False leaves b unread (zeros)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(a, b): fp32 [BLOCK_M, BLOCK_N] tiles; masked elements are 0."""
    if PAIR == 0:
        a = load_tile(a_ptr, rows, pid_n, M, I, stride_am, stride_an, BLOCK_N)
        b = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if LOAD_B:
            b = load_tile(b_ptr, rows, pid_n, M, I, stride_bm, stride_bn, BLOCK_N)
        return a, b
    x = load_tile(a_ptr, rows, pid_n, M, 2 * I, stride_am, 1, 2 * BLOCK_N)
    even, odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N, 2)))
    if PAIR == 1:
        return even, odd
    return odd, even


@triton.jit
def store_out(
    out_ptr,  # [M, I] contiguous
    x,  # fp32 [BLOCK_M, BLOCK_N] tile
    rows,
    pid_n,
    M,
    I,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """x rounded to out's dtype, stored at columns pid_n * BLOCK_N + [0, BLOCK_N) (a forward's output)."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < I)[None, :]
    offs = rows.to(tl.int64)[:, None] * I + cols[None, :]
    tl.store(out_ptr + offs, round_store(x, out_ptr.dtype.element_ty, RNE_BY_BITS), mask=mask)


@triton.jit
def store_pair(
    a_ptr,  # PAIR 0: [M, I], strides (stride_m, stride_n); else [M, 2I], strides (stride_m, 1)
    b_ptr,  # PAIR 0: [M, I], strides (stride_m, stride_n); else unused
    a,  # fp32 [BLOCK_M, BLOCK_N] tile for a (unstored unless STORE_A)
    b,  # fp32 [BLOCK_M, BLOCK_N] tile for b (unstored unless STORE_B)
    rows,
    pid_n,
    M,
    I,
    stride_m,
    stride_n,
    PAIR: tl.constexpr,  # paired layouts store both
    STORE_A: tl.constexpr,
    STORE_B: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """a and b each rounded to its output's dtype (PAIR 0: they may differ, as a mixed-dtype swiglu's
    dgate and dup do), stored at columns pid_n * BLOCK_N + [0, BLOCK_N)."""
    r64 = rows.to(tl.int64)[:, None]
    dtype = a_ptr.dtype.element_ty
    if PAIR == 0:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < I)[None, :]
        offs = r64 * stride_m + cols.to(tl.int64)[None, :] * stride_n
        if STORE_A:
            tl.store(a_ptr + offs, round_store(a, dtype, RNE_BY_BITS), mask=mask)
        if STORE_B:
            tl.store(b_ptr + offs, round_store(b, b_ptr.dtype.element_ty, RNE_BY_BITS), mask=mask)
    else:
        cols = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        mask = (rows < M)[:, None] & (cols < 2 * I)[None, :]
        x = tl.join(a, b) if PAIR == 1 else tl.join(b, a)
        x = round_store(tl.reshape(x, (BLOCK_M, 2 * BLOCK_N)), dtype, RNE_BY_BITS)
        tl.store(a_ptr + r64 * stride_m + cols[None, :], x, mask=mask)


def check_pair(op: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    """gate and up: one shape (with a last dim) and one dtype, or a ValueError naming fxfuse.<op>."""
    if gate.dim() == 0:
        raise ValueError(f"fxfuse.{op}: gate and up need a last dim (got 0-dim tensors)")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"fxfuse.{op}: gate {gate.shape}/{gate.dtype} and up {up.shape}/{up.dtype} differ")


def rows(t: torch.Tensor) -> torch.Tensor:
    """[..., I] -> an [M, I] view (any strides); copies only if the leading dims do not merge."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return t.reshape(-1, t.shape[-1]).contiguous()


def pair(a: torch.Tensor, b: torch.Tensor) -> tuple[tuple, int]:
    """[M, I] views a, b -> ((pointer tensors and strides for load_pair / store_pair), PAIR):
    ((base [M, 2I], base, row stride, 1, 0, 0), 1 or 2) when a and b interleave one tensor's
    contiguous columns, else ((a, b, *a's strides, *b's strides), 0)."""
    m, n = a.shape
    if (a.stride(-1) == 2 and b.stride() == a.stride() and abs(a.storage_offset() - b.storage_offset()) == 1
            and (m == 1 or a.stride(0) >= 2 * n) and a.dtype == b.dtype
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()):
        first = a if a.storage_offset() < b.storage_offset() else b
        base = first.as_strided((m, 2 * n), (a.stride(0), 1))
        return (base, base, a.stride(0), 1, 0, 0), 1 if first is a else 2
    return (a, b, *a.stride(), *b.stride()), 0


def out_pair(dgate: torch.Tensor, dup: torch.Tensor, need_dgate: bool, need_dup: bool) -> tuple[tuple, int]:
    """The [..., I] gradients a backward kernel writes -> ((a_ptr, b_ptr, stride_m, stride_n), PAIR):
    both contiguous, both the columns of one d gate_up (paired when they interleave it), or one
    alone. Each must be viewable as [M, I] rows: a copy would lose the kernel's writes."""
    if need_dgate and need_dup and dgate.stride(-1) == 2:
        (base, _, stride_m, stride_n, _, _), code = pair(*(t.view(-1, t.shape[-1]) for t in (dgate, dup)))
        if code:
            return (base, base, stride_m, stride_n), code
    strides = {_row_strides(t) for t, need in ((dgate, need_dgate), (dup, need_dup)) if need}
    if len(strides) != 1:
        raise ValueError(f"fxfuse: dgate and dup strides differ: {strides}")
    return (dgate, dup, *strides.pop()), 0


def copy_outputs(outs: tuple, values: tuple, needs: tuple) -> None:
    """The PyTorch reference path of a backward into given outputs: each needed one copied in."""
    for out, value, need in zip(outs, values, needs):
        if need:
            out.copy_(value)


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    # contiguous first: a fresh gradient needs no view (host time per call)
    return (t.shape[-1], 1) if t.is_contiguous() else t.view(-1, t.shape[-1]).stride()


def _overwrites(outs: tuple, ins: tuple) -> bool:
    """An output shares storage with an input (fxfuse.reinplace's *_into calls). The kernel then
    waits for all of a tile's loads before its stores: an output element need not depend on the
    input element it overwrites (packed SwiGLU's dup over up), and Triton does not order one
    thread's store after another thread's load of the same address."""
    read = {t.untyped_storage().data_ptr() for t in ins}
    return any(t.untyped_storage().data_ptr() in read for t in outs)


def backward_args(grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor,
                  dup: torch.Tensor, need_dgate: bool, need_dup: bool) -> tuple[list, dict, int, int]:
    """The gated backward kernels' leading arguments (dout, gate, up, dgate, dup pointers, M, I and
    their strides, in kernel order), their PAIR / OUT_PAIR / READ_BEFORE_WRITE constexprs, and M, I."""
    outs, out_code = out_pair(dgate, dup, need_dgate, need_dup)
    ins, pair_code = pair(rows(gate), rows(up))
    d2 = rows(grad_out)
    m, n = d2.shape
    args = [d2, *ins[:2], *outs[:2], m, n, *d2.stride(), *ins[2:], *outs[2:]]
    written = tuple(t for t, need in ((dgate, need_dgate), (dup, need_dup)) if need)
    layouts = {"PAIR": pair_code, "OUT_PAIR": out_code,
               "READ_BEFORE_WRITE": _overwrites(written, (grad_out, gate, up))}
    return args, layouts, m, n


def _block_n(n_cols: int, max_tile: int) -> int:
    # Whole rows up to max_tile columns, halved while the ragged last column block would pad the
    # row by > 15% (I=11008 -> 4096); >= 1024 keeps 16-byte vectors on every thread.
    bn = min(triton.next_power_of_2(n_cols), max_tile)
    while bn > 1024 and triton.cdiv(n_cols, bn) * bn > 1.15 * n_cols:
        bn //= 2
    return bn


def _block_m(block_n: int, max_tile: int) -> int:
    # Short rows are batched into tiles of min(max_tile, 4096) elements (>= 4 KiB per tensor).
    return max(1, min(max_tile, 4096) // block_n)


def _num_warps(block_m: int, block_n: int) -> int:
    # 16 elements (two 16-byte bf16 vectors) per thread per tensor: 2048 -> 4 warps, 8192 -> 16.
    return max(1, min(16, block_m * block_n // 512))


def _launch_grid(m: int, n: int, block_m: int, block_n: int) -> tuple[int, int]:
    # Rows on grid axis 0 (up to 2**31 - 1 programs); column blocks on axis 1 (<= 65535).
    return (triton.cdiv(m, block_m), triton.cdiv(n, block_n))


@functools.lru_cache(maxsize=1024)
def launch_config(m: int, n: int, max_tile: int) -> tuple[tuple[int, int], int, int, int]:
    """(grid, BLOCK_M, BLOCK_N, num_warps) for [m, n] rows, programs of <= max_tile elements per
    tensor (cached: sizing costs host time per call)."""
    bn = _block_n(n, max_tile)
    bm = _block_m(bn, max_tile)
    return _launch_grid(m, n, bm, bn), bm, bn, _num_warps(bm, bn)


def _rne_bf16(t: torch.Tensor) -> bool:
    return t.dtype == torch.bfloat16 and rne_by_bits(t.device)  # round_store's bit path is bf16 only


def launch_forward(kernel, gate: torch.Tensor, up: torch.Tensor, scalars: tuple, max_tile: int,
                   out_dtype: torch.dtype | None = None, **constexprs) -> torch.Tensor:
    """out: contiguous [..., I] in out_dtype (default gate's), from a gated forward kernel whose
    arguments are (gate, up, out pointers, M, I, gate's and up's strides, *scalars) and the constexprs
    PAIR, RNE_BY_BITS, BLOCK_M, BLOCK_N plus the op's own."""
    out = torch.empty(gate.shape, dtype=out_dtype or gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    g2, u2 = rows(gate), rows(up)
    ins, pair_code = pair(g2, u2)
    m, n = g2.shape
    grid, bm, bn, num_warps = launch_config(m, n, max_tile)
    kernel[grid](*ins[:2], out, m, n, *ins[2:], *scalars, PAIR=pair_code, RNE_BY_BITS=_rne_bf16(out) or _rne_bf16(gate),
                 BLOCK_M=bm, BLOCK_N=bn, num_warps=num_warps, **constexprs)
    return out


def launch_backward(kernel, grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, dgate: torch.Tensor,
                    dup: torch.Tensor, need_dgate: bool, need_dup: bool, scalars: tuple, max_tile: int,
                    **constexprs) -> None:
    """Runs a gated backward kernel whose arguments are backward_args's then *scalars, with the
    constexprs PAIR, OUT_PAIR, READ_BEFORE_WRITE, NEED_DGATE, NEED_DUP, RNE_BY_BITS, BLOCK_M, BLOCK_N
    plus the op's own; it writes dgate and / or dup."""
    args, layouts, m, n = backward_args(grad_out, gate, up, dgate, dup, need_dgate, need_dup)
    grid, bm, bn, num_warps = launch_config(m, n, max_tile)
    kernel[grid](*args, *scalars, **layouts, NEED_DGATE=need_dgate, NEED_DUP=need_dup,
                 RNE_BY_BITS=_rne_bf16(gate) or _rne_bf16(up),
                 BLOCK_M=bm, BLOCK_N=bn, num_warps=num_warps, **constexprs)


class GatedFunction(torch.autograd.Function):
    """Autograd of an unpacked gated op ``forward_op(gate, up, *args)`` whose ``backward_op`` takes
    ``(grad_out, gate, up, *args[:flags_at], need_dgate, need_dup, *args[flags_at:])`` and returns
    (dgate, dup); saves only gate and up (views of gate_up stay views; the activation is recomputed).
    Each op subclasses it with its two ops and flags_at (swiglu_packed.py's _PackedFunction, for
    the packed ops, is its twin); backward_tail, when set, is how many of args[flags_at:] the backward
    takes (fxfuse::swiglu's out_dtype shapes only the forward's output)."""

    forward_op = backward_op = None
    flags_at = 0
    backward_tail: int | None = None

    @classmethod
    def forward(cls, ctx, gate, up, *args):
        ctx.save_for_backward(gate, up)
        ctx.args = args
        with torch._C._AutoDispatchBelowAutograd():
            return cls.forward_op(gate, up, *args)

    @classmethod
    def backward(cls, ctx, grad_out):
        gate, up = ctx.saved_tensors
        need_dgate, need_dup = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rest = (None,) * len(ctx.args)
        if not (need_dgate or need_dup):
            return (None, None, *rest)
        k = cls.flags_at
        tail = ctx.args[k:] if cls.backward_tail is None else ctx.args[k:k + cls.backward_tail]
        dgate, dup = cls.backward_op(grad_out, gate, up, *ctx.args[:k], need_dgate, need_dup, *tail)
        return (dgate if need_dgate else None, dup if need_dup else None, *rest)
