"""Shared pieces of the loss-head kernel tests (test_kernel_linear_cross_entropy*.py): the ops, the
eager definition, inputs, fwd+bwd runs and the small-chunk plan every test starts from."""
import pytest
import torch

import fxfuse.kernels._lce_chunks as lce_chunks
import fxfuse.kernels.linear_cross_entropy as lce

OP = torch.ops.fxfuse.linear_cross_entropy
FAST = torch.ops.fxfuse.linear_cross_entropy_fast
ALGOS = ["fast", "lean"]


def op_with(algorithm):
    """OP with its trailing algorithm argument fixed."""
    return lambda x, w, b, t, *args: OP(x, w, b, t, *args, algorithm)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """16-row passes x 64-column logits chunks x 128-column gradient groups: N=37, V=211 runs
    3 passes x 4 chunks in 2 groups (the last pass, chunk and group ragged); the fast path runs
    3 passes of [16, 211] logits blocks swept in 64-column tiles."""
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", (16, 64, 128))


def inputs(n, h, v, dtype, bias=False, ignore_index=-100, logit_std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * logit_std / h**0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = ignore_index
    return x, w, b, t


def fwd_bwd(fn, x, w, b, t, *args):
    """[loss, dx, dW, (db)] on fresh leaf copies of x, w, b."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    b = b.detach().clone().requires_grad_() if b is not None else None
    wrt = [p for p in (x, w, b) if p is not None]
    loss = fn(x, w, b, t, *args)
    return [loss, *torch.autograd.grad(loss, wrt)]


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


EAGER = lce.linear_cross_entropy_eager
