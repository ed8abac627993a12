"""CPU tests of fxfuse::rms_norm: the Triton kernels run under the interpreter (tests/conftest.py
turns it on before triton is imported) and are checked against the PyTorch reference and eager HF-style
modules (Llama: cast before weight; Gemma: (1 + w) in fp32, cast at the end). The launch paths
(persistent, chunked, split, dw reduction) are tested in tests/test_kernel_rms_norm_launch.py."""

import pytest
import torch

from fxfuse.kernels._dispatch import use_triton
from fxfuse.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.helpers import load_script
from tests.rms_norm_cases import (EPS, LOW, SHAPES, fp64_grads, gemma_eager, gemma_op, grads, inputs, llama_eager,
                                  llama_op, rel)

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)


def test_triton_path_is_taken_on_cpu():
    assert use_triton(torch.empty(1))


@pytest.mark.parametrize("lead,d", SHAPES)
@pytest.mark.parametrize("cast_before_weight", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fp32_matches_reference(lead, d, cast_before_weight, offset):
    x, w, dy = inputs(lead, d, torch.float32)
    args = (EPS, offset, cast_before_weight, torch.float32)
    got = grads(lambda x, w: rms_norm(x, w, *args), x, w, dy)
    ref = grads(lambda x, w: rms_norm_reference(x, w, *args), x, w, dy)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("lead,d", SHAPES[:4])
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_fp32_no_weight(lead, d, cast_before_weight):
    x, _, dy = inputs(lead, d, torch.float32)
    args = (EPS, 0.0, cast_before_weight, torch.float32)
    got = grads(lambda x, w: rms_norm(x, None, *args), x, None, dy)
    ref = grads(lambda x, w: rms_norm_reference(x, None, *args), x, None, dy)
    assert got[2] is None
    for a, b in zip(got[:2], ref[:2]):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize("lead,d", SHAPES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_low_precision_vs_eager_modules(lead, d, dtype, style):
    eager, op, w_center = (llama_eager, llama_op, 1.0) if style == "llama" else (gemma_eager, gemma_op, 0.0)
    x, w, dy = inputs(lead, d, dtype, w_center)
    ref = fp64_grads(eager, x, w, dy)
    got = grads(op, x, w, dy)
    base = grads(eager, x, w, dy)
    for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel(a, r) <= 2 * rel(b, r), name
    # The forward reproduces eager's rounding points: at most one ulp apart, element by element.
    ulp_rel = torch.finfo(dtype).eps
    assert ((got[0].float() - base[0].float()).abs() <= ulp_rel * base[0].float().abs() + 1e-6).all()


def test_low_precision_x_fp32_weight():
    """Llama with an fp32 weight and bf16 activations: w * y.to(bf16) promotes to an fp32 output."""
    x, w, dy = inputs((199,), 96, torch.bfloat16)
    w = w.float()
    got = grads(llama_op, x, w, dy.float())
    base = grads(llama_eager, x, w, dy.float())
    ref = fp64_grads(llama_eager, x, w, dy)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for a, b, r in zip(got, base, ref):
        assert rel(a, r) <= 2 * rel(b, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_weight_and_frozen_input(dtype):
    x, w, dy = inputs((199,), 40, dtype)
    full = grads(llama_op, x, w, dy)

    xg = x.clone().requires_grad_()
    llama_op(xg, w).backward(dy)
    assert xg.grad is not None and torch.equal(xg.grad, full[1])

    wg = w.clone().requires_grad_()
    llama_op(x, wg).backward(dy)
    assert wg.grad is not None and torch.equal(wg.grad, full[2])


def test_non_contiguous_inputs():
    """Per-head q norm on a [B, H, T, D] transpose of [B, T, H, D], and a stride(-1) != 1 view."""
    x, w, dy = inputs((2, 5, 3), 24, torch.float32)
    xt = x.transpose(1, 2)
    got = grads(llama_op, xt, w, dy.transpose(1, 2))
    ref = grads(lambda x, w: rms_norm_reference(x, w, EPS, 0.0, True, x.dtype), xt, w, dy.transpose(1, 2))
    assert got[0].shape == xt.shape
    for a, b in zip(got, ref):
        assert rel(a, b) < 1e-5

    xs = torch.randn(24, 7).t()
    assert xs.stride(-1) != 1
    got = rms_norm(xs, w, EPS, 0.0, False, xs.dtype)
    assert rel(got, rms_norm_reference(xs, w, EPS, 0.0, False, xs.dtype)) < 1e-5



@pytest.mark.parametrize("rows", [3, 10, 17])
def test_eps_zero_backward_on_a_partial_row_tile(rows):
    """eps = 0 with every row nonzero: the backward tile's padded rows (x = 0) had rstd = rsqrt(0) =
    inf and put 0 * inf = nan into every dw column whenever the row count left a partial tile."""
    x, w, dy = inputs((rows,), 24, torch.float32)
    got = grads(lambda x, w: rms_norm(x, w, 0.0, 0.0, True, x.dtype), x, w, dy)
    ref = grads(lambda x, w: rms_norm_reference(x, w, 0.0, 0.0, True, x.dtype), x, w, dy)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all() and rel(a, b) < 1e-5

def test_out_dtype_and_fake_shapes():
    x, w, _ = inputs((3, 5), 40, torch.bfloat16)
    y = rms_norm(x, w, EPS, 0.0, False, torch.float32)
    assert y.dtype == torch.float32 and y.shape == x.shape and y.is_contiguous()
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fx = torch.empty(3, 5, 40, dtype=torch.bfloat16)
        fy = torch.ops.fxfuse.rms_norm(fx, torch.empty(40, dtype=torch.bfloat16), EPS, 0.0, True, torch.float16)
        assert fy.shape == fx.shape and fy.dtype == torch.float16


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_opcheck(with_weight, cast_before_weight):
    x, w, _ = inputs((3, 4), 40, torch.float32)
    x.requires_grad_()
    w = w.requires_grad_() if with_weight else None
    torch.library.opcheck(torch.ops.fxfuse.rms_norm.default, (x, w, EPS, 1.0, cast_before_weight, torch.float32))


@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_opcheck_strided_rows(monkeypatch, on_triton):
    """Rows of a transposed [B, S, H, D] (DeepSeek V4's q norm), of a slice and with a strided last
    dim (LaRA-mini's): the outputs' strides are the fake's (opcheck compares them; Inductor asserts
    them), on both paths."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    x, w, dy = inputs((2, 5, 3), 8, torch.float32)
    cols = lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2)  # noqa: E731  same values, stride(-1) 3
    for a, b in [(x.transpose(1, 2), dy.transpose(1, 2)), (x[..., :4], dy[..., :4]), (cols(x), cols(dy))]:
        wa = w[: a.shape[-1]]
        torch.library.opcheck(torch.ops.fxfuse.rms_norm.default, (a, wa, EPS, 0.0, False, torch.float32))
        torch.library.opcheck(torch.ops.fxfuse.rms_norm_backward.default, (b, a, wa, EPS, 0.0, True))


def test_opcheck_backward_op():
    x, w, dy = inputs((3, 4), 40, torch.float32)
    for compute_dw in (True, False):
        torch.library.opcheck(torch.ops.fxfuse.rms_norm_backward.default, (dy, x, w, EPS, 0.0, compute_dw))
    torch.library.opcheck(torch.ops.fxfuse.rms_norm_backward.default, (dy, x, None, EPS, 0.0, False))


def test_compile_dynamic_two_sizes():
    """The compile axis: aot_eager with dynamic shapes, two sizes, fwd + grads vs the reference."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: llama_op(x, w) * 2, backend="aot_eager", dynamic=True)
    for lead, d in [((7,), 40), ((3, 11), 40)]:
        x, w, dy = inputs(lead, d, torch.float32, seed=d + len(lead))
        got = grads(fn, x, w, dy)
        ref = grads(lambda x, w: rms_norm_reference(x, w, EPS, 0.0, True, x.dtype) * 2, x, w, dy)
        for a, b in zip(got, ref):
            assert a.shape == b.shape and rel(a, b) < 1e-5


def test_bench_byte_count():
    """The benchmark imports on CPU, and its minimum byte count is x, y, dy, dx (bf16) + w read twice, dw."""
    bench = load_script("bench", "bench_rms_norm")
    assert bench.rms_norm_bytes(16384, 4096, torch.bfloat16) == 5 * 16384 * 4096 * 2 + 3 * 4096 * 2
    assert bench.rms_norm_bytes(7, 40, torch.bfloat16, torch.float32) == 5 * 7 * 40 * 2 + 3 * 40 * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 199])
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_eager_rounding_backward_equals_llama_eager(monkeypatch, dtype, rows, on_triton):
    """eager_rounding=True (numerics="eager"): the backward of w * xhat.to(dtype) rounds dy * w and
    each dy * xhat term as eager's low-precision product does: dx and dw round as eager's (bf16 bit
    for bit here; fp16's 3 more bits see the fp32 summation order of dx in < 5% of its elements,
    by one unit in the last place); without it, most of dw differs by a rounding."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=g).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).requires_grad_()
    dy = torch.randn(rows, 96, generator=g).to(dtype)
    ref = torch.autograd.grad(llama_eager(x, w), (x, w), dy)
    got = torch.autograd.grad(rms_norm(x, w, EPS, 0.0, True, dtype, True), (x, w), dy)
    once = torch.autograd.grad(rms_norm(x, w, EPS, 0.0, True, dtype), (x, w), dy)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for a, r in zip(got, ref):
        a, r = a.double(), r.double()
        assert ((a - r).abs() <= ulp * r.abs()).all() and (a != r).double().mean() < 0.05
    if dtype == torch.bfloat16:
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert (once[1] != ref[1]).double().mean() > 0.2


@pytest.mark.parametrize("rows", [1, 199])
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_eager_rounding_with_an_fp32_weight_equals_llama_eager(monkeypatch, rows, on_triton):
    """bf16 x, fp32 weight (a per-head q / k norm under bf16 autocast: fp32 parameters): eager rounds
    xhat and the grad dy * w of xhat.to(bf16) to bf16, and makes w's grad dy * xr in fp32. With
    eager_rounding the fused backward does the same (it rounded by dy's dtype, fp32 here: not at all,
    1.4e-3 from eager's dw)."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, 96, generator=g) * 10 ** (torch.rand(rows, 1, generator=g) * 4 - 3)).bfloat16()
    x.requires_grad_()
    w = (1 + 0.1 * torch.randn(96, generator=g)).requires_grad_()
    dy = torch.randn(rows, 96, generator=g)
    ref = torch.autograd.grad(llama_eager(x, w), (x, w), dy)
    got = torch.autograd.grad(rms_norm(x, w, EPS, 0.0, True, torch.float32, True), (x, w), dy)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    dx, rdx = got[0].double(), ref[0].double()  # dx: fp32 sums in another order, then one bf16 rounding
    assert ((dx - rdx).abs() <= 2.0 ** -7 * rdx.abs()).all() and (dx != rdx).double().mean() < 0.02
    assert rel(got[1], ref[1]) < 1e-6  # dw: fp32 sums of eager's own terms
