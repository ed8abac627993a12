"""Where an op's work runs: Triton (CUDA, or CPU under the interpreter) or the PyTorch reference."""
import functools
import os

import torch


# Triton's interpreter (CPU tensors under TRITON_INTERPRET=1, the CI kernel tests) runs a launch's
# programs one after another at ~15-20 ms each however small: kernels that take one row or position
# per program on the GPU take there as many as fit a tile of this many elements.
INTERPRETER_TILE = 1 << 14


def use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU tensors only under TRITON_INTERPRET=1 (the CI kernel tests)."""
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter runs programs one after another: a few suffice to test the loop


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch ("2.14.1+cu130" -> (2, 14))."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def clamp_grad_at_bounds() -> bool:
    """Whether the installed torch's clamp passes the gradient where its input equals a bound: the
    subgradient 1 up to torch 2.13; from 2.14 the minimum-norm subgradient 0 (pytorch/pytorch#184572),
    in eager autograd and torch.compile's decomposition alike. Fused ops with a clamp follow it."""
    return torch_version() < (2, 14)


def no_double_backward(op, outputs: tuple) -> tuple:
    """create_graph=True: op's outputs, made to raise when differentiated (op has no derivative;
    the message and its timing are those of torch.library.custom_op, which the ops used before)."""
    err = torch._C._functions.DelayedError(
        f"Trying to backward through {op} but no autograd formula was registered. "
        "Please use register_autograd to add one.", len(outputs))
    return err(*[t.detach().requires_grad_() for t in outputs])


def register_autograd(lib, name: str, op, function) -> None:
    """Register op's Autograd kernel: ``function.apply`` only when a gradient can flow (a tensor
    argument requires grad under grad mode: apply() costs tens of us of CPU), else op itself below
    autograd."""
    def autograd(*args):
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function.apply(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    lib.impl(name, autograd, "Autograd")
