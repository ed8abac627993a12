"""Inputs, eager reference modules and error measures shared by the RMSNorm kernel tests
(tests/test_kernel_rms_norm.py: the op; tests/test_kernel_rms_norm_launch.py: its launch paths)."""
import torch

from fxfuse.kernels.rms_norm import rms_norm

EPS = 1e-6
# (leading shape, D): 1 row, 199 rows, non-powers of two, per-head [B, T, H, D], several row blocks
# per backward program (600 x 40 -> 10 blocks of 64 rows; 199 x 1000 -> 50 blocks of 4 rows).
SHAPES = [((1,), 64), ((199,), 40), ((3, 5), 96), ((2, 3, 4), 24), ((600,), 40), ((199,), 1000)]
LOW = [torch.bfloat16, torch.float16]


def inputs(lead, d, dtype, w_center=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*lead, d, generator=g)).to(dtype)
    w = (w_center + 0.3 * torch.randn(d, generator=g)).to(dtype)
    dy = torch.randn(*lead, d, generator=g).to(dtype)
    return x, w, dy


def grads(fn, x, w, dy):
    x = x.detach().clone().requires_grad_()
    w = None if w is None else w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, None if w is None else w.grad


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def llama_eager(x, w):
    """transformers' LlamaRMSNorm.forward (also Mistral, Qwen2, Phi-3)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * xf.to(x.dtype)


def gemma_eager(x, w):
    """transformers' GemmaRMSNorm.forward (weight stored zero-centred)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (out * (1.0 + w.float())).type_as(x)


def llama_op(x, w):
    return rms_norm(x, w, EPS, 0.0, True, torch.promote_types(x.dtype, w.dtype))


def gemma_op(x, w):
    return rms_norm(x, w, EPS, 1.0, False, x.dtype)


def fp64_grads(fn, x, w, dy):
    """The eager module evaluated in fp64 with fp64 leaves (the accuracy reference)."""
    return grads(fn, x.double(), w.double(), dy.double())
