"""gpt-oss's clamped SwiGLU: ``torch.ops.fxfuse.clamped_swiglu(gate, up, alpha, limit)``.

Shapes: gate, up: [..., I] (same shape and dtype), viewed as [M, I] rows with any row and column
strides, so gpt-oss's interleaved ``gate_up[..., ::2]`` / ``gate_up[..., 1::2]`` are read in place;
out: contiguous [..., I]. The backward kernel writes dgate and dup with one pair of strides: new
contiguous tensors here, d gate_up's columns in fxfuse::clamped_swiglu_packed (swiglu_packed.py), or
its own inputs in ``clamped_swiglu_backward_into`` (fxfuse.reinplace; loads before stores, as
swiglu.py's backward).

Forward (HF GptOssExperts._apply_gate; fp32 math, L = limit, a = alpha):
    g' = clamp(g, max=L)          u' = clamp(u, -L, L)
    s  = sigmoid(a * g')          glu = g' * s          p = u' + 1
    out = p * glu
With round_act (backend option numerics="eager") a * g', s, glu and p are rounded to the dtype
where eager's bf16 / fp16 ops store them, so out equals eager's result up to sigmoid's last fp32 bit.

Backward (g', u', s, glu, p recomputed from gate and up; only gate and up are saved):
    dp   = dout * glu                       dup   = dp    where -L < u < L, else 0
    dglu = dout * p
    dg'  = dglu * s + (dglu * g') * (1 - s) * s * a
                                            dgate = dg'   where g < L, else 0
    (at a bound, u = +-L or g = L, the gradient is the installed torch's clamp subgradient: 1 up to
    torch 2.13, 0 from 2.14, _dispatch.clamp_grad_at_bounds; a NaN input gets 0.) With
    round_act each product above is rounded where eager's autograd stores it: dout * glu,
    dout * p, dglu * s, dglu * g' (= ds), sigmoid_backward's (ds * (1 - s)) * s, and its * a.
    sigmoid_backward itself rounds as eager's kernel on the op's device does (_sigmoid_bwd_steps):
    each of 1 - s, ds * (1 - s) and * s in the dtype on CUDA (and on CPU for fp16), or in fp32
    and rounded once (CPU bf16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._dispatch import clamp_grad_at_bounds, register_autograd
from ._round import round_code, round_ref, round_to
from ._gated import (GatedFunction, check_pair, copy_outputs, launch_backward, launch_forward,
                     load_pair, load_tile, store_out, store_pair)
from .swiglu import _ACT_ID, _max_tile, _on_triton


@triton.jit
def _sigmoid(z, LIBDEVICE: tl.constexpr):
    """PyTorch's CUDA sigmoid, 1 / (1 + expf(-z)) with an accurate expf and a round-to-nearest divide,
    so a rounded s is eager's (tl.sigmoid's ex2.approx and fast divide flip ~1e-3 of bf16 roundings).
    The interpreter has no libdevice; its numpy exp is accurate too."""
    if LIBDEVICE:
        e = libdevice.exp(-z)
    else:
        e = tl.exp(-z)
    return tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _forward_terms(g, u, alpha, limit, ROUND: tl.constexpr, RNE_BY_BITS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """(g', s, glu, p) in fp32, each rounded as eager stores it when ROUND != 0. NaN stays NaN:
    ``x > L`` is False for NaN."""
    gc = tl.where(g > limit, limit, g)
    uc = tl.where(u < -limit, -limit, u)
    uc = tl.where(uc > limit, limit, uc)
    z = round_to(gc * alpha, ROUND, RNE_BY_BITS)
    s = round_to(_sigmoid(z, LIBDEVICE), ROUND, RNE_BY_BITS)
    glu = round_to(gc * s, ROUND, RNE_BY_BITS)
    p = round_to(uc + 1.0, ROUND, RNE_BY_BITS)
    return gc, s, glu, p


@triton.jit
def _clamped_swiglu_fwd_kernel(
    gate_ptr,  # [M, I], strides (stride_gm, stride_gn); paired: gate_up [M, 2I] (_gated.py)
    up_ptr,  # [M, I], strides (stride_um, stride_un); paired: unused
    out_ptr,  # [M, I] contiguous
    M,
    I,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    alpha,  # fp32 scalar
    limit,  # fp32 scalar
    PAIR: tl.constexpr,  # gate / up layout, _gated.py
    ROUND: tl.constexpr,  # round_code of the dtype, 0 for one rounding at the store
    RNE_BY_BITS: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # CUDA: libdevice's expf (see _sigmoid)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, True, BLOCK_M, BLOCK_N)
    _, _, glu, p = _forward_terms(g, u, alpha, limit, ROUND, RNE_BY_BITS, LIBDEVICE)
    store_out(out_ptr, p * glu, rows, pid_n, M, I, RNE_BY_BITS, BLOCK_N)


@triton.jit
def _clamped_swiglu_bwd_kernel(
    dout_ptr,  # [M, I], strides (stride_dm, stride_dn)
    gate_ptr,  # [M, I], strides (stride_gm, stride_gn); paired: gate_up [M, 2I]
    up_ptr,  # [M, I], strides (stride_um, stride_un); paired: unused
    dgate_ptr,  # [M, I], strides (stride_om, stride_on) (unwritten unless NEED_DGATE); paired: d gate_up
    dup_ptr,  # [M, I], strides (stride_om, stride_on) (unwritten unless NEED_DUP); paired: unused
    M,
    I,
    stride_dm,
    stride_dn,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    stride_om,  # I for separate outputs; 2I for the halves of d gate_up
    stride_on,
    alpha,
    limit,
    PAIR: tl.constexpr,  # gate / up layout, _gated.py
    OUT_PAIR: tl.constexpr,  # dgate / dup layout (paired: both needed)
    READ_BEFORE_WRITE: tl.constexpr,  # an output overwrites an input: all loads before any store
    NEED_DGATE: tl.constexpr,
    NEED_DUP: tl.constexpr,
    ROUND: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # CUDA: libdevice's expf (see _sigmoid)
    SIG_STEPS: tl.constexpr,  # round_act: sigmoid_backward rounds each op (_sigmoid_bwd_steps)
    AT_BOUNDS: tl.constexpr,  # clamp's gradient passes where an input equals a bound (torch <= 2.13)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    dout = load_tile(dout_ptr, rows, pid_n, M, I, stride_dm, stride_dn, BLOCK_N)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, True, BLOCK_M, BLOCK_N)
    gc, s, glu, p = _forward_terms(g, u, alpha, limit, ROUND, RNE_BY_BITS, LIBDEVICE)
    if AT_BOUNDS:
        u_in = (u >= -limit) & (u <= limit)
        g_in = g <= limit
    else:
        u_in = (u > -limit) & (u < limit)
        g_in = g < limit
    du = tl.where(u_in, round_to(dout * glu, ROUND, RNE_BY_BITS), 0.0)
    dg = du
    if NEED_DGATE:
        dglu = round_to(dout * p, ROUND, RNE_BY_BITS)
        d_direct = round_to(dglu * s, ROUND, RNE_BY_BITS)
        ds = round_to(dglu * gc, ROUND, RNE_BY_BITS)
        if SIG_STEPS:  # eager's sigmoid_backward in the dtype, one rounding per op
            one_minus = round_to(1.0 - s, ROUND, RNE_BY_BITS)
            dz = round_to(round_to(ds * one_minus, ROUND, RNE_BY_BITS) * s, ROUND, RNE_BY_BITS)
        else:
            dz = round_to(ds * (1.0 - s) * s, ROUND, RNE_BY_BITS)
        d_sig = round_to(dz * alpha, ROUND, RNE_BY_BITS)
        dg = tl.where(g_in, d_direct + d_sig, 0.0)
    if READ_BEFORE_WRITE:
        tl.debug_barrier()
    store_pair(dgate_ptr, dup_ptr, dg, du, rows, pid_n, M, I, stride_om, stride_on, OUT_PAIR, NEED_DGATE, NEED_DUP,
               RNE_BY_BITS, BLOCK_M, BLOCK_N)


def _sigmoid_bwd_steps(t: torch.Tensor) -> bool:
    # PyTorch's CUDA sigmoid_backward computes a * (1 - b) * b in the dtype (c10's bf16/fp16
    # operators round each op); its CPU kernel does too for fp16, but takes bf16 through fp32.
    return t.is_cuda or t.dtype == torch.float16


def _check_args(gate: torch.Tensor, up: torch.Tensor, limit: float) -> None:
    check_pair("clamped_swiglu", gate, up)
    if not limit >= 0:
        raise ValueError(f"fxfuse.clamped_swiglu: limit must be >= 0, got {limit}")


# Tile sizing as SwiGLU's silu (same ALU weight: one sigmoid per element).
_MAX_TILE = _max_tile(_ACT_ID["silu"])

_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("clamped_swiglu(Tensor gate, Tensor up, float alpha, float limit, bool round_act=False) -> Tensor")
_lib.define(
    "clamped_swiglu_backward(Tensor grad_out, Tensor gate, Tensor up, float alpha, float limit, "
    "bool need_dgate, bool need_dup, bool round_act=False) -> (Tensor, Tensor)"
)
_lib.define(  # into given tensors, as fxfuse::swiglu_backward_into (fxfuse.reinplace)
    "clamped_swiglu_backward_into(Tensor grad_out, Tensor gate, Tensor up, float alpha, float limit, "
    "Tensor(a!) dgate, Tensor(b!) dup, bool need_dgate, bool need_dup, bool round_act=False) -> ()"
)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
                   round_act: bool = False) -> torch.Tensor:
    """(clamp(up, -limit, limit) + 1) * g' * sigmoid(alpha * g'), g' = clamp(gate, max=limit)."""
    _check_args(gate, up, limit)
    if not _on_triton(gate):
        return _clamped_swiglu_reference(gate, up, alpha, limit, round_act)
    return launch_forward(_clamped_swiglu_fwd_kernel, gate, up, (alpha, limit), _MAX_TILE,
                          ROUND=round_code(gate.dtype, round_act), LIBDEVICE=gate.is_cuda)


def clamped_swiglu_backward_into(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
    dgate: torch.Tensor, dup: torch.Tensor, need_dgate: bool, need_dup: bool, round_act: bool = False,
) -> None:
    """Writes dgate and/or dup ([..., I] with one set of strides, see _gated.out_pair); one not
    needed is left unwritten and may be any tensor."""
    _check_args(gate, up, limit)
    if gate.numel() == 0 or not (need_dgate or need_dup):
        return
    if not _on_triton(gate):
        ref = _clamped_swiglu_backward_reference(grad_out, gate, up, alpha, limit, need_dgate, need_dup, round_act)
        return copy_outputs((dgate, dup), ref, (need_dgate, need_dup))
    launch_backward(_clamped_swiglu_bwd_kernel, grad_out, gate, up, dgate, dup, need_dgate, need_dup, (alpha, limit),
                    _MAX_TILE, ROUND=round_code(gate.dtype, round_act), LIBDEVICE=gate.is_cuda,
                    SIG_STEPS=_sigmoid_bwd_steps(gate), AT_BOUNDS=clamp_grad_at_bounds())


def clamped_swiglu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float,
    need_dgate: bool, need_dup: bool, round_act: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), each [..., I] contiguous; a gradient not asked for comes back as an empty [0] tensor."""
    _check_args(gate, up, limit)
    if not _on_triton(gate):
        return _clamped_swiglu_backward_reference(grad_out, gate, up, alpha, limit, need_dgate, need_dup, round_act)
    dgate = torch.empty(gate.shape if need_dgate else (0,), dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape if need_dup else (0,), dtype=gate.dtype, device=gate.device)
    clamped_swiglu_backward_into(grad_out, gate, up, alpha, limit, dgate, dup, need_dgate, need_dup, round_act)
    return dgate, dup


for _key in ("CPU", "CUDA"):  # plain Library registration, as fxfuse::swiglu (host time per call)
    _lib.impl("clamped_swiglu", clamped_swiglu, _key)
    _lib.impl("clamped_swiglu_backward", clamped_swiglu_backward, _key)
    _lib.impl("clamped_swiglu_backward_into", clamped_swiglu_backward_into, _key)


@torch.library.register_fake("fxfuse::clamped_swiglu", lib=_lib)
def _(gate, up, alpha, limit, round_act=False):
    _check_args(gate, up, limit)
    return gate.new_empty(gate.shape)


@torch.library.register_fake("fxfuse::clamped_swiglu_backward", lib=_lib)
def _(grad_out, gate, up, alpha, limit, need_dgate, need_dup, round_act=False):
    _check_args(gate, up, limit)
    return gate.new_empty(gate.shape if need_dgate else (0,)), gate.new_empty(gate.shape if need_dup else (0,))


@torch.library.register_fake("fxfuse::clamped_swiglu_backward_into", lib=_lib)
def _(grad_out, gate, up, alpha, limit, dgate, dup, need_dgate, need_dup, round_act=False):
    _check_args(gate, up, limit)


_OP = torch.ops.fxfuse.clamped_swiglu.default
_OP_BACKWARD = torch.ops.fxfuse.clamped_swiglu_backward.default


class _ClampedSwiGLUFunction(GatedFunction):
    forward_op, backward_op, flags_at = _OP, _OP_BACKWARD, 2  # (alpha, limit, need_dgate, need_dup, round_act)


register_autograd(_lib, "clamped_swiglu", _OP, _ClampedSwiGLUFunction)


def _terms_ref(gate, up, alpha, limit, round_act):
    """PyTorch twin of _forward_terms, in fp32 (fp64 stays fp64)."""
    wide = torch.promote_types(gate.dtype, torch.float32)
    rnd = lambda y: round_ref(y, gate.dtype, round_act)  # noqa: E731
    g, u = gate.to(wide), up.to(wide)
    gc = g.clamp(max=limit)
    s = rnd(torch.sigmoid(rnd(gc * alpha)))
    return g, u, gc, s, rnd(gc * s), rnd(u.clamp(-limit, limit) + 1.0)


def _clamped_swiglu_reference(gate, up, alpha, limit, round_act=False):
    _, _, _, _, glu, p = _terms_ref(gate, up, alpha, limit, round_act)
    return (p * glu).to(gate.dtype).contiguous()


def _clamped_swiglu_backward_reference(grad_out, gate, up, alpha, limit, need_dgate, need_dup, round_act=False):
    g, u, gc, s, glu, p = _terms_ref(gate, up, alpha, limit, round_act)
    rnd = lambda y: round_ref(y, gate.dtype, round_act)  # noqa: E731
    d = grad_out.to(g.dtype)
    empty = gate.new_empty(0)
    dup = empty
    if need_dup:
        inside = (u >= -limit) & (u <= limit) if clamp_grad_at_bounds() else (u > -limit) & (u < limit)
        dup = torch.where(inside, rnd(d * glu), 0.0).to(gate.dtype).contiguous()
    dgate = empty
    if need_dgate:
        dglu = rnd(d * p)
        ds = rnd(dglu * gc)
        dz = rnd(rnd(ds * rnd(1.0 - s)) * s) if _sigmoid_bwd_steps(gate) else rnd(ds * (1.0 - s) * s)
        dg = rnd(dglu * s) + rnd(dz * alpha)
        dgate = torch.where(g <= limit if clamp_grad_at_bounds() else g < limit, dg, 0.0).to(gate.dtype).contiguous()
    return dgate, dup
