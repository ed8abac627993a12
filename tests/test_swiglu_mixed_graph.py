"""Gated MLPs whose gate and up differ in dtype, as under bf16 autocast with fp32 weights: a bf16 gate
projection times an fp32 up (Mamba's scan output times act(gate), Gemma 3n's per-layer gate), or an
upcast gate times a bf16 up. They fuse to one fxfuse::swiglu whose output is in the promoted dtype;
before, they stayed unfused ("mixed dtypes"). Under Inductor, fxfuse.reinplace places each gradient
of its own dtype (dup over the fp32 grad_out, never over a buffer of gate's dtype)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from tests.helpers import bf16_errors


class Fp32Up(nn.Module):
    """act(gate(x)) * up with up computed in fp32 (autocast runs exp in fp32): bf16 gate, fp32 up."""

    def __init__(self, d=24, i=40):
        super().__init__()
        self.gate, self.proj, self.out = nn.Linear(d, i), nn.Linear(d, i), nn.Linear(i, d)

    def forward(self, x):
        return self.out(F.silu(self.gate(x)) * self.proj(x).float().exp())


class Fp32Gate(nn.Module):
    """The gate cast up on its own (``.float()``) times a bf16 up projection: fp32 gate, bf16 up."""

    def __init__(self, d=24, i=40):
        super().__init__()
        self.gate, self.up, self.out = nn.Linear(d, i), nn.Linear(d, i), nn.Linear(i, d)

    def forward(self, x):
        return self.out(F.gelu(self.gate(x).float(), approximate="tanh") * self.up(x))


MODELS = {"bf16_gate_fp32_up": Fp32Up, "fp32_gate_bf16_up": Fp32Gate}


def _make(cls):
    def make(dtype=torch.float32):
        torch.manual_seed(0)
        return cls().to(dtype)
    return make


def _inputs():
    return {"x": torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(1))}


def _loss(out):
    return out.float().pow(2).mean()


@pytest.mark.parametrize("name", list(MODELS))
def test_fused_under_autocast_within_2x_eager(name):
    make = _make(MODELS[name])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fxfuse.explain(make(), **_inputs())
    assert report.counts()["swiglu"] == 1, str(report)
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, _inputs(), autocast=True, patterns=["swiglu"],
                                                     loss_fn=_loss)
    assert fxfuse.last_report().counts()["swiglu"] == 1
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


@pytest.mark.parametrize("name,placed", [("bf16_gate_fp32_up", 1), ("fp32_gate_bf16_up", 0)])
def test_inductor_places_only_gradients_of_the_buffers_dtype(name, placed):
    """Under Inductor the backward goes through fxfuse.reinplace: fp32 dup goes over the fp32 grad_out;
    a bf16 dup may not (nor dgate over gate, a saved tensor). tests/test_reinplace.py has the mixed case
    where one gradient is placed and the other gets a fresh buffer of its own dtype. Inductor's caches
    are off: a cache hit would skip the pass."""
    from torch._dynamo.utils import counters

    counters["fxfuse"].clear()
    with torch._inductor.config.patch(force_disable_caches=True):
        (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(_make(MODELS[name]), _inputs(), autocast=True,
                                                         patterns=["swiglu"], loss_fn=_loss, inner="inductor")
    assert fxfuse.last_report().counts()["swiglu"] == 1
    assert counters["fxfuse"]["gradients_in_place"] == placed
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))
