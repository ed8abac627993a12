"""CPU tests of fxfuse.clamped_swiglu (gpt-oss): the Triton kernels under the interpreter
(TRITON_INTERPRET=1) and the PyTorch reference, against the eager spelling of HF's GptOssExperts."""
import pytest
import torch

from fxfuse.kernels import clamped_swiglu as C
from tests.helpers import gated_grads as grads

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss-20b / 120b's swiglu_alpha, swiglu_limit
SHAPES = [(1, 7), (199, 33), (3, 5, 130), (4, 1100)]  # 1 row, odd rows, 3-D, I > BLOCK_N


def op(gate, up, round_act=False, alpha=ALPHA, limit=LIMIT):
    return torch.ops.fxfuse.clamped_swiglu(gate, up, alpha, limit, round_act)


def eager(gate, up, alpha=ALPHA, limit=LIMIT):
    """HF GptOssExperts._apply_gate after its split, in the inputs' dtype."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def make(shape, dtype, layout, seed=0):
    """gate, up of `shape` (scaled so ~1/3 of the values pass the clamps, the bounds themselves and
    a NaN included) in one of three layouts, plus the leaves to differentiate."""
    gen = torch.Generator().manual_seed(seed)
    *lead, i = shape
    gu = torch.randn(*lead, 2 * i, generator=gen) * 7
    gu.view(-1)[:4] = torch.tensor([LIMIT, -LIMIT, LIMIT, float("nan")])  # g = L, u = -L, g = L, u = NaN
    gu = gu.to(dtype)
    if layout == "interleaved":  # gpt-oss: gate_up[..., ::2], gate_up[..., 1::2] (last-dim stride 2)
        gu.requires_grad_()
        return gu[..., ::2], gu[..., 1::2], (gu,)
    g, u = gu[..., :i].contiguous(), gu[..., i:].contiguous()
    if layout == "transposed":
        g = g.transpose(-1, -2).contiguous().transpose(-1, -2)
    g, u = g.requires_grad_(), u.requires_grad_()
    return g, u, (g, u)


def rel_err(x, ref):
    x, ref = x.double().nan_to_num(), ref.double().nan_to_num()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "transposed"])
def test_fp32_matches_eager(shape, layout):
    g, u, _ = make(shape, torch.float32, layout)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out, dg, du = grads(op, g, u, dout)
    assert out.is_contiguous() and out.shape == g.shape and out.dtype == g.dtype
    ref = grads(eager, g, u, dout)
    for x, r in zip((out, dg, du), ref):
        assert torch.equal(x.isnan(), r.isnan())
        assert rel_err(x, r) < 1e-5


def test_bounds_rule_is_this_torchs_clamp():
    """clamp_grad_at_bounds says what the installed torch's clamp does at a bound (subgradient 1
    up to 2.13, 0 from 2.14), eager and compiled: the kernels' rule follows it."""
    from fxfuse.kernels._dispatch import clamp_grad_at_bounds

    def gate_and_up(t):  # the op's two clamps, each at its bound: t[0] = -L (up), t[1] = L (both)
        return t.clamp(-LIMIT, LIMIT).sum() + t[1:].clamp(max=LIMIT).sum()

    x = torch.tensor([-LIMIT, LIMIT], requires_grad=True)
    for fn in (gate_and_up, torch.compile(gate_and_up, backend="aot_eager")):
        (dx,) = torch.autograd.grad(fn(x), x)
        assert dx.tolist() == ([1.0, 2.0] if clamp_grad_at_bounds() else [0.0, 0.0])


def test_reference_backward_matches_autograd():
    """The hand-written derivative (kernel and reference share it) against autograd of the eager
    spelling in fp64, values on both sides of each clamp bound and exactly on it."""
    g, u, _ = make((64, 257), torch.float64, "contiguous")
    dout = torch.randn(64, 257, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = grads(eager, g, u, dout)
    assert ((g.detach() > LIMIT).any() and (u.detach().abs() > LIMIT).any() and (g.detach() == LIMIT).any())
    dg, du = C._clamped_swiglu_backward_reference(dout, g.detach(), u.detach(), ALPHA, LIMIT, True, True)
    out = C._clamped_swiglu_reference(g.detach(), u.detach(), ALPHA, LIMIT)
    for x, r in zip((out, dg, du), ref):
        assert torch.equal(x.isnan(), r.isnan())
        assert rel_err(x, r) < 1e-12


@pytest.mark.parametrize("shape", [(199, 65), (2, 3, 1030)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_2x_eager(shape, dtype):
    """One rounding (round_act off): out and gradients no further from fp64 than 2x eager's own."""
    g, u, _ = make(shape, dtype, "interleaved")
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = grads(eager, *(t.detach().double().requires_grad_() for t in (g, u)), dout.double())
    got = grads(op, g, u, dout)
    base = grads(eager, g, u, dout)
    for x, e, r in zip(got, base, ref):
        assert x.dtype == dtype
        err = lambda y: (y.double() - r).nan_to_num().abs().max()  # noqa: E731
        assert err(x) <= 2 * err(e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_round_act_matches_eager(monkeypatch, dtype, on_triton):
    """round_act=True (numerics="eager") rounds where eager's ops store: out, dgate and dup equal
    eager autograd's low-precision results bit for bit (PyTorch's CPU sigmoid_backward: fp32 for
    bf16, each op rounded for fp16; the gpu test checks CUDA's), NaN and clamp bounds included;
    with one rounding (round_act off) most elements differ."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    g, u, _ = make((199, 130), dtype, "interleaved")
    dout = torch.randn((199, 130), generator=torch.Generator().manual_seed(1)).to(dtype)
    got = grads(lambda a, b: op(a, b, True), g, u, dout)
    once = grads(op, g, u, dout)
    ref = grads(eager, g, u, dout)
    for name, x, r, o in zip(["out", "dgate", "dup"], got, ref, once):
        torch.testing.assert_close(x, r, rtol=0, atol=0, equal_nan=True, msg=name)
        live = (r != 0) | (o != 0)
        assert (o != r)[live].double().mean() > 0.2, name


@pytest.mark.parametrize("frozen", ["gate", "up", "both"])
def test_frozen_inputs(frozen):
    g, u, _ = make((5, 40), torch.float32, "contiguous")
    g.requires_grad_(frozen == "up"), u.requires_grad_(frozen == "gate")
    if frozen == "both":
        assert not op(g, u).requires_grad
        return
    dout = torch.randn(5, 40)
    op(g, u).backward(dout)
    rdg, rdu = C._clamped_swiglu_backward_reference(dout, g.detach(), u.detach(), ALPHA, LIMIT, True, True)
    live, dead, ref = (u, g, rdu) if frozen == "gate" else (g, u, rdg)
    assert dead.grad is None
    assert rel_err(live.grad, ref) < 1e-5


@pytest.mark.parametrize("need", [(True, False), (False, True)])
def test_backward_op_skips_unneeded_grad(need):
    g, u, _ = make((3, 20), torch.float32, "contiguous")
    g, u, d = g.detach(), u.detach(), torch.randn(3, 20)
    dg, du = torch.ops.fxfuse.clamped_swiglu_backward(d, g, u, ALPHA, LIMIT, *need)
    rdg, rdu = C._clamped_swiglu_backward_reference(d, g, u, ALPHA, LIMIT, True, True)
    for flag, x, r in ((need[0], dg, rdg), (need[1], du, rdu)):
        assert (rel_err(x, r) < 1e-5) if flag else (x.numel() == 0)


def test_inputs_and_grad_output_not_mutated():
    g, u, (gu,) = make((6, 50), torch.float32, "interleaved")
    dout = torch.randn(6, 50)
    before = (gu.detach().clone(), dout.clone())
    op(g, u).backward(dout)
    assert torch.equal(gu.detach().nan_to_num(), before[0].nan_to_num()) and torch.equal(dout, before[1])


def test_bad_arguments():
    g = torch.randn(2, 8)
    with pytest.raises(ValueError, match="limit must be >= 0"):
        op(g, g, limit=-1.0)
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
    gu = (torch.randn(3, 48, generator=torch.Generator().manual_seed(0)) * 7).requires_grad_()  # no NaN: opcheck compares with ==
    g, u = gu[..., ::2], gu[..., 1::2]
    torch.library.opcheck(torch.ops.fxfuse.clamped_swiglu, (g, u, ALPHA, LIMIT))
    torch.library.opcheck(torch.ops.fxfuse.clamped_swiglu, (g, u, ALPHA, LIMIT, True))
    d = torch.randn(3, 24)
    torch.library.opcheck(torch.ops.fxfuse.clamped_swiglu_backward,
                          (d, g.detach(), u.detach(), ALPHA, LIMIT, True, False))


def test_compile_dynamic_two_sizes():
    """Compile axis: aot_eager with dynamic shapes, two sizes, interleaved halves, parity in fp32."""
    torch._dynamo.reset()

    def apply_gate(gate_up):
        return torch.ops.fxfuse.clamped_swiglu(gate_up[..., ::2], gate_up[..., 1::2], ALPHA, LIMIT)

    compiled = torch.compile(apply_gate, backend="aot_eager", dynamic=True)
    for rows, i in ((5, 24), (9, 40)):
        x = (torch.randn(rows, 2 * i) * 7).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        dout = torch.randn(rows, i)
        compiled(x).backward(dout)
        eager(x_ref[..., ::2], x_ref[..., 1::2]).backward(dout)
        assert rel_err(x.grad, x_ref.grad) < 1e-5
