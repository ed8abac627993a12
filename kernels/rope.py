"""Rotary position embedding of q and k in one launch: ``torch.ops.fxfuse.rope``.

Shapes: q [B, Hq, T, D] or [B, T, Hq, D] (any strides), k the same layout with Hk <= Hq heads,
D even. cos, sin: rank 4, last dim r = rotary_dim (even, <= D), every other dim equal to q's or 1
(broadcast; the head dim must be 1 when Hk < Hq). fp32 math, one rounding to the output dtype;
with round_products (backend option numerics="eager" on a rotation the graph computes in bf16 /
fp16) each product below is rounded to that dtype before the sum, as eager's three ops store them.

Forward, per channel i < r, with partner p(i) and sign s(i):
    out[i] = x[i] * cos[i] + s(i) * x[p(i)] * sin[i]          out[i] = x[i] for i >= r
    non-interleaved (HF rotate_half): p(i) = i + r/2, s = -1 for i < r/2; p(i) = i - r/2, s = +1
    interleaved (Meta complex pairs):  p(i) = i ^ 1,   s = -1 for even i, +1 for odd i
Backward (the transpose of that per-row linear map):
    dx[j] = dy[j] * cos[j] + s(p(j)) * dy[p(j)] * sin[p(j)]    dx[j] = dy[j] for j >= r
Pairing channel a (i < r/2, or even i) with its partner b the two directions are
    forward:  out_a = x_a c_a - x_b s_a     out_b = x_b c_b + x_a s_b
    backward: dx_a = dy_a c_a + dy_b s_b    dx_b = dy_b c_b - dy_a s_a
which is the whole kernel. No gradient flows to cos/sin: the op refuses backward when they require
grad. Outputs are new tensors with q's / k's shape, dtype and memory layout (_like: eager's
elementwise ops keep a transposed q's layout, and graphs traced from eager may view the result
assuming it), gradients with dq_out's / dk_out's.

Launch layout: a program takes BLOCK_C cos positions (e.g. (b, t) pairs for cos [B, 1, T, r]),
loads their cos/sin once and rotates every q row and then every k row sharing each (e.g. all
Hq + Hk heads), so cos/sin are read once and q, k once each: one pass over memory per direction.
BLOCK_C is 1 on the GPU, many under Triton's interpreter (_launch_meta). Any strides; rows are
found by int32 index arithmetic on the broadcast dims only, then 64-bit offsets.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ._dispatch import INTERPRETER_TILE, no_double_backward, register_autograd, use_triton
from ._round import rne_by_bits, round_code, round_ref, round_to


@triton.jit
def _to_out(x, o_ptr, RNE_BY_HAND: tl.constexpr):
    """fp32 x cast to o's dtype, rounding to nearest even (by hand where the cast truncates)."""
    if RNE_BY_HAND and o_ptr.dtype.element_ty == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000  # now exactly representable in bf16
        x = b.to(tl.float32, bitcast=True)
    return x.to(o_ptr.dtype.element_ty)


@triton.jit
def _rope_rows(
    x_ptr,  # input [S0, S1, S2, D], strides (sx0, sx1, sx2, sxd)
    o_ptr,  # output [S0, S1, S2, D], strides (so0, so1, so2, 1)
    ca, cb, sa, sb,  # fp32 [BLOCK_C, 1, BLOCK_R // 2]: cos/sin at the a-channels and their partners b
    c0, c1, c2,  # int64 [BLOCK_C, 1, 1]: each position's index on the dims cos does not broadcast over
    pos_ok,  # [BLOCK_C, 1, 1]: the position exists (the last program's block may run past the end)
    M, I1, I2,  # rows per position; sizes of the broadcast dims (1 on the others), I0 = M / (I1 I2)
    sx0, sx1, sx2, sxd, so0, so1, so2,
    D: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    ROUND: tl.constexpr, RNE_BY_HAND: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotates the M rows of x that share each of the program's BLOCK_C positions into o."""
    HALF: tl.constexpr = BLOCK_R // 2
    j = tl.arange(0, HALF)[None, None, :]  # [1, 1, HALF] pair index
    jr = tl.arange(0, BLOCK_R)[None, None, :]  # [1, 1, BLOCK_R] channel index (interleaved load/store)
    x_pos = x_ptr + c0 * sx0 + c1 * sx1 + c2 * sx2  # [BLOCK_C, 1, 1]
    o_pos = o_ptr + c0 * so0 + c1 * so1 + c2 * so2
    for m0 in range(0, M, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)[None, :, None]  # [1, BLOCK_M, 1] int32
        row_ok = pos_ok & (rows < M)  # [BLOCK_C, BLOCK_M, 1]
        i0 = (rows // (I1 * I2)).to(tl.int64)
        i1 = ((rows // I2) % I1).to(tl.int64)
        i2 = (rows % I2).to(tl.int64)
        x_row = x_pos + (i0 * sx0 + i1 * sx1 + i2 * sx2)  # [BLOCK_C, BLOCK_M, 1]
        o_row = o_pos + (i0 * so0 + i1 * so1 + i2 * so2)
        if INTERLEAVED:
            m = row_ok & (jr < R)
            x = tl.load(x_row + jr * sxd, mask=m, other=0.0).to(tl.float32)
            xa, xb = tl.split(tl.reshape(x, [BLOCK_C, BLOCK_M, HALF, 2]))
        else:
            m = row_ok & (j < R // 2)
            xa = tl.load(x_row + j * sxd, mask=m, other=0.0).to(tl.float32)
            xb = tl.load(x_row + (j + R // 2) * sxd, mask=m, other=0.0).to(tl.float32)
        # ROUND: each product rounded before the sum, as eager's x * cos + rotate_half(x) * sin
        if BACKWARD:
            oa = round_to(xa * ca, ROUND, RNE_BY_HAND) + round_to(xb * sb, ROUND, RNE_BY_HAND)
            ob = round_to(xb * cb, ROUND, RNE_BY_HAND) - round_to(xa * sa, ROUND, RNE_BY_HAND)
        else:
            oa = round_to(xa * ca, ROUND, RNE_BY_HAND) - round_to(xb * sa, ROUND, RNE_BY_HAND)
            ob = round_to(xb * cb, ROUND, RNE_BY_HAND) + round_to(xa * sb, ROUND, RNE_BY_HAND)
        if INTERLEAVED:
            o = tl.reshape(tl.join(oa, ob), [BLOCK_C, BLOCK_M, BLOCK_R])
            tl.store(o_row + jr, _to_out(o, o_ptr, RNE_BY_HAND), mask=m)
        else:
            tl.store(o_row + j, _to_out(oa, o_ptr, RNE_BY_HAND), mask=m)
            tl.store(o_row + j + R // 2, _to_out(ob, o_ptr, RNE_BY_HAND), mask=m)
        if BLOCK_P > 0:
            jp = tl.arange(0, BLOCK_P)[None, None, :]  # [1, 1, BLOCK_P] pass-through channel past R
            mp = row_ok & (jp < D - R)
            xp = tl.load(x_row + (R + jp) * sxd, mask=mp, other=0.0)
            tl.store(o_row + R + jp, xp.to(o_ptr.dtype.element_ty), mask=mp)


@triton.jit
def _rope_kernel(
    q_ptr, qo_ptr,  # q and its output [Sq0, Sq1, Sq2, D]; strides (sq*, sqd), (sqo*, 1)
    k_ptr, ko_ptr,  # k and its output [Sk0, Sk1, Sk2, D]; strides (sk*, skd), (sko*, 1)
    cos_ptr, sin_ptr,  # [C0, C1, C2, R], C = 1 on the dims q/k broadcast over; strides (cs*), (ss*)
    Mq, Iq1, Iq2, sq0, sq1, sq2, sqd, sqo0, sqo1, sqo2,
    Mk, Ik1, Ik2, sk0, sk1, sk2, skd, sko0, sko1, sko2,
    P, C1, C2, cs0, cs1, cs2, csd, ss0, ss1, ss2, ssd,  # P = C0 * C1 * C2 positions
    D: tl.constexpr, R: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr,
    ROUND: tl.constexpr, RNE_BY_HAND: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_MQ: tl.constexpr,
    BLOCK_MK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program = BLOCK_C cos positions: their Mq rows of q each, then their Mk rows of k (0 = absent)."""
    p = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None, None]  # [BLOCK_C, 1, 1] flat (c0, c1, c2)
    pos_ok = p < P
    c2 = (p % C2).to(tl.int64)
    c1 = ((p // C2) % C1).to(tl.int64)
    c0 = (p // (C2 * C1)).to(tl.int64)
    j = tl.arange(0, BLOCK_R // 2)[None, None, :]
    if INTERLEAVED:
        ja = 2 * j
        jb = 2 * j + 1
    else:
        ja = j
        jb = j + R // 2
    mr = pos_ok & (j < R // 2)
    c_pos = cos_ptr + c0 * cs0 + c1 * cs1 + c2 * cs2
    s_pos = sin_ptr + c0 * ss0 + c1 * ss1 + c2 * ss2
    ca = tl.load(c_pos + ja * csd, mask=mr, other=0.0).to(tl.float32)
    cb = tl.load(c_pos + jb * csd, mask=mr, other=0.0).to(tl.float32)
    sa = tl.load(s_pos + ja * ssd, mask=mr, other=0.0).to(tl.float32)
    sb = tl.load(s_pos + jb * ssd, mask=mr, other=0.0).to(tl.float32)
    _rope_rows(q_ptr, qo_ptr, ca, cb, sa, sb, c0, c1, c2, pos_ok, Mq, Iq1, Iq2, sq0, sq1, sq2, sqd,
               sqo0, sqo1, sqo2, D, R, INTERLEAVED, BACKWARD, ROUND, RNE_BY_HAND, BLOCK_C, BLOCK_MQ,
               BLOCK_R, BLOCK_P)
    _rope_rows(k_ptr, ko_ptr, ca, cb, sa, sb, c0, c1, c2, pos_ok, Mk, Ik1, Ik2, sk0, sk1, sk2, skd,
               sko0, sko1, sko2, D, R, INTERLEAVED, BACKWARD, ROUND, RNE_BY_HAND, BLOCK_C, BLOCK_MK,
               BLOCK_R, BLOCK_P)


def _next_pow2(n: int) -> int:
    """triton.next_power_of_2 for n >= 1 in plain Python (Triton's is a slower constexpr_function)."""
    return 1 << (n - 1).bit_length()


def _rows_per_tile(m: int, block_d: int) -> int:
    """Rows per loop step: ~1024-element tiles (H200 sweep: small tiles, many resident programs)."""
    return max(1, min(_next_pow2(max(m, 1)), 1024 // block_d))


def _num_warps(block_d: int) -> int:
    """2 warps: 64 threads x 16 elements (two 16-byte bf16 vectors) cover a 1024-element tile."""
    return max(2, min(8, block_d // 512))


# Tests set a positions-per-program count here to run the interpreter with the GPU's one.
_BLOCK_C_OVERRIDE: Optional[int] = None


@functools.lru_cache(maxsize=1024)
def _launch_meta(d: int, rotary_dim: int, mq: int, mk: int, positions: int,
                 interpreted: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_C, BLOCK_MQ, BLOCK_MK, BLOCK_R, BLOCK_P, num_warps) for D, r, q's / k's rows per
    position and the number of positions. On the GPU one position per program (its cos/sin loaded
    once, rows in ~1024-element steps over many resident programs: H200 sweep); under the
    interpreter every row of a position in one step and as many positions as fit INTERPRETER_TILE."""
    block_d = _next_pow2(d)
    block_r = _next_pow2(rotary_dim)
    block_p = _next_pow2(d - rotary_dim) if d > rotary_dim else 0
    if not interpreted:
        return (1, _rows_per_tile(mq, block_d), _rows_per_tile(mk, block_d), block_r, block_p,
                _num_warps(block_d))
    rows = lambda m: min(_next_pow2(max(m, 1)), max(1, INTERPRETER_TILE // block_d))  # noqa: E731
    block_mq, block_mk = rows(mq), rows(mk)
    block_c = min(_next_pow2(positions), max(1, INTERPRETER_TILE // (max(block_mq, block_mk) * block_d)))
    return block_c, block_mq, block_mk, block_r, block_p, 1


def _check(x: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int):
    """Validates the documented layout contract (real tensors only: Python ints from shapes)."""
    if x.dim() != 4 or k.dim() != 4 or cos.dim() != 4 or cos.shape != sin.shape:
        raise ValueError("fxfuse.rope: q, k, cos, sin must be 4-D and cos, sin of one shape")
    d = x.shape[-1]
    if d % 2 or k.shape[-1] != d or rotary_dim % 2 or not 0 < rotary_dim <= d:
        raise ValueError(f"fxfuse.rope: need even D == k's D and even 0 < rotary_dim <= D, got "
                         f"D={d}, k D={k.shape[-1]}, rotary_dim={rotary_dim}")
    if cos.shape[-1] != rotary_dim:
        raise ValueError(f"fxfuse.rope: cos last dim {cos.shape[-1]} != rotary_dim {rotary_dim}")
    for c, xs, ks in zip(cos.shape[:3], x.shape[:3], k.shape[:3]):
        if c != 1 and (c != xs or c != ks):
            raise ValueError(f"fxfuse.rope: cos {tuple(cos.shape)} does not broadcast against "
                             f"q {tuple(x.shape)} and k {tuple(k.shape)} without expanding them")


def _row_args(x, o, cos_shape, stand_in) -> tuple:
    """_rope_kernel's arguments for one of q/k: (x, o, M, I1, I2, x strides (4), o strides (3)).
    I = x's size on the dims cos broadcasts over, else 1; an absent x (None) has M = 0 rows."""
    if x is None:  # any tensor stands in for the pointers
        return (stand_in, stand_in, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0)
    s0, s1, s2, _ = x.shape
    i0 = s0 if cos_shape[0] == 1 else 1
    i1 = s1 if cos_shape[1] == 1 else 1
    i2 = s2 if cos_shape[2] == 1 else 1
    o0, o1, o2, _ = o.stride()
    return (x, o, i0 * i1 * i2, i1, i2, *x.stride(), o0, o1, o2)


def _like(x: torch.Tensor) -> torch.Tensor:
    """An output for x: x's strides where x is dense (empty_like: the layout eager's ``q * cos + ...``
    gives), contiguous where that would leave the channel dim strided (the kernel stores rows)."""
    o = torch.empty_like(x)
    return o if o.stride(-1) == 1 else x.new_empty(x.shape)


def _launch(q, k, cos, sin, interleaved: bool, rotary_dim: int, backward: bool, round_products: bool = False):
    """Runs the kernel on q and/or k (None = absent); returns new outputs laid out by _like (or None)."""
    x0 = q if q is not None else k
    device = x0.device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # Triton launches on the current device
            return _launch(q, k, cos, sin, interleaved, rotary_dim, backward, round_products)
    qo = None if q is None else _like(q)
    ko = None if k is None else _like(k)
    cs = cos.shape
    if cs[0] * cs[1] * cs[2] == 0 or ((q is None or q.numel() == 0) and (k is None or k.numel() == 0)):
        return qo, ko
    qa = _row_args(q, qo, cs, x0)
    ka = _row_args(k, ko, cs, x0)
    positions = cs[0] * cs[1] * cs[2]
    block_c, block_mq, block_mk, block_r, block_p, num_warps = _launch_meta(
        x0.shape[-1], rotary_dim, qa[2], ka[2], positions, device.type == "cpu")
    block_c = _BLOCK_C_OVERRIDE or block_c
    _rope_kernel[(triton.cdiv(positions, block_c),)](
        qa[0], qa[1], ka[0], ka[1], cos, sin, *qa[2:], *ka[2:],
        positions, cs[1], cs[2], *cos.stride(), *sin.stride(),
        D=x0.shape[-1], R=rotary_dim, INTERLEAVED=interleaved, BACKWARD=backward,
        ROUND=round_code(x0.dtype, round_products), RNE_BY_HAND=rne_by_bits(device),
        BLOCK_C=block_c, BLOCK_MQ=block_mq, BLOCK_MK=block_mk,
        BLOCK_R=block_r, BLOCK_P=block_p, num_warps=num_warps,
    )
    return qo, ko


_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define(
    "rope(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved, SymInt rotary_dim, "
    "bool round_products=False) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)
_lib.define(
    "rope_bwd(Tensor? dq, Tensor? dk, Tensor cos, Tensor sin, bool interleaved, SymInt rotary_dim, "
    "bool round_products=False) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          interleaved: bool, rotary_dim: int, round_products: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k'): q and k rotated by cos/sin on their first rotary_dim channels (module doc)."""
    _check(q, k, cos, sin, rotary_dim)
    if q.is_cuda or use_triton(q):
        return _launch(q, k, cos, sin, interleaved, rotary_dim, False, round_products)
    qo, ko = rope_reference(q, k, cos, sin, interleaved, rotary_dim, round_products)
    return _like(q).copy_(qo), _like(k).copy_(ko)


def _rope_bwd(dq: Optional[torch.Tensor], dk: Optional[torch.Tensor], cos: torch.Tensor,
              sin: torch.Tensor, interleaved: bool, rotary_dim: int,
              round_products: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) from the output grads; an absent (None) grad gives an empty [0] tensor."""
    ref = dq if dq is not None else dk
    if ref is None:
        raise ValueError("fxfuse.rope_bwd: dq and dk are both None")
    _check(ref, dk if dk is not None else ref, cos, sin, rotary_dim)
    if ref.is_cuda or use_triton(ref):
        dq, dk = _launch(dq, dk, cos, sin, interleaved, rotary_dim, True, round_products)
    else:
        dq, dk = (None if g is None else _like(g).copy_(_rotate_reference(g, cos, sin, interleaved, rotary_dim,
                                                                          True, round_products))
                  for g in (dq, dk))
    return (cos.new_empty(0) if dq is None else dq), (cos.new_empty(0) if dk is None else dk)


# Plain Library registration, not torch.library.custom_op: custom_op's Python dispatch and
# autograd wrapper cost ~0.3 ms of CPU per fwd+bwd on the H200 host, more than the kernels.
# CompositeExplicitAutograd, as custom_op registers: every backend runs _rope / _rope_bwd.
_lib.impl("rope", _rope, "CompositeExplicitAutograd")
_lib.impl("rope_bwd", _rope_bwd, "CompositeExplicitAutograd")


@torch.library.register_fake("fxfuse::rope", lib=_lib)
def _(q, k, cos, sin, interleaved, rotary_dim, round_products=False):
    return _like(q), _like(k)


@torch.library.register_fake("fxfuse::rope_bwd", lib=_lib)
def _(dq, dk, cos, sin, interleaved, rotary_dim, round_products=False):
    return tuple(cos.new_empty(0) if g is None else _like(g) for g in (dq, dk))


_ROPE = torch.ops.fxfuse.rope.default
_ROPE_BWD = torch.ops.fxfuse.rope_bwd.default


class _RopeFunction(torch.autograd.Function):
    """Autograd of fxfuse::rope; saves cos and sin only (the rotation is linear in q, k)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved, rotary_dim, round_products=False):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        ctx.rotary_dim = rotary_dim
        ctx.round_products = round_products
        with torch._C._AutoDispatchBelowAutograd():
            return _ROPE(q, k, cos, sin, interleaved, rotary_dim, round_products)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
            raise RuntimeError("fxfuse.rope gives no gradient for cos/sin; do not use it when they "
                               "require grad")
        dq_out = dq_out if ctx.needs_input_grad[0] else None
        dk_out = dk_out if ctx.needs_input_grad[1] else None
        if dq_out is None and dk_out is None:
            return None, None, None, None, None, None, None
        cos, sin = ctx.saved_tensors
        dq, dk = _ROPE_BWD(dq_out, dk_out, cos, sin, ctx.interleaved, ctx.rotary_dim, ctx.round_products)
        if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in (dq_out, dk_out)):
            dq, dk = no_double_backward(_ROPE_BWD, (dq, dk))
        return (dq if dq_out is not None else None, dk if dk_out is not None else None,
                None, None, None, None, None)


register_autograd(_lib, "rope", _ROPE, _RopeFunction)

# The public callables: the ops (dispatch, autograd, torch.compile), not the bare host wrappers.
rope = _ROPE
rope_bwd = _ROPE_BWD


def _signed_partner(y: torch.Tensor, interleaved: bool, backward: bool) -> torch.Tensor:
    """s(i) * y[p(i)] (forward: rotate_half), or its transpose s(p(i)) * y[p(i)] (backward), along
    the last dim (length r). Pairs (a, b) are the halves, or the even/odd channels if interleaved:
    forward gives (-b, a) in their places, backward (b, -a). Negation is exact: the same bits as
    multiplying by a sign vector, without building one per call."""
    if interleaved:
        a, b = y[..., 0::2], y[..., 1::2]
        return torch.stack((b, -a) if backward else (-b, a), dim=-1).flatten(-2)
    a, b = y.chunk(2, dim=-1)
    return torch.cat((b, -a) if backward else (-b, a), dim=-1)


def _rotate_reference(x, cos, sin, interleaved: bool, rotary_dim: int, backward: bool,
                      round_products: bool = False):
    """Forward (or, backward=True, the transpose) rotation of x in fp32, rounded to x's dtype
    (each product first, too, with round_products)."""
    wide = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for an fp64 reference
    rnd = lambda y: round_ref(y, x.dtype, round_products)  # noqa: E731
    xf = x.to(wide)
    xr, c, s = xf[..., :rotary_dim], cos.to(wide), sin.to(wide)
    if backward:
        rot = rnd(xr * c) + _signed_partner(rnd(xr * s), interleaved, True)
    else:
        rot = rnd(xr * c) + rnd(_signed_partner(xr, interleaved, False) * s)
    return torch.cat((rot, xf[..., rotary_dim:]), dim=-1).to(x.dtype)


def rope_reference(q, k, cos, sin, interleaved: bool, rotary_dim: int, round_products: bool = False):
    """PyTorch reference of fxfuse.rope (differentiable through plain autograd)."""
    return (_rotate_reference(q, cos, sin, interleaved, rotary_dim, False, round_products),
            _rotate_reference(k, cos, sin, interleaved, rotary_dim, False, round_products))
