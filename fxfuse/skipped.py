"""Placeholders for values the user chose not to compute (``options={"logits": "skip"}``).

A skipped graph output comes back as a ``SkippedValue``: an empty tensor whose every use raises a
clear error, so code that reads logits it asked fxfuse not to compute fails loudly instead of
reading something wrong.
"""
from __future__ import annotations

import torch

MESSAGE = ("fxfuse skipped computing this value (the logits of a fused lm_head + cross-entropy, "
           "torch.compile(..., options={'logits': 'skip'})). Compile with the default "
           "options={'logits': 'exact'} to get exact logits.")


# Metadata that frameworks probe on every output without reading values (FSDP2's post-forward hook
# asks each output tensor for requires_grad): answered truthfully, since they hold for the logits
# too (detached: no grad, no grad_fn; same dtype and device). Shape is not among them: it is wrong.
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


def wrap_outputs(compiled, positions: list[int]):
    """compiled(*args) with the outputs at positions replaced by SkippedValue."""
    if not positions:
        return compiled

    def run(*args):
        out = list(compiled(*args))
        for i in positions:
            with torch._C.DisableTorchFunctionSubclass():
                out[i] = SkippedValue(out[i].dtype, out[i].device)
        return out

    return run
