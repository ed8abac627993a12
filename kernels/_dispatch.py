"""Where an op's work runs: Triton (CUDA, or CPU under the interpreter) or the PyTorch reference."""
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU tensors only under TRITON_INTERPRET=1 (the CI kernel tests)."""
    if t.device.type == "cuda":
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
