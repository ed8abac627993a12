"""CPU tests of fxfuse.softcapped_swiglu (Inkling 2): the Triton kernels under the interpreter
(TRITON_INTERPRET=1) and the PyTorch reference, against the eager spelling of HF's
Inkling2SoftcappedSwiGLU."""
import pytest
import torch

from fxfuse.kernels import softcapped_swiglu as S
from tests.helpers import gated_grads as grads

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)

GATE_CAP, UP_CAP = 4.0, 6.0  # small caps: the sampled values reach tanh's saturation and its linear part
SHAPES = [(1, 7), (199, 33), (3, 5, 130), (4, 1100)]  # 1 row, odd rows, 3-D, I > BLOCK_N


def op(gate, up, gate_cap=GATE_CAP, up_cap=UP_CAP):
    return torch.ops.fxfuse.softcapped_swiglu(gate, up, gate_cap, up_cap)


def eager(gate, up, gate_cap=GATE_CAP, up_cap=UP_CAP):
    """HF Inkling2SoftcappedSwiGLU.forward."""
    dtype = gate.dtype
    gate, up = gate.float() if dtype != torch.float64 else gate, up.float() if dtype != torch.float64 else up
    return (torch.tanh(gate / gate_cap) * gate_cap * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)).to(dtype)


def make(shape, dtype, layout, seed=0):
    """gate, up of `shape` (spread over [-20, 20]: saturated caps and tiny values, 1e-6, included) in
    one of three layouts, plus the leaves to differentiate."""
    gen = torch.Generator().manual_seed(seed)
    *lead, i = shape
    gu = torch.randn(*lead, 2 * i, generator=gen) * 6
    gu.view(-1)[:3] = torch.tensor([1e-6, -20.0, 0.0])
    gu = gu.to(dtype)
    if layout == "chunk":  # Inkling's experts: gate_up.chunk(2, -1), read in place
        gu.requires_grad_()
        return gu[..., :i], gu[..., i:], (gu,)
    g, u = gu[..., :i].contiguous(), gu[..., i:].contiguous()
    if layout == "transposed":
        g = g.transpose(-1, -2).contiguous().transpose(-1, -2)
    g, u = g.requires_grad_(), u.requires_grad_()
    return g, u, (g, u)


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "chunk", "transposed"])
def test_fp32_matches_eager(shape, layout):
    g, u, _ = make(shape, torch.float32, layout)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out, dg, du = grads(op, g, u, dout)
    assert out.is_contiguous() and out.shape == g.shape and out.dtype == g.dtype
    for x, r in zip((out, dg, du), grads(eager, g, u, dout)):
        assert rel_err(x, r) < 1e-5


def test_tanh_is_accurate_near_zero():
    """The interpreter's tanh (an odd series below 1/4) keeps small values' bits: 1 - 2 / (exp(2u) + 1)
    alone is off by ~1e-3 relative at u = 1e-4."""
    g = torch.tensor([[1e-4, -3e-3, 0.2, 0.3, -5.0]]) * GATE_CAP
    u = torch.full_like(g, UP_CAP)  # tanh(1): up's factor a constant
    out = op(g, u)
    ref = eager(g.double(), u.double())
    assert ((out.double() - ref).abs() / ref.abs()).max() < 1e-6


def test_reference_backward_matches_autograd():
    """The hand-written derivative (kernel and reference share it) against autograd of the eager
    spelling in fp64."""
    g, u, _ = make((64, 257), torch.float64, "contiguous")
    dout = torch.randn(64, 257, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = grads(eager, g, u, dout)
    dg, du = S._softcapped_swiglu_backward_reference(dout, g.detach(), u.detach(), GATE_CAP, UP_CAP, True, True)
    out = S._softcapped_swiglu_reference(g.detach(), u.detach(), GATE_CAP, UP_CAP)
    for x, r in zip((out, dg, du), ref):
        assert rel_err(x, r) < 1e-12


@pytest.mark.parametrize("shape", [(199, 65), (2, 3, 1030)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_2x_eager(shape, dtype):
    """fp32 math, one rounding at the store, as Inkling's .float() / .to(dtype): out and gradients no
    further from fp64 than 2x eager's own."""
    g, u, _ = make(shape, dtype, "chunk")
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = grads(eager, *(t.detach().double().requires_grad_() for t in (g, u)), dout.double())
    got = grads(op, g, u, dout)
    base = grads(eager, g, u, dout)
    for x, e, r in zip(got, base, ref):
        assert x.dtype == dtype
        err = lambda y: (y.double() - r).abs().max()  # noqa: E731
        assert err(x) <= 2 * err(e)


@pytest.mark.parametrize("frozen", ["gate", "up", "both"])
def test_frozen_inputs(frozen):
    g, u, _ = make((5, 40), torch.float32, "contiguous")
    g.requires_grad_(frozen == "up"), u.requires_grad_(frozen == "gate")
    if frozen == "both":
        assert not op(g, u).requires_grad
        return
    dout = torch.randn(5, 40)
    op(g, u).backward(dout)
    rdg, rdu = S._softcapped_swiglu_backward_reference(dout, g.detach(), u.detach(), GATE_CAP, UP_CAP, True, True)
    live, dead, ref = (u, g, rdu) if frozen == "gate" else (g, u, rdg)
    assert dead.grad is None
    assert rel_err(live.grad, ref) < 1e-5


@pytest.mark.parametrize("need", [(True, False), (False, True)])
def test_backward_op_skips_unneeded_grad(need):
    g, u, _ = make((3, 20), torch.float32, "contiguous")
    g, u, d = g.detach(), u.detach(), torch.randn(3, 20)
    dg, du = torch.ops.fxfuse.softcapped_swiglu_backward(d, g, u, GATE_CAP, UP_CAP, *need)
    rdg, rdu = S._softcapped_swiglu_backward_reference(d, g, u, GATE_CAP, UP_CAP, True, True)
    for flag, x, r in ((need[0], dg, rdg), (need[1], du, rdu)):
        assert (rel_err(x, r) < 1e-5) if flag else (x.numel() == 0)


def test_bad_arguments():
    g = torch.randn(2, 8)
    with pytest.raises(ValueError, match="caps must be > 0"):
        op(g, g, up_cap=0.0)
    with pytest.raises(ValueError, match="differ"):
        op(g, g.double())
    with pytest.raises(ValueError, match="differ"):
        op(g, torch.randn(2, 9))
    with pytest.raises(ValueError, match="last dim"):
        op(torch.tensor(1.0), torch.tensor(1.0))


def test_empty():
    g = torch.randn(0, 8, requires_grad=True)
    out = op(g, g)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert g.grad.shape == (0, 8)


def test_opcheck():
    gu = (torch.randn(3, 48, generator=torch.Generator().manual_seed(0)) * 6).requires_grad_()
    g, u = gu[..., :24], gu[..., 24:]
    torch.library.opcheck(torch.ops.fxfuse.softcapped_swiglu, (g, u, GATE_CAP, UP_CAP))
    d = torch.randn(3, 24)
    torch.library.opcheck(torch.ops.fxfuse.softcapped_swiglu_backward,
                          (d, g.detach(), u.detach(), GATE_CAP, UP_CAP, True, True))


def test_compile_dynamic_two_sizes():
    """Compile axis: aot_eager with dynamic shapes, two sizes, chunked halves, parity in fp32."""
    torch._dynamo.reset()

    def apply_gate(gate_up):
        gate, up = gate_up.chunk(2, -1)
        return torch.ops.fxfuse.softcapped_swiglu(gate, up, GATE_CAP, UP_CAP)

    compiled = torch.compile(apply_gate, backend="aot_eager", dynamic=True)
    for rows, i in ((5, 24), (9, 40)):
        x = (torch.randn(rows, 2 * i) * 6).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        dout = torch.randn(rows, i)
        compiled(x).backward(dout)
        eager(*x_ref.chunk(2, -1)).backward(dout)
        assert rel_err(x.grad, x_ref.grad) < 1e-5


def test_probe_twin_is_the_shipped_kernels():
    """bench/probe_softcapped_swiglu.py's twin 1 stands for the shipped kernels in its timings: the
    same outputs bit for bit (forward and both gradients of a packed gate_up, bf16), so a kernel change
    that leaves the twin behind fails here; twin 0 (the previous math) differs."""
    from fxfuse.kernels._gated import launch_backward, launch_forward
    from fxfuse.kernels.swiglu_packed import split_packed
    from tests.helpers import load_script

    probe = load_script("bench", "probe_softcapped_swiglu")
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(37, 2 * 199, generator=g) * 8).bfloat16()
    dout = torch.randn(37, 199, generator=g).bfloat16()
    gate, up = split_packed(gate_up, False, False)

    def run(fwd, bwd, **constexprs):
        grad = torch.empty_like(gate_up)
        dgate, dup = split_packed(grad, False, False)
        out = launch_forward(fwd, gate, up, (GATE_CAP, UP_CAP), S._MAX_TILE, **constexprs)
        launch_backward(bwd, dout, gate, up, dgate, dup, True, True, (GATE_CAP, UP_CAP), S._MAX_TILE, **constexprs)
        return out, grad

    shipped = run(S._softcapped_swiglu_fwd_kernel, S._softcapped_swiglu_bwd_kernel)
    twin, previous = run(probe._fwd, probe._bwd, MATH=1), run(probe._fwd, probe._bwd, MATH=0)
    assert all(torch.equal(a, b) for a, b in zip(twin, shipped))
    assert not all(torch.equal(a, b) for a, b in zip(previous, shipped))
