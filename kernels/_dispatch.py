"""Where an op's work runs: Triton (CUDA, or CPU under the interpreter) or the PyTorch reference."""
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU tensors only under TRITON_INTERPRET=1 (the CI kernel tests)."""
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def no_double_backward(op, outputs: tuple) -> tuple:
    """create_graph=True: op's outputs, made to raise when differentiated (op has no derivative;
    the message and its timing are those of torch.library.custom_op, which the ops used before)."""
    err = torch._C._functions.DelayedError(
        f"Trying to backward through {op} but no autograd formula was registered. "
        "Please use register_autograd to add one.", len(outputs))
    return err(*[t.detach().requires_grad_() for t in outputs])
