"""Gated MLPs whose act(gate) autocast computes in fp32 from a low-precision gate.

CUDA autocast runs ``pow`` and ``exp`` in fp32 (CPU autocast leaves both in bf16), and the ops after
them promote: T5 v1.1 / mT5 / UMT5's written-out GELU (HF ``gelu_new``, ``torch.pow(x, 3.0)``) and
SiLU written from its definition (``g / (1 + exp(-g))``) give an fp32 act(gate) from a bf16 gate, and
its product with a bf16 up is fp32. On the H200 mT5's four gated MLPs stayed unfused under bf16
autocast ("out torch.float32, not their promoted dtype"); they now fuse to fxfuse::swiglu with
out_dtype=float32, and act(gate) is not rounded to bf16 (eager keeps it in fp32), under
numerics="eager" too: the same holds where up is fp32 (the promoted case).

``cuda_autocast_policy`` gives CPU autocast CUDA's rule for those two ops (an AutocastCPU kernel that
casts bf16 / fp16 inputs to fp32 and runs the op, as CUDA's Autocast kernel does), so the graphs and
eager values here are the ones a GPU gives."""
import contextlib
import math

import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.kernels import swiglu as S
from tests.helpers import bf16_errors, gated_grads
from tests.test_kernel_swiglu import ACTS, rel_err

_bf, _h, _f = torch.bfloat16, torch.float16, torch.float32
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@contextlib.contextmanager
def cuda_autocast_policy():
    """CPU autocast with CUDA's fp32 policy for ``pow(Tensor, Scalar)`` and ``exp``."""
    lib = torch.library.Library("aten", "IMPL")
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def in_fp32(op):
        def kernel(x, *args):
            with torch._C._ExcludeDispatchKeyGuard(below):
                return op(x.float() if x.dtype in (_bf, _h) else x, *args)
        return kernel

    lib.impl("pow.Tensor_Scalar", in_fp32(torch.ops.aten.pow.Tensor_Scalar), "AutocastCPU")
    lib.impl("exp", in_fp32(torch.ops.aten.exp.default), "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


def gelu_new(x):
    """transformers.activations.NewGELUActivation.forward."""
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def silu_from_exp(x):
    return x / (1 + torch.exp(-x))


class Gated(nn.Module):
    """act(wi_0(x)) * wi_1(x), as T5's DenseGatedActDense before its dropout and wo. fp32_up: the up
    projection upcast (``.float()``), the promoted case; packed: gate and up the halves of one
    projection (``chunk(2, -1)``, which the packed ops would take: they have no out_dtype)."""

    def __init__(self, act, fp32_up=False, packed=False, d=24, i=40):
        super().__init__()
        self.act, self.fp32_up, self.packed = act, fp32_up, packed
        self.wi_0, self.wi_1 = nn.Linear(d, 2 * i if packed else i), nn.Linear(d, i)

    def forward(self, x):
        gate, up = self.wi_0(x).chunk(2, -1) if self.packed else (self.wi_0(x), self.wi_1(x))
        return self.act(gate) * (up.float() if self.fp32_up else up)


CASES = {"gelu_new": (gelu_new,), "silu_from_exp": (silu_from_exp,), "gelu_new_fp32_up": (gelu_new, True),
         "gelu_new_packed": (gelu_new, False, True)}


def _make(name):
    def make(dtype=torch.float32):
        torch.manual_seed(0)
        return Gated(*CASES[name]).to(dtype)
    return make


def _inputs():
    return {"x": torch.randn(3, 7, 24, generator=torch.Generator().manual_seed(1))}


def _loss(out):
    return out.float().pow(2).mean()


def test_the_policy_gives_cudas_dtypes():
    """Under the emulated policy the product is fp32 from bf16 projections, as on a GPU; without it CPU
    autocast keeps it bf16 (so these tests would not see the case)."""
    x = _inputs()["x"]
    with torch.autocast("cpu", dtype=_bf):
        assert _make("gelu_new")()(**{"x": x}).dtype == _bf
        with cuda_autocast_policy():
            assert _make("gelu_new")()(x).dtype == _f
            assert _make("silu_from_exp")()(x).dtype == _f
    assert _make("gelu_new")()(x).dtype == _f  # the policy is gone again


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("numerics", ["eager", "fp32"])
def test_fused_with_act_kept_in_fp32(name, numerics):
    """One fused site; the output equals eager's within fp32 parity (act(gate) not rounded to bf16:
    rounding it costs ~1e-3), and the gradients are within 2x eager's bf16 error against fp32."""
    make, x = _make(name), _inputs()["x"]
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=_bf):
        report = fxfuse.explain(make(), x)
        assert report.counts()["swiglu"] == 1 and not report.unmatched, str(report)
        model = make()
        want = model(x)
        got = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager", "numerics": numerics})(x)
    assert got.dtype == want.dtype == _f
    assert rel_err(got, want) < 1e-5
    with cuda_autocast_policy():
        (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, _inputs(), autocast=True, patterns=["swiglu"],
                                                         loss_fn=_loss)
    assert fxfuse.last_report().counts()["swiglu"] == 1
    assert f_loss <= 2 * e_loss + 1e-6 and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


def test_mt5_fuses_every_gated_mlp_under_autocast():
    """mT5 ("gated-gelu") from a tiny config: its four gated MLPs fuse under the CUDA policy as in fp32,
    and a bf16-autocast step's loss and gradients stay within 2x eager's error."""
    from transformers import AutoModelForSeq2SeqLM

    from fxfuse.zoo import SEQ2SEQ_TINY, hf_config, without_randomness

    cfg = without_randomness(hf_config("mt5", **SEQ2SEQ_TINY))

    def make(dtype=torch.float32):
        torch.manual_seed(0)
        return AutoModelForSeq2SeqLM.from_config(cfg).to(dtype)

    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    assert fxfuse.explain(make(), **batch).counts()["swiglu"] == 4
    with cuda_autocast_policy():
        with torch.autocast("cpu", dtype=_bf):
            assert fxfuse.explain(make(), **batch).counts()["swiglu"] == 4
        (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, batch, autocast=True, patterns=["swiglu"])
    assert f_loss <= 2 * e_loss + 1e-6 and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


@pytest.mark.interpreter
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 7), (199, 33), (3, 5, 130)])
@pytest.mark.parametrize("dtypes", [(_bf, _bf), (_h, _h), (_bf, _h)],
                         ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_op_out_dtype_float32(act, shape, dtypes):
    """out_dtype=float32: act(g) * u in fp32 from low-precision gate and up, stored once in fp32; dgate
    and dup in their own dtypes. The Triton kernels under the interpreter against the reference."""
    gen = torch.Generator().manual_seed(0)
    g = (torch.randn(shape, generator=gen) * 2).to(dtypes[0]).requires_grad_()
    u = torch.randn(shape, generator=gen).to(dtypes[1]).requires_grad_()
    dout = torch.randn(shape, generator=gen)
    out, dg, du = gated_grads(lambda a, b: torch.ops.fxfuse.swiglu(a, b, act, False, _f), g, u, dout)
    assert (out.dtype, dg.dtype, du.dtype) == (_f, *dtypes)
    ref = S._act_ref(g.detach().float(), act) * u.detach().float()
    assert rel_err(out, ref) < 1e-5
    rdg, rdu = S._swiglu_backward_reference(dout, g.detach(), u.detach(), act, True, True)
    assert rel_err(dg, rdg) < 2.0 ** -7 and rel_err(du, rdu) < 2.0 ** -7


@pytest.mark.interpreter
def test_opcheck_out_dtype():
    g, u = (torch.randn(3, 24).to(_bf).requires_grad_() for _ in range(2))
    torch.library.opcheck(torch.ops.fxfuse.swiglu, (g, u, "gelu_tanh", False, _f))


def test_out_dtype_other_than_float32_is_an_error():
    g = torch.randn(2, 8)
    with pytest.raises(ValueError, match="out_dtype must be None or"):
        torch.ops.fxfuse.swiglu(g.bfloat16(), g.bfloat16(), "silu", False, _h)
    with pytest.raises(ValueError, match="out_dtype must be None or"):
        torch.ops.fxfuse.swiglu(g.double(), g.double(), "silu", False, _f)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_cuda_kernels_out_dtype_float32(act):
    """The compiled kernels with out_dtype=float32 against the reference on the same CUDA tensors: the
    fp32 output within fp32 parity, each bf16 gradient differing in < 3% of its elements (ties)."""
    gen = torch.Generator().manual_seed(0)
    g, u = ((torch.randn(333, 777, generator=gen) * s).to(_bf).cuda() for s in (2, 1))
    dout = torch.randn(333, 777, generator=gen).cuda()
    out = torch.ops.fxfuse.swiglu(g, u, act, False, _f)
    dg, du = torch.ops.fxfuse.swiglu_backward(dout, g, u, act, True, True)
    rdg, rdu = S._swiglu_backward_reference(dout, g, u, act, True, True)
    assert out.dtype == _f and rel_err(out, S._swiglu_reference(g, u, act, False, _f)) < 1e-5
    for x, r in ((dg, rdg), (du, rdu)):
        assert x.dtype == _bf and (x != r).double().mean() < 0.03


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gelu_new", "silu_from_exp"])
def test_cuda_autocast_fuses_with_act_in_fp32(name):
    """Real CUDA autocast (no emulation): one fused site, the output within fp32 parity of eager's."""
    model, x = _make(name)().cuda(), _inputs()["x"].cuda()
    with torch.autocast("cuda", dtype=_bf):
        report = fxfuse.explain(model, x)
        want = model(x)
        got = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(x)
    assert report.counts()["swiglu"] == 1 and not report.unmatched, str(report)
    assert want.dtype == got.dtype == _f and rel_err(got, want) < 1e-5
