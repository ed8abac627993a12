"""Logits returned beside a fused lm_head + cross-entropy: placeholders for the ones the user chose
not to compute (``options={"logits": "skip"}``), and a backward guard on the exact ones.

A skipped graph output comes back as a ``SkippedValue``: an empty tensor whose every use raises a
clear error, so code that reads logits it asked fxfuse not to compute fails loudly instead of
reading something wrong.

Exact logits (the default) are computed from detached inputs: the fused op forms the loss's
gradient without them. Eager's logits require grad, so a loss term of them added outside the
compiled graph (an auxiliary or distillation loss on the returned logits) would lose its gradient
silently. When the call's other outputs require grad, each such output comes back requiring grad
through ``_NoGradThrough``, whose backward raises ``NO_GRAD_MESSAGE`` for a nonzero gradient. Its
output shares the logits' storage without being an autograd view, so in-place writes work as in
eager. A backward that never reaches them is unchanged, and so is one that brings them no gradient
or zeros: DDP's output sink passes an undefined gradient for every unused output (autograd's own
DelayedError raised there), other wrappers zeros (a sync to see them, on that path only).
"""
from __future__ import annotations

import torch

MESSAGE = ("fxfuse skipped computing this value (the logits of a fused lm_head + cross-entropy, "
           "torch.compile(..., options={'logits': 'skip'})). Compile with the default "
           "options={'logits': 'exact'} to get exact logits.")
NO_GRAD_MESSAGE = (
    "fxfuse: backward reached logits returned beside a fused lm_head + cross-entropy (pattern "
    "linear_cross_entropy). The fused op computes the loss's gradient without the logits, so it cannot "
    "backpropagate a gradient that reaches them (eager would, into the lm_head and the hidden states). "
    "Compute this loss term inside the compiled function (the head then stays unfused, and the report says "
    "why), or compile with options={'patterns': [...]} without 'linear_cross_entropy'.")


# Metadata that frameworks probe on every output without reading values (FSDP2's post-forward hook
# asks each output tensor for requires_grad): answered for the placeholder itself (no grad, no
# grad_fn; the logits' dtype and device). Shape is not among them: it is wrong.
_METADATA = frozenset(getattr(torch.Tensor, name).__get__ for name in (
    "requires_grad", "grad_fn", "is_leaf", "dtype", "device", "is_cuda"))


class SkippedValue(torch.Tensor):
    @staticmethod
    def __new__(cls, like_dtype: torch.dtype, device: torch.device):
        return torch.Tensor._make_subclass(cls, torch.empty(0, dtype=like_dtype, device=device))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise RuntimeError(MESSAGE)

    def __repr__(self) -> str:
        return f"SkippedValue({MESSAGE})"

    __str__ = __repr__

    def __len__(self) -> int:
        raise RuntimeError(MESSAGE)

    def __bool__(self) -> bool:
        raise RuntimeError(MESSAGE)


class _NoGradThrough(torch.autograd.Function):
    """logits (no grad) -> the same values requiring grad, whose gradient may only be none or zero."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        return logits.new_empty(0).set_(logits.untyped_storage(), logits.storage_offset(), logits.size(),
                                        logits.stride())

    @staticmethod
    def backward(ctx, grad):
        if grad is not None and bool(grad.any()):
            raise RuntimeError(NO_GRAD_MESSAGE)
        return None, None


def wrap_outputs(compiled, skipped: list[int], detached: list[int]):
    """compiled(*args) with the outputs at skipped replaced by SkippedValue, and those at detached
    guarded (see the module docstring) when another output requires grad."""
    if not skipped and not detached:
        return compiled

    def run(*args):
        out = list(compiled(*args))
        for i in skipped:
            with torch._C.DisableTorchFunctionSubclass():
                out[i] = SkippedValue(out[i].dtype, out[i].device)
        if detached and torch.is_grad_enabled() and any(isinstance(o, torch.Tensor) and o.requires_grad
                                                        for o in out):
            for i in detached:
                o = out[i]
                if type(o) is torch.Tensor and o.is_floating_point() and not o.requires_grad:
                    anchor = torch.empty(0, device=o.device, requires_grad=True)  # makes the output require grad
                    out[i] = _NoGradThrough.apply(anchor, o)
        return out

    return run
