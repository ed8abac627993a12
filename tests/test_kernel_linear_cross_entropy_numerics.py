"""Low-precision numerics of fxfuse.linear_cross_entropy (bf16 / fp16): against an fp64 reference
within 2x eager's own error, and eager's roundings reproduced (eager_rounding, fp32_transform), on
the Triton path under the interpreter (CPU); the CUDA path in the gpu test
(FXFUSE_TEST_DEVICE=cuda, as tests/conftest.py, leaves the interpreter off for it)."""
import pytest
import torch

import fxfuse.kernels._lce_chunks as lce_chunks
from lce_cases import ALGOS, EAGER, OP, fwd_bwd, inputs, rel, small_chunks  # noqa: F401

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunks", [(64, 128, 256), (8, 128, 128)], ids=["1pass", "8passes"])
@pytest.mark.parametrize("rounding", [False, True], ids=["fp32", "eager_rounding"])
def test_low_precision_vs_fp64(monkeypatch, dtype, chunks, algo, rounding):
    """Error of loss and each grad vs an fp64 reference is <= 2x eager's own error in dtype.
    8passes: dW is rounded to dtype after each of 8 row passes (the bf16 accumulation cost)."""
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", chunks)
    x, w, b, t = inputs(64, 64, 300, dtype, True, logit_std=4.0)
    args = (-100, "mean", 0.1, 0.0, 1.0)
    ref = fwd_bwd(EAGER, x.double(), w.double(), b.double(), t, *args)
    got = fwd_bwd(lambda *a: OP(*a, algo, rounding), x, w, b, t, *args)
    eager = fwd_bwd(EAGER, x, w, b, t, *args)
    for name, g, e, r in zip(["loss", "dx", "dw", "db"], got, eager, ref):
        assert g.dtype == e.dtype
        assert rel(g, r) <= 2 * rel(e, r), name


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap,scale,std", [(30.0, 1.0, 40.0), (0.0, 0.5, 4.0), (0.0, 1.0, 4.0)],
                         ids=["softcap", "scale", "plain"])
def test_eager_rounding_matches_eager(monkeypatch, dtype, algo, softcap, scale, std):
    """eager_rounding=True rounds each logit op (lm_head output, scale, z / c, tanh, * c) and each of
    their gradients where eager's low-precision ops store them: loss and every gradient then equal
    eager's own in dtype (to fp32 summation order; one row pass, so dW is rounded once as eager's).
    Without it the fused head differs from eager by a bf16 rounding of the logits' gradient (~1e-2)."""
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", (64, 128, 256))
    x, w, b, t = inputs(37, 64, 300, dtype, True, logit_std=std)
    args = (-100, "mean", 0.1, softcap, scale)
    got = fwd_bwd(lambda *a: OP(*a, algo, True), x, w, b, t, *args)
    eager = fwd_bwd(EAGER, x, w, b, t, *args)
    for name, g, e in zip(["loss", "dx", "dw", "db"], got, eager):
        assert rel(g, e) < 2e-4, name


class _TanhOneUnit(torch.autograd.Function):
    """tanh one fp32 unit off (towards `towards`), its backward 1 - t^2 from that output: another
    correct fp32 tanh (the kernels' own, a CPU's vector library), as seen through eager's autograd."""

    @staticmethod
    def forward(ctx, u, towards):
        t = torch.nextafter(torch.tanh(u), torch.full_like(u, towards))
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, g):
        (t,) = ctx.saved_tensors
        return g * (1 - t * t), None


def _tanh_unit_spread(eager, x, w, b, t, ignore_index, reduction, smoothing, softcap, scale):
    """Per tensor, how far eager's own loss and gradients move when its fp32 tanh is one unit off
    (either way). Near saturation 1 - t^2 loses most of its bits, so one unit of t can move a
    rounded logits gradient by one bf16 / fp16 unit: two correct tanh implementations differ by that."""
    if not softcap:
        return [0.0] * len(eager)

    def head(towards):
        def f(x, w, b, t, *_):
            zf = torch.nn.functional.linear(x, w, b).float() * scale
            zf = softcap * _TanhOneUnit.apply(zf / softcap, towards)
            return torch.nn.functional.cross_entropy(zf, t, ignore_index=ignore_index, reduction=reduction,
                                                     label_smoothing=smoothing)
        return f

    runs = [fwd_bwd(head(towards), x, w, b, t) for towards in (0.0, 2.0)]
    return [max(rel(r[i], e) for r in runs) for i, e in enumerate(eager)]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softcap,scale,std", [(30.0, 1.0, 40.0), (15.0, 0.3, 40.0), (0.0, 0.3, 4.0)],
                         ids=["softcap", "scaled_softcap", "scale"])
def test_fp32_transform_rounding_matches_eager(monkeypatch, dtype, algo, softcap, scale, std):
    """A head cast to fp32 before its scale / softcap (nanochat): with eager_rounding and
    fp32_transform only the lm_head's output and the gradient reaching it are rounded, so loss and
    every gradient equal eager's; the every-op rounding of the cast-after spelling would not.
    lean's dx is an fp32 accumulation of gradient-group matmuls, not eager's low-precision matmul:
    here one pass and one group, its reference eager's rounded logits gradient @ W in one fp32
    matmul (a flip of one bf16 unit from another summation order is ~1e-3 of max |dx|). The fused
    kernels' fp32 tanh is not torch's: each tensor may differ from eager's by up to twice eager's own
    change under a one-unit change of its tanh (_tanh_unit_spread; seen on one CPU: dx 2.85e-4, exactly
    that change), or by 2e-4 where that is larger."""
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", (64, 128, 512))
    x, w, b, t = inputs(37, 64, 300, dtype, True, logit_std=std)
    args = (-100, "mean", 0.1, softcap, scale)
    eager = fwd_bwd(lambda *a: EAGER(*a, fp32_transform=True), x, w, b, t, *args)
    bounds = [max(2e-4, 2 * s) for s in _tanh_unit_spread(eager, x, w, b, t, *args)]
    if algo == "lean":
        z = torch.nn.functional.linear(x, w, b).requires_grad_()
        zf = z.float() * scale
        zf = softcap * torch.tanh(zf / softcap) if softcap else zf
        (dz,) = torch.autograd.grad(torch.nn.functional.cross_entropy(zf, t, label_smoothing=0.1), z)
        eager[1] = (dz.float() @ w.float()).to(dtype)
    got = fwd_bwd(lambda *a: OP(*a, algo, True, True), x, w, b, t, *args)
    every_op = fwd_bwd(lambda *a: OP(*a, algo, True, False), x, w, b, t, *args)
    for name, g, e, bound in zip(["loss", "dx", "dw", "db"], got, eager, bounds):
        assert rel(g, e) < bound, name
    assert any(rel(g, e) > bound for g, e, bound in zip(every_op, eager, bounds))  # the bound tells the two apart


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("rounding,fp32_transform", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "eager_rounding", "eager_rounding_fp32_transform"])
def test_gpu_bf16_vs_fp64(monkeypatch, algo, rounding, fp32_transform):
    """The CUDA path (cuBLAS matmuls + compiled kernels) at a shape with several passes; with eager's
    roundings the lean chunks are cuBLAS bf16 matmuls (eager's own), for either cast position."""
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", (512, 1024, 2048))
    x, w, b, t = (a.cuda() if a is not None else None
                  for a in inputs(2000, 512, 5000, torch.bfloat16, True, logit_std=4.0))
    args = (-100, "mean", 0.1, 30.0, 1.0)
    eager_fn = lambda *a: EAGER(*a, fp32_transform=fp32_transform)  # noqa: E731
    ref = fwd_bwd(eager_fn, x.double(), w.double(), b.double(), t, *args)
    got = fwd_bwd(lambda *a: OP(*a, algo, rounding, fp32_transform), x, w, b, t, *args)
    eager = fwd_bwd(eager_fn, x, w, b, t, *args)
    for name, g, e, r in zip(["loss", "dx", "dw", "db"], got, eager, ref):
        assert rel(g, r) <= 2 * rel(e, r), name
