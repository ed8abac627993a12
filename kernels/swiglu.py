"""Gated-MLP activation (SwiGLU / GeGLU / ReGLU): ``torch.ops.fxfuse.swiglu(gate, up, act)``.

Shapes: gate, up: [..., I] (same shape), viewed as [M, I] rows; out: [..., I].
Dtypes: out in promote_types(gate, up), dgate in gate's and dup in up's dtype. They may differ, as
under bf16 autocast where a bf16 gate projection meets an fp32 up (Mamba's scan output times
act(gate); Gemma 3n's per-layer gate): eager then computes act(g) in gate's dtype and the product in
fp32, and round_act rounds act(g) and dout * u to gate's dtype as eager stores them.
out_dtype=float32 gives an fp32 out from low-precision gate and up: CUDA autocast runs ``pow`` in
fp32, so T5's written-out GELU (``gelu_new``) computes act(g) in fp32 from a bf16 gate, and its
product with a bf16 up is fp32 (round_act is then off: eager stores act(g) in fp32).

Forward (fp32 math, one rounding to the dtype at the store):
    out = act(g) * u,          g = float32(gate), u = float32(up)
With round_act (backend option numerics="eager"), act(g) and, in backward, dout * u are rounded to
the dtype before their products, where eager's F.silu(gate) * up stores them: out, dgate, dup then
equal eager's own low-precision results.

Backward (act(g) is recomputed from g; only gate and up are saved):
    dgate = dout * u * act'(g)
    dup   = dout * act(g)

Activations and derivatives:
    silu:       act = g * s,                               act' = s * (1 + g * (1 - s)),  s = sigmoid(g)
    gelu:       act = g * Phi(g),                          act' = Phi(g) + g * phi(g)
                Phi(g) = 0.5 * (1 + erf(g / sqrt(2))),     phi(g) = exp(-g^2 / 2) / sqrt(2 pi)
    gelu_tanh:  act = 0.5 * g * (1 + t),                   act' = 0.5 * (1 + t) + 0.5 * g * (1 - t^2) * z'
                z = c * (g + 0.044715 g^3),  t = tanh(z),  z' = c * (1 + 3 * 0.044715 g^2),  c = sqrt(2 / pi)
                tanh(z) = 2 sigmoid(2z) - 1 and 1 - t^2 = 4 sigmoid(2z) (1 - sigmoid(2z)) (no tanh
                builtin in every supported Triton; the sigmoid form keeps 1 - t^2 accurate).
    relu:       act = max(g, 0),                           act' = 0 if g <= 0 else 1
    relu2:      act = max(g, 0)^2 (BitNet),                act' = 2 * max(g, 0)
                (as torch.relu and its threshold_backward: a NaN gate gives act NaN, act' 1)

Layout (_gated.py): inputs are read as [M, I] rows with any row and column strides (the halves of
``gate_up.chunk(2, dim=-1)`` are read in place), and gate / up interleaving one tensor's columns
(``gate_up[..., ::2]``, ``[..., 1::2]``) as one contiguous tile; the output is contiguous. The
backward kernel writes dgate and dup with one pair of strides, or as one interleaved tile: new
contiguous tensors here, the columns of one d gate_up in fxfuse::swiglu_packed (swiglu_packed.py).
``swiglu_backward_into`` may write them over its own inputs (fxfuse.reinplace: dgate over gate, dup
over grad_out or up); each program then finishes its tile's loads before its stores (a barrier).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._dispatch import register_autograd, use_triton
from ._gated import (GatedFunction, copy_outputs, launch_backward, launch_forward, load_pair,
                     load_tile, store_out, store_pair)
from ._round import round_code, round_ref, round_to

ACTS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
_ACT_ID = {name: i for i, name in enumerate(ACTS)}

_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_TANH_K = tl.constexpr(0.044715)


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """(act(g), act'(g)) in fp32; act'(g) is 0.0 when NEED_GRAD is False. Constants stay on the
    right of tensors (constexpr * tensor breaks in the interpreter)."""
    da = 0.0
    if ACT == 0:
        s = tl.sigmoid(g)
        a = g * s
        if NEED_GRAD:
            da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * _SQRT1_2))
        a = g * cdf
        if NEED_GRAD:
            da = cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    elif ACT == 2:
        g2 = g * g
        s2 = tl.sigmoid(g * (1.0 + g2 * _GELU_TANH_K) * (2.0 * _SQRT_2_OVER_PI))
        half_1p_t = s2  # 0.5 * (1 + tanh(z)) == sigmoid(2z)
        a = g * half_1p_t
        if NEED_GRAD:
            dz = (1.0 + g2 * (3.0 * _GELU_TANH_K)) * _SQRT_2_OVER_PI
            da = half_1p_t + 2.0 * g * s2 * (1.0 - s2) * dz
    elif ACT == 3:
        a = tl.where(g < 0.0, 0.0, g)  # NaN < 0 is False: NaN stays
        if NEED_GRAD:
            da = tl.where(g <= 0.0, 0.0, 1.0)
    else:
        r = tl.where(g < 0.0, 0.0, g)
        a = r * r
        if NEED_GRAD:
            da = r * 2.0
    return a, da


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr,  # [M, I], strides (stride_gm, stride_gn); paired: gate_up [M, 2I] (_gated.py)
    up_ptr,  # [M, I], strides (stride_um, stride_un); paired: unused
    out_ptr,  # [M, I] contiguous (row stride I)
    M,
    I,
    stride_gm,
    stride_gn,
    stride_um,
    stride_un,
    PAIR: tl.constexpr,  # gate / up layout, _gated.py
    ACT: tl.constexpr,
    ROUND_ACT: tl.constexpr,  # round act(g) to the dtype before the product (eager's F.silu(g) * u)
    RNE_BY_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, True, BLOCK_M, BLOCK_N)
    a, _ = _act_and_grad(g, ACT, False)
    a = round_to(a, ROUND_ACT, RNE_BY_BITS)
    store_out(out_ptr, a * u, rows, pid_n, M, I, RNE_BY_BITS, BLOCK_N)


@triton.jit
def _swiglu_bwd_kernel(
    dout_ptr,  # [M, I], strides (stride_dm, stride_dn)
    gate_ptr,  # [M, I], strides (stride_gm, stride_gn); paired: gate_up [M, 2I]
    up_ptr,  # [M, I], strides (stride_um, stride_un) (unread unless NEED_DGATE); paired: unused
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
    PAIR: tl.constexpr,  # gate / up layout, _gated.py
    OUT_PAIR: tl.constexpr,  # dgate / dup layout (paired: both needed)
    READ_BEFORE_WRITE: tl.constexpr,  # an output overwrites an input: all loads before any store
    ACT: tl.constexpr,
    NEED_DGATE: tl.constexpr,
    NEED_DUP: tl.constexpr,
    ROUND_ACT: tl.constexpr,  # eager's roundings: act(g) and dout * u stored before their products
    RNE_BY_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    dout = load_tile(dout_ptr, rows, pid_n, M, I, stride_dm, stride_dn, BLOCK_N)
    g, u = load_pair(gate_ptr, up_ptr, rows, pid_n, M, I, stride_gm, stride_gn, stride_um, stride_un,
                     PAIR, NEED_DGATE, BLOCK_M, BLOCK_N)
    a, da = _act_and_grad(g, ACT, NEED_DGATE)
    dg = round_to(dout * u, ROUND_ACT, RNE_BY_BITS) * da  # 0 unless NEED_DGATE (da, u)
    du = dout * round_to(a, ROUND_ACT, RNE_BY_BITS)
    if READ_BEFORE_WRITE:
        tl.debug_barrier()
    store_pair(dgate_ptr, dup_ptr, dg, du, rows, pid_n, M, I, stride_om, stride_on, OUT_PAIR, NEED_DGATE, NEED_DUP,
               RNE_BY_BITS, BLOCK_M, BLOCK_N)


def _max_tile(act_id: int) -> int:
    # Elements a program: erf GELU is ALU-heavy, so smaller programs (more resident per SM) keep
    # it memory-bound (H200, 16384x14336: 2048 -> 92% of copy, 8192 -> 74%); silu/tanh like 8192.
    return 2048 if act_id == _ACT_ID["gelu"] else 8192


def _check_act(act: str) -> int:
    if act not in _ACT_ID:
        raise ValueError(f"fxfuse.swiglu: act must be one of {ACTS}, got {act!r}")
    return _ACT_ID[act]


# the kernels compute in fp32: a mixed pair with fp64 in it would lose the fp64 operand's precision
_MIXABLE = {torch.float32, torch.bfloat16, torch.float16}


def _check_args(gate: torch.Tensor, up: torch.Tensor, act: str) -> int:
    if gate.shape != up.shape or (gate.dtype != up.dtype and not {gate.dtype, up.dtype} <= _MIXABLE):
        raise ValueError(f"fxfuse.swiglu: gate {gate.shape}/{gate.dtype} and up {up.shape}/{up.dtype}: one shape "
                         "needed, and one dtype unless both are float32 / bfloat16 / float16")
    return _check_act(act)


def _out_dtype(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.dtype:
    promoted = torch.promote_types(gate.dtype, up.dtype)
    if out_dtype in (None, promoted):
        return promoted
    if out_dtype != torch.float32 or promoted == torch.float64:
        raise ValueError(f"fxfuse.swiglu: out_dtype must be None or gate's and up's promoted dtype (here {promoted}), "
                         f"or torch.float32 for float32 / bfloat16 / float16 inputs, got {out_dtype}")
    return out_dtype


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or use_triton(t)  # is_cuda first: use_triton also reads the environment


_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("swiglu(Tensor gate, Tensor up, str act, bool round_act=False, ScalarType? out_dtype=None) -> Tensor")
_lib.define(
    "swiglu_backward(Tensor grad_out, Tensor gate, Tensor up, str act, bool need_dgate, bool need_dup, "
    "bool round_act=False) -> (Tensor, Tensor)"
)
# swiglu_backward writing into given tensors: fxfuse.reinplace passes buffers the backward graph
# no longer reads (dgate over gate, dup over grad_out), so no fresh [..., I] pair is allocated
_lib.define(
    "swiglu_backward_into(Tensor grad_out, Tensor gate, Tensor up, str act, Tensor(a!) dgate, Tensor(b!) dup, "
    "bool need_dgate, bool need_dup, bool round_act=False) -> ()"
)


def swiglu(gate: torch.Tensor, up: torch.Tensor, act: str, round_act: bool = False,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """act(gate) * up with fp32 math; gate, up: [..., I] same shape; out: contiguous [..., I] in their
    promoted dtype, or out_dtype (float32). round_act: act(gate) is rounded to gate's dtype before the
    product, as eager's two ops do."""
    act_id = _check_args(gate, up, act)
    out_dtype = _out_dtype(gate, up, out_dtype)
    if not _on_triton(gate):
        return _swiglu_reference(gate, up, act, round_act, out_dtype)
    return launch_forward(_swiglu_fwd_kernel, gate, up, (), _max_tile(act_id), out_dtype, ACT=act_id,
                          ROUND_ACT=round_code(gate.dtype, round_act))


def swiglu_backward_into(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str, dgate: torch.Tensor, dup: torch.Tensor,
    need_dgate: bool, need_dup: bool, round_act: bool = False,
) -> None:
    """Writes dgate and/or dup ([..., I] with one set of strides, see _gated.out_pair); one not needed is
    left unwritten and may be any tensor."""
    act_id = _check_act(act)
    if gate.numel() == 0 or not (need_dgate or need_dup):
        return
    if not _on_triton(gate):
        ref = _swiglu_backward_reference(grad_out, gate, up, act, need_dgate, need_dup, round_act)
        return copy_outputs((dgate, dup), ref, (need_dgate, need_dup))
    launch_backward(_swiglu_bwd_kernel, grad_out, gate, up, dgate, dup, need_dgate, need_dup, (), _max_tile(act_id),
                    ACT=act_id, ROUND_ACT=round_code(gate.dtype, round_act))


def swiglu_backward(
    grad_out: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: str, need_dgate: bool, need_dup: bool,
    round_act: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup), each [..., I] contiguous in gate's / up's dtype; a gradient not asked for comes back
    as an empty [0] tensor."""
    if not _on_triton(gate):
        _check_act(act)
        return _swiglu_backward_reference(grad_out, gate, up, act, need_dgate, need_dup, round_act)
    dgate = torch.empty(gate.shape if need_dgate else (0,), dtype=gate.dtype, device=gate.device)
    dup = torch.empty(gate.shape if need_dup else (0,), dtype=up.dtype, device=gate.device)
    swiglu_backward_into(grad_out, gate, up, act, dgate, dup, need_dgate, need_dup, round_act)
    return dgate, dup


# Plain Library registration, not torch.library.custom_op: custom_op's Python dispatch and
# autograd wrapper cost ~0.3 ms of CPU per fwd+bwd on the H200 host, more than the kernels
# themselves at 8192x8192.
for _key in ("CPU", "CUDA"):
    _lib.impl("swiglu", swiglu, _key)
    _lib.impl("swiglu_backward", swiglu_backward, _key)
    _lib.impl("swiglu_backward_into", swiglu_backward_into, _key)


@torch.library.register_fake("fxfuse::swiglu", lib=_lib)
def _(gate: torch.Tensor, up: torch.Tensor, act: str, round_act: bool = False, out_dtype=None) -> torch.Tensor:
    _check_args(gate, up, act)
    return gate.new_empty(gate.shape, dtype=_out_dtype(gate, up, out_dtype))


@torch.library.register_fake("fxfuse::swiglu_backward", lib=_lib)
def _(grad_out, gate, up, act, need_dgate, need_dup, round_act=False):
    _check_act(act)
    return gate.new_empty(gate.shape if need_dgate else (0,)), up.new_empty(gate.shape if need_dup else (0,))


@torch.library.register_fake("fxfuse::swiglu_backward_into", lib=_lib)
def _(grad_out, gate, up, act, dgate, dup, need_dgate, need_dup, round_act=False):
    _check_act(act)


_SWIGLU = torch.ops.fxfuse.swiglu.default
_SWIGLU_BACKWARD = torch.ops.fxfuse.swiglu_backward.default


class _SwiGLUFunction(GatedFunction):
    forward_op, backward_op, flags_at = _SWIGLU, _SWIGLU_BACKWARD, 1  # (act, need_dgate, need_dup, round_act)
    backward_tail = 1  # round_act; out_dtype is the forward's alone


register_autograd(_lib, "swiglu", _SWIGLU, _SwiGLUFunction)


def _act_ref(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return torch.nn.functional.silu(g)
    if act in ("relu", "relu2"):
        r = torch.relu(g)
        return r * r if act == "relu2" else r
    return torch.nn.functional.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")


def _act_grad_ref(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        s = torch.sigmoid(g)
        return s * (1.0 + g * (1.0 - s))
    if act == "relu":
        return (~(g <= 0)).to(g.dtype)
    if act == "relu2":
        return 2.0 * torch.relu(g)
    if act == "gelu":
        return 0.5 * (1.0 + torch.erf(g * _SQRT1_2.value)) + g * _INV_SQRT_2PI.value * torch.exp(-0.5 * g * g)
    g2 = g * g
    c, k = _SQRT_2_OVER_PI.value, _GELU_TANH_K.value
    t = torch.tanh(c * g * (1.0 + k * g2))
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * c * (1.0 + 3.0 * k * g2)


def _swiglu_reference(gate: torch.Tensor, up: torch.Tensor, act: str, round_act: bool = False,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """act(gate) * up in fp32 (fp64 stays fp64), rounded once (twice with round_act); contiguous output
    in the promoted dtype or out_dtype."""
    out_dtype = _out_dtype(gate, up, out_dtype)
    wide = torch.promote_types(out_dtype, torch.float32)
    out = round_ref(_act_ref(gate.to(wide), act), gate.dtype, round_act) * up.to(wide)
    return out.to(out_dtype).contiguous()


def _swiglu_backward_reference(grad_out, gate, up, act, need_dgate, need_dup, round_act=False):
    wide = torch.promote_types(_out_dtype(gate, up), torch.float32)
    d, g, u = grad_out.to(wide), gate.to(wide), up.to(wide)
    rnd = lambda y: round_ref(y, gate.dtype, round_act)  # noqa: E731
    dgate = (rnd(d * u) * _act_grad_ref(g, act)).to(gate.dtype).contiguous() if need_dgate else gate.new_empty(0)
    dup = (d * rnd(_act_ref(g, act))).to(up.dtype).contiguous() if need_dup else up.new_empty(0)
    return dgate, dup
