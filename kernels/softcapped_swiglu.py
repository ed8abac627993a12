"""Inkling 2's softcapped SwiGLU: ``torch.ops.fxfuse.softcapped_swiglu(gate, up, gate_cap, up_cap)``.

Shapes: gate, up: [..., I] (same shape and dtype), viewed as [M, I] rows with any row and column
strides, so the halves of Inkling's ``gate_up.chunk(2, -1)`` are read in place (_gated.py); out:
contiguous [..., I] in gate's dtype. The backward writes new contiguous dgate and dup (or, for
``fxfuse::softcapped_swiglu_packed`` in swiglu_packed.py, the two halves of one d gate_up).

Forward (HF Inkling2SoftcappedSwiGLU, fp32 math as the model's ``.float()``; c = gate_cap,
k = up_cap; one rounding at the store, as its ``.to(input_dtype)``):
    t = tanh(g / c)     a = t * c       s = sigmoid(g)      p = a * s
    r = tanh(u / k)     b = r * k                           out = p * b
The sigmoid sees the raw gate; the softcaps bound only the linear gate factor and up.

Backward (t, a, s, p, r, b recomputed from gate and up; only gate and up are saved), in the order
eager's autograd computes each product (the kernels multiply by 1 / c and 1 / k, and divide
approximately inside tanh and sigmoid: the output rounds once, no eager bits to reproduce):
    dp = dout * b                   db = dout * p
    dup   = ((db * k) * (1 - r^2)) / k
    da = dp * s                     ds = dp * a
    dgate = ((da * c) * (1 - t^2)) / c + (ds * s) * (1 - s)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import register_autograd
from ._gated import (GatedFunction, check_pair, copy_outputs, launch_backward, launch_forward,
                     load_pair, load_tile, store_out, store_pair)
from .swiglu import _on_triton


@triton.jit
def _tanh(u):
    """tanh in fp32 to a few ulps: 1 - 2 / (exp(2u) + 1), and an odd series below |u| = 1/4, where
    that would lose the small result's bits. tl.exp (ex2.approx) and an approximate divide
    (tl.fdiv): on an H100 the op ran 10% faster with tl.exp than with libdevice's tanh and expf
    (34th session), then 11% faster again with the approximate divides and the caps' reciprocals
    (bench/probe_softcapped_swiglu.py, 35th session); the output is rounded to bf16 / fp16 once at its
    store, no eager bits to reproduce."""
    u2 = u * u
    series = u * (1.0 + u2 * (-1.0 / 3 + u2 * (2.0 / 15 + u2 * (-17.0 / 315 + u2 * (62.0 / 2835)))))
    return tl.where(tl.abs(u) < 0.25, series, 1.0 - tl.fdiv(2.0, tl.exp(2.0 * u) + 1.0))


@triton.jit
def _terms(g, u, gate_cap, up_cap):
    """(t, a, s, p, r, b) of the module docstring, fp32 (the sigmoid from tl.exp and tl.fdiv, as
    _tanh; each cap's reciprocal once per program, multiplied)."""
    t = _tanh(g * (1.0 / gate_cap))
    a = t * gate_cap
    s = tl.fdiv(1.0, 1.0 + tl.exp(-g))
    r = _tanh(u * (1.0 / up_cap))
    return t, a, s, a * s, r, r * up_cap


@triton.jit
def _softcapped_swiglu_fwd_kernel(
    gate_ptr,  # [M, I], strides (stride_gm, stride_gn); paired: gate_up [M, 2I] (_gated.py)
    up_ptr,  # [M, I], strides (stride_um, stride_un); paired: unused
    out_ptr,  # [M, I] contiguous
    M,
    I,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    gate_cap,  # fp32 scalar
    up_cap,  # fp32 scalar
    PAIR: tl.constexpr,  # gate / up layout, _gated.py
    RNE_BY_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, True, BLOCK_M, BLOCK_N)
    _, _, _, p, _, b = _terms(g, u, gate_cap, up_cap)
    store_out(out_ptr, p * b, rows, pid_n, M, I, RNE_BY_BITS, BLOCK_N)


@triton.jit
def _softcapped_swiglu_bwd_kernel(
    dout_ptr,  # [M, I], strides (stride_dm, stride_dn)
    gate_ptr,  # [M, I], strides (stride_gm, stride_gn); paired: gate_up [M, 2I]
    up_ptr,  # [M, I], strides (stride_um, stride_un); paired: unused
    dgate_ptr,  # [M, I], strides (stride_om, stride_on) (unwritten unless NEED_DGATE)
    dup_ptr,  # [M, I], strides (stride_om, stride_on) (unwritten unless NEED_DUP)
    M,
    I,
    stride_dm,
    stride_dn,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    stride_om,
    stride_on,
    gate_cap,
    up_cap,
    PAIR: tl.constexpr,  # gate / up layout, _gated.py
    OUT_PAIR: tl.constexpr,  # dgate / dup layout (_gated.out_pair)
    READ_BEFORE_WRITE: tl.constexpr,  # an output overwrites an input: all loads before any store
    NEED_DGATE: tl.constexpr,
    NEED_DUP: tl.constexpr,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    dout = load_tile(dout_ptr, rows, pid_n, M, I, stride_dm, stride_dn, BLOCK_N)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, True, BLOCK_M, BLOCK_N)
    t, a, s, p, r, b = _terms(g, u, gate_cap, up_cap)
    du = ((dout * p) * up_cap) * (1.0 - r * r) * (1.0 / up_cap)
    dg = du
    if NEED_DGATE:
        dp = dout * b
        dg = ((dp * s) * gate_cap) * (1.0 - t * t) * (1.0 / gate_cap) + ((dp * a) * s) * (1.0 - s)
    if READ_BEFORE_WRITE:
        tl.debug_barrier()
    store_pair(dgate_ptr, dup_ptr, dg, du, rows, pid_n, M, I, stride_om, stride_on, OUT_PAIR, NEED_DGATE, NEED_DUP,
               RNE_BY_BITS, BLOCK_M, BLOCK_N)


def _check_args(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> None:
    check_pair("softcapped_swiglu", gate, up)
    if not (gate_cap > 0 and up_cap > 0):
        raise ValueError(f"fxfuse.softcapped_swiglu: caps must be > 0, got {gate_cap}, {up_cap}")


# Two tanh and a sigmoid per element: ALU-heavy, so small programs. H100, packed gate_up fwd+bwd
# at 65536x1024 (bench/probe_softcapped_swiglu.py, 35th session): 1024 elements 373 us, 2048 384.
_MAX_TILE = 1024

_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("softcapped_swiglu(Tensor gate, Tensor up, float gate_cap, float up_cap) -> Tensor")
_lib.define(
    "softcapped_swiglu_backward(Tensor grad_out, Tensor gate, Tensor up, float gate_cap, float up_cap, "
    "bool need_dgate, bool need_dup) -> (Tensor, Tensor)"
)


def softcapped_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """gate_cap tanh(gate / gate_cap) sigmoid(gate) up_cap tanh(up / up_cap), in fp32, stored in gate's dtype."""
    _check_args(gate, up, gate_cap, up_cap)
    if not _on_triton(gate):
        return _softcapped_swiglu_reference(gate, up, gate_cap, up_cap)
    return launch_forward(_softcapped_swiglu_fwd_kernel, gate, up, (gate_cap, up_cap), _MAX_TILE)


def softcapped_swiglu_backward_into(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float,
    dgate: torch.Tensor, dup: torch.Tensor, need_dgate: bool, need_dup: bool,
) -> None:
    """Writes dgate and/or dup ([..., I] with one set of strides, see _gated.out_pair: the columns of
    one d gate_up for fxfuse::softcapped_swiglu_packed); one not needed is left unwritten."""
    _check_args(gate, up, gate_cap, up_cap)
    if gate.numel() == 0 or not (need_dgate or need_dup):
        return
    if not _on_triton(gate):
        ref = _softcapped_swiglu_backward_reference(grad_out, gate, up, gate_cap, up_cap, need_dgate, need_dup)
        return copy_outputs((dgate, dup), ref, (need_dgate, need_dup))
    launch_backward(_softcapped_swiglu_bwd_kernel, grad_out, gate, up, dgate, dup, need_dgate, need_dup,
                    (gate_cap, up_cap), _MAX_TILE)


def softcapped_swiglu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float,
    need_dgate: bool, need_dup: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), each [..., I] contiguous; a gradient not asked for comes back as an empty [0] tensor."""
    _check_args(gate, up, gate_cap, up_cap)
    dgate = torch.empty(gate.shape if need_dgate else (0,), dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape if need_dup else (0,), dtype=gate.dtype, device=gate.device)
    softcapped_swiglu_backward_into(grad_out, gate, up, gate_cap, up_cap, dgate, dup, need_dgate, need_dup)
    return dgate, dup


for _key in ("CPU", "CUDA"):  # plain Library registration, as fxfuse::swiglu (host time per call)
    _lib.impl("softcapped_swiglu", softcapped_swiglu, _key)
    _lib.impl("softcapped_swiglu_backward", softcapped_swiglu_backward, _key)


@torch.library.register_fake("fxfuse::softcapped_swiglu", lib=_lib)
def _(gate, up, gate_cap, up_cap):
    _check_args(gate, up, gate_cap, up_cap)
    return gate.new_empty(gate.shape)


@torch.library.register_fake("fxfuse::softcapped_swiglu_backward", lib=_lib)
def _(grad_out, gate, up, gate_cap, up_cap, need_dgate, need_dup):
    _check_args(gate, up, gate_cap, up_cap)
    return gate.new_empty(gate.shape if need_dgate else (0,)), gate.new_empty(gate.shape if need_dup else (0,))


_OP = torch.ops.fxfuse.softcapped_swiglu.default
_OP_BACKWARD = torch.ops.fxfuse.softcapped_swiglu_backward.default


class _SoftcappedSwiGLUFunction(GatedFunction):
    forward_op, backward_op, flags_at = _OP, _OP_BACKWARD, 2  # (gate_cap, up_cap, need_dgate, need_dup)


register_autograd(_lib, "softcapped_swiglu", _OP, _SoftcappedSwiGLUFunction)


def _terms_ref(gate, up, gate_cap, up_cap):
    """PyTorch twin of _terms, in fp32 (fp64 stays fp64)."""
    wide = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(wide), up.to(wide)
    t, r = torch.tanh(g / gate_cap), torch.tanh(u / up_cap)
    a, s = t * gate_cap, torch.sigmoid(g)
    return t, a, s, a * s, r, r * up_cap


def _softcapped_swiglu_reference(gate, up, gate_cap, up_cap):
    *_, p, _, b = _terms_ref(gate, up, gate_cap, up_cap)
    return (p * b).to(gate.dtype).contiguous()


def _softcapped_swiglu_backward_reference(grad_out, gate, up, gate_cap, up_cap, need_dgate, need_dup):
    t, a, s, p, r, b = _terms_ref(gate, up, gate_cap, up_cap)
    d = grad_out.to(t.dtype)
    empty = gate.new_empty(0)
    dup = (((d * p) * up_cap) * (1.0 - r * r) / up_cap).to(gate.dtype).contiguous() if need_dup else empty
    dgate = empty
    if need_dgate:
        dp = d * b
        dg = ((dp * s) * gate_cap) * (1.0 - t * t) / gate_cap + ((dp * a) * s) * (1.0 - s)
        dgate = dg.to(gate.dtype).contiguous()
    return dgate, dup
