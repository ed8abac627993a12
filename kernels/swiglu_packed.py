"""Gated MLP on one packed gate_up tensor, gradient written whole:
``torch.ops.fxfuse.swiglu_packed(gate_up, act, interleaved, up_first)``,
``torch.ops.fxfuse.clamped_swiglu_packed(gate_up, alpha, limit, interleaved, up_first)`` and
``torch.ops.fxfuse.softcapped_swiglu_packed(gate_up, gate_cap, up_cap, interleaved, up_first)``.

Shapes: gate_up: [..., 2I]; out: contiguous [..., I]. gate and up are views of its last dim:
    interleaved=False:  gate_up[..., :I] and gate_up[..., I:]   (chunk(2, -1), split: Phi-3, GLM)
    interleaved=True:   gate_up[..., ::2] and gate_up[..., 1::2]  (gpt-oss)
the first being gate unless up_first.

The math is fxfuse::swiglu's, fxfuse::clamped_swiglu's and fxfuse::softcapped_swiglu's (swiglu.py,
clamped_swiglu.py, softcapped_swiglu.py): the same kernels read the views in place. Only the
backward differs: it allocates d gate_up [..., 2I] and the backward kernel stores dgate and dup
straight into its columns. The unpacked ops return dgate and dup as two tensors that autograd then
scatters into gate_up's gradient (cat or two slice_backward + add): one more read and write of 2I
per row, and dgate, dup and d gate_up alive at once. Only gate_up is saved for backward, as the
unpacked ops save its two views.

The ``*_packed_backward_into`` twins take the functional backward's arguments and write d gate_up
over gate_up itself (fxfuse.reinplace, when nothing reads gate_up afterwards: under activation
checkpointing, where gate_up is recomputed in the backward graph).
"""
from __future__ import annotations

import torch

from ._dispatch import register_autograd
from .clamped_swiglu import _check_args as _check_clamped, clamped_swiglu, clamped_swiglu_backward_into
from .softcapped_swiglu import _check_args as _check_softcapped, softcapped_swiglu, softcapped_swiglu_backward_into
from .swiglu import _check_act, swiglu, swiglu_backward_into


def split_packed(gate_up: torch.Tensor, interleaved: bool, up_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) views of gate_up's last dim (see the module docstring)."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"fxfuse.swiglu_packed: gate_up needs an even last dim, got shape {list(gate_up.shape)}")
    i = gate_up.shape[-1] // 2
    a, b = (gate_up[..., 0::2], gate_up[..., 1::2]) if interleaved else (gate_up[..., :i], gate_up[..., i:])
    return (b, a) if up_first else (a, b)


def _half_shape(gate_up: torch.Tensor) -> list:
    return [*gate_up.shape[:-1], gate_up.shape[-1] // 2]


_lib = torch.library.Library("fxfuse", "FRAGMENT")
_lib.define("swiglu_packed(Tensor gate_up, str act, bool interleaved, bool up_first, bool round_act=False) -> Tensor")
_lib.define(
    "swiglu_packed_backward(Tensor grad_out, Tensor gate_up, str act, bool interleaved, bool up_first, "
    "bool round_act=False) -> Tensor"
)
_lib.define(
    "swiglu_packed_backward_into(Tensor grad_out, Tensor(a!) gate_up, str act, bool interleaved, bool up_first, "
    "bool round_act=False) -> ()"
)
_lib.define(
    "clamped_swiglu_packed(Tensor gate_up, float alpha, float limit, bool interleaved, bool up_first, "
    "bool round_act=False) -> Tensor"
)
_lib.define(
    "clamped_swiglu_packed_backward(Tensor grad_out, Tensor gate_up, float alpha, float limit, bool interleaved, "
    "bool up_first, bool round_act=False) -> Tensor"
)
_lib.define(
    "clamped_swiglu_packed_backward_into(Tensor grad_out, Tensor(a!) gate_up, float alpha, float limit, "
    "bool interleaved, bool up_first, bool round_act=False) -> ()"
)
_lib.define("softcapped_swiglu_packed(Tensor gate_up, float gate_cap, float up_cap, bool interleaved, bool up_first) "
            "-> Tensor")
_lib.define(
    "softcapped_swiglu_packed_backward(Tensor grad_out, Tensor gate_up, float gate_cap, float up_cap, "
    "bool interleaved, bool up_first) -> Tensor"
)
_lib.define(
    "softcapped_swiglu_packed_backward_into(Tensor grad_out, Tensor(a!) gate_up, float gate_cap, float up_cap, "
    "bool interleaved, bool up_first) -> ()"
)


def swiglu_packed(gate_up: torch.Tensor, act: str, interleaved: bool, up_first: bool,
                  round_act: bool = False) -> torch.Tensor:
    """act(gate) * up of gate_up's two halves; out: contiguous [..., I]."""
    return swiglu(*split_packed(gate_up, interleaved, up_first), act, round_act)


def _write_grad(into, grad_out: torch.Tensor, gate_up: torch.Tensor, grad: torch.Tensor, interleaved: bool,
                up_first: bool, args: tuple, tail: tuple = ()) -> None:
    """An unpacked op's backward ``into(grad_out, gate, up, *args, dgate, dup, True, True, *tail)``
    with gate, up gate_up's halves and dgate, dup grad's: d gate_up written into grad's columns
    (grad may be gate_up itself: each program reads its tile of gate and up before it stores)."""
    into(grad_out, *split_packed(gate_up, interleaved, up_first), *args, *split_packed(grad, interleaved, up_first),
         True, True, *tail)


def swiglu_packed_backward(grad_out: torch.Tensor, gate_up: torch.Tensor, act: str, interleaved: bool,
                           up_first: bool, round_act: bool = False) -> torch.Tensor:
    """d gate_up [..., 2I], contiguous: dgate and dup written into its columns."""
    grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    _write_grad(swiglu_backward_into, grad_out, gate_up, grad, interleaved, up_first, (act,), (round_act,))
    return grad


def swiglu_packed_backward_into(grad_out: torch.Tensor, gate_up: torch.Tensor, act: str, interleaved: bool,
                                up_first: bool, round_act: bool = False) -> None:
    """d gate_up written over gate_up."""
    _write_grad(swiglu_backward_into, grad_out, gate_up, gate_up, interleaved, up_first, (act,), (round_act,))


def clamped_swiglu_packed(gate_up: torch.Tensor, alpha: float, limit: float, interleaved: bool, up_first: bool,
                          round_act: bool = False) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of gate_up's two halves; out: contiguous [..., I]."""
    return clamped_swiglu(*split_packed(gate_up, interleaved, up_first), alpha, limit, round_act)


def clamped_swiglu_packed_backward(grad_out: torch.Tensor, gate_up: torch.Tensor, alpha: float, limit: float,
                                   interleaved: bool, up_first: bool, round_act: bool = False) -> torch.Tensor:
    """d gate_up [..., 2I], contiguous: dgate and dup written into its columns."""
    grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    _write_grad(clamped_swiglu_backward_into, grad_out, gate_up, grad, interleaved, up_first, (alpha, limit),
                (round_act,))
    return grad


def clamped_swiglu_packed_backward_into(grad_out: torch.Tensor, gate_up: torch.Tensor, alpha: float, limit: float,
                                        interleaved: bool, up_first: bool, round_act: bool = False) -> None:
    """d gate_up written over gate_up."""
    _write_grad(clamped_swiglu_backward_into, grad_out, gate_up, gate_up, interleaved, up_first, (alpha, limit),
                (round_act,))


def softcapped_swiglu_packed(gate_up: torch.Tensor, gate_cap: float, up_cap: float, interleaved: bool,
                             up_first: bool) -> torch.Tensor:
    """Inkling 2's softcapped SwiGLU of gate_up's two halves; out: contiguous [..., I]."""
    return softcapped_swiglu(*split_packed(gate_up, interleaved, up_first), gate_cap, up_cap)


def softcapped_swiglu_packed_backward(grad_out: torch.Tensor, gate_up: torch.Tensor, gate_cap: float, up_cap: float,
                                      interleaved: bool, up_first: bool) -> torch.Tensor:
    """d gate_up [..., 2I], contiguous: dgate and dup written into its columns."""
    grad = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    _write_grad(softcapped_swiglu_backward_into, grad_out, gate_up, grad, interleaved, up_first, (gate_cap, up_cap))
    return grad


def softcapped_swiglu_packed_backward_into(grad_out: torch.Tensor, gate_up: torch.Tensor, gate_cap: float,
                                           up_cap: float, interleaved: bool, up_first: bool) -> None:
    """d gate_up written over gate_up."""
    _write_grad(softcapped_swiglu_backward_into, grad_out, gate_up, gate_up, interleaved, up_first, (gate_cap, up_cap))


for _key in ("CPU", "CUDA"):  # plain Library registration, as fxfuse::swiglu (host time per call)
    _lib.impl("softcapped_swiglu_packed", softcapped_swiglu_packed, _key)
    _lib.impl("softcapped_swiglu_packed_backward", softcapped_swiglu_packed_backward, _key)
    _lib.impl("softcapped_swiglu_packed_backward_into", softcapped_swiglu_packed_backward_into, _key)
    _lib.impl("swiglu_packed", swiglu_packed, _key)
    _lib.impl("swiglu_packed_backward", swiglu_packed_backward, _key)
    _lib.impl("clamped_swiglu_packed", clamped_swiglu_packed, _key)
    _lib.impl("clamped_swiglu_packed_backward", clamped_swiglu_packed_backward, _key)
    _lib.impl("swiglu_packed_backward_into", swiglu_packed_backward_into, _key)
    _lib.impl("clamped_swiglu_packed_backward_into", clamped_swiglu_packed_backward_into, _key)


@torch.library.register_fake("fxfuse::swiglu_packed", lib=_lib)
def _(gate_up, act, interleaved, up_first, round_act=False):
    _check_act(act)
    split_packed(gate_up, interleaved, up_first)
    return gate_up.new_empty(_half_shape(gate_up))


@torch.library.register_fake("fxfuse::swiglu_packed_backward", lib=_lib)
def _(grad_out, gate_up, act, interleaved, up_first, round_act=False):
    _check_act(act)
    return gate_up.new_empty(gate_up.shape)


@torch.library.register_fake("fxfuse::clamped_swiglu_packed", lib=_lib)
def _(gate_up, alpha, limit, interleaved, up_first, round_act=False):
    _check_clamped(*split_packed(gate_up, interleaved, up_first), limit)
    return gate_up.new_empty(_half_shape(gate_up))


@torch.library.register_fake("fxfuse::clamped_swiglu_packed_backward", lib=_lib)
def _(grad_out, gate_up, alpha, limit, interleaved, up_first, round_act=False):
    return gate_up.new_empty(gate_up.shape)


@torch.library.register_fake("fxfuse::swiglu_packed_backward_into", lib=_lib)
def _(grad_out, gate_up, act, interleaved, up_first, round_act=False):
    _check_act(act)
    split_packed(gate_up, interleaved, up_first)


@torch.library.register_fake("fxfuse::clamped_swiglu_packed_backward_into", lib=_lib)
def _(grad_out, gate_up, alpha, limit, interleaved, up_first, round_act=False):
    _check_clamped(*split_packed(gate_up, interleaved, up_first), limit)


@torch.library.register_fake("fxfuse::softcapped_swiglu_packed", lib=_lib)
def _(gate_up, gate_cap, up_cap, interleaved, up_first):
    _check_softcapped(*split_packed(gate_up, interleaved, up_first), gate_cap, up_cap)
    return gate_up.new_empty(_half_shape(gate_up))


@torch.library.register_fake("fxfuse::softcapped_swiglu_packed_backward", lib=_lib)
def _(grad_out, gate_up, gate_cap, up_cap, interleaved, up_first):
    return gate_up.new_empty(gate_up.shape)


@torch.library.register_fake("fxfuse::softcapped_swiglu_packed_backward_into", lib=_lib)
def _(grad_out, gate_up, gate_cap, up_cap, interleaved, up_first):
    _check_softcapped(*split_packed(gate_up, interleaved, up_first), gate_cap, up_cap)


_SWIGLU = torch.ops.fxfuse.swiglu_packed.default
_SWIGLU_BACKWARD = torch.ops.fxfuse.swiglu_packed_backward.default
_CLAMPED = torch.ops.fxfuse.clamped_swiglu_packed.default
_CLAMPED_BACKWARD = torch.ops.fxfuse.clamped_swiglu_packed_backward.default
_SOFTCAPPED = torch.ops.fxfuse.softcapped_swiglu_packed.default
_SOFTCAPPED_BACKWARD = torch.ops.fxfuse.softcapped_swiglu_packed_backward.default


class _PackedFunction(torch.autograd.Function):
    """Autograd of both packed ops: args are (gate_up, *op's other args); saves only gate_up."""

    forward_op = backward_op = None

    @classmethod
    def forward(cls, ctx, gate_up, *args):
        ctx.save_for_backward(gate_up)
        ctx.args = args
        with torch._C._AutoDispatchBelowAutograd():
            return cls.forward_op(gate_up, *args)

    @classmethod
    def backward(cls, ctx, grad_out):
        (gate_up,) = ctx.saved_tensors
        grad = cls.backward_op(grad_out, gate_up, *ctx.args) if ctx.needs_input_grad[0] else None
        return (grad,) + (None,) * len(ctx.args)


class _SwiGLUPackedFunction(_PackedFunction):
    forward_op, backward_op = _SWIGLU, _SWIGLU_BACKWARD


class _ClampedPackedFunction(_PackedFunction):
    forward_op, backward_op = _CLAMPED, _CLAMPED_BACKWARD


class _SoftcappedPackedFunction(_PackedFunction):
    forward_op, backward_op = _SOFTCAPPED, _SOFTCAPPED_BACKWARD


register_autograd(_lib, "swiglu_packed", _SWIGLU, _SwiGLUPackedFunction)
register_autograd(_lib, "clamped_swiglu_packed", _CLAMPED, _ClampedPackedFunction)
register_autograd(_lib, "softcapped_swiglu_packed", _SOFTCAPPED, _SoftcappedPackedFunction)
