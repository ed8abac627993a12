"""CPU tests of fxfuse.swiglu_packed / clamped_swiglu_packed / softcapped_swiglu_packed (gate and up as
the halves of one gate_up tensor, d gate_up written whole): the Triton kernels under the interpreter
and the PyTorch reference path, against the unpacked ops on the same views and against eager."""
import pytest
import torch
import torch.nn.functional as F

from fxfuse.kernels.swiglu_packed import split_packed

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)

ALPHA, LIMIT = 1.702, 7.0
GATE_CAP, UP_CAP = 3.0, 5.0  # inputs ~ N(0, 16): both softcaps bite
SHAPES = [(1, 2), (199, 66), (3, 5, 260), (2, 2200)]  # I = 1, odd rows, 3-D, I > BLOCK_N
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]  # (interleaved, up_first)
ACTS = ["silu", "gelu_tanh", "relu2", "clamped", "softcapped"]


def packed(gate_up, act, interleaved, up_first, round_act=False):
    if act == "softcapped":  # one rounding at the store: no round_act
        return torch.ops.fxfuse.softcapped_swiglu_packed(gate_up, GATE_CAP, UP_CAP, interleaved, up_first)
    if act == "clamped":
        return torch.ops.fxfuse.clamped_swiglu_packed(gate_up, ALPHA, LIMIT, interleaved, up_first, round_act)
    return torch.ops.fxfuse.swiglu_packed(gate_up, act, interleaved, up_first, round_act)


def unpacked(gate, up, act, round_act=False):
    if act == "softcapped":
        return torch.ops.fxfuse.softcapped_swiglu(gate, up, GATE_CAP, UP_CAP)
    if act == "clamped":
        return torch.ops.fxfuse.clamped_swiglu(gate, up, ALPHA, LIMIT, round_act)
    return torch.ops.fxfuse.swiglu(gate, up, act, round_act)


def eager(gate, up, act):
    if act == "softcapped":  # HF Inkling2SoftcappedSwiGLU, fp32
        g, u = gate.float(), up.float()
        out = GATE_CAP * torch.tanh(g / GATE_CAP) * torch.sigmoid(g) * (UP_CAP * torch.tanh(u / UP_CAP))
        return out.to(gate.dtype)
    if act == "clamped":  # HF GptOssExperts._apply_gate
        gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
        return (up + 1) * gate * torch.sigmoid(gate * ALPHA)
    if act == "relu2":
        return torch.square(F.relu(gate)) * up
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


def make(shape, dtype, seed=0):
    """gate_up [..., 2I] (scaled so the clamps bite) and an output gradient [..., I]."""
    gen = torch.Generator().manual_seed(seed)
    *lead, i = shape
    gate_up = (torch.randn(*lead, 2 * i, generator=gen) * 4).to(dtype).requires_grad_()
    return gate_up, torch.randn(shape, generator=gen).to(dtype)


def grad_of(fn, gate_up, dout):
    x = gate_up.detach().clone().requires_grad_()
    out = fn(x)
    (dx,) = torch.autograd.grad(out, x, dout)
    return out, dx


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["halves", "halves_up_first", "interleaved", "interleaved_up_first"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype,round_act", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_packed_equals_unpacked_ops(shape, layout, act, dtype, round_act):
    """Same kernels, same views: out and d gate_up bit for bit those of the unpacked op, whose dgate
    and dup autograd scatters into gate_up's gradient."""
    gate_up, dout = make(shape, dtype)
    out, dx = grad_of(lambda x: packed(x, act, *layout, round_act), gate_up, dout)
    ref, ref_dx = grad_of(lambda x: unpacked(*split_packed(x, *layout), act, round_act), gate_up, dout)
    assert out.shape == shape and out.is_contiguous() and dx.is_contiguous()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "reference"])
def test_fp32_matches_eager(layout, act, triton, monkeypatch):
    if not triton:
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference path
    gate_up, dout = make((3, 5, 130), torch.float32)
    out, dx = grad_of(lambda x: packed(x, act, *layout), gate_up, dout)
    ref, ref_dx = grad_of(lambda x: eager(*split_packed(x, *layout), act), gate_up, dout)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)


def test_strided_gate_up():
    """A column-major gate_up (a transposed matmul output) is read in place, not copied."""
    gate_up = (torch.randn(96, 9) * 4).t().requires_grad_()  # [9, 96], strides (1, 9)
    dout = torch.randn(9, 48)
    for act in ACTS:
        out, dx = grad_of(lambda x: packed(x, act, True, False), gate_up, dout)
        ref, ref_dx = grad_of(lambda x: eager(x[..., ::2], x[..., 1::2], act), gate_up, dout)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)


def test_odd_last_dim_is_an_error():
    with pytest.raises(ValueError, match="even last dim"):
        torch.ops.fxfuse.swiglu_packed(torch.randn(3, 7), "silu", False, False)
    with pytest.raises(ValueError, match="even last dim"):
        torch.ops.fxfuse.clamped_swiglu_packed(torch.randn(3, 7), ALPHA, LIMIT, True, False)
    with pytest.raises(ValueError, match="even last dim"):
        torch.ops.fxfuse.softcapped_swiglu_packed(torch.randn(3, 7), GATE_CAP, UP_CAP, False, False)


def test_opcheck():
    gate_up = (torch.randn(3, 48, generator=torch.Generator().manual_seed(0)) * 4).requires_grad_()
    d = torch.randn(3, 24)
    for interleaved, up_first in LAYOUTS:
        torch.library.opcheck(torch.ops.fxfuse.swiglu_packed, (gate_up, "silu", interleaved, up_first))
        torch.library.opcheck(torch.ops.fxfuse.clamped_swiglu_packed,
                              (gate_up, ALPHA, LIMIT, interleaved, up_first, True))
    torch.library.opcheck(torch.ops.fxfuse.swiglu_packed_backward, (d, gate_up.detach(), "gelu_tanh", True, False))
    torch.library.opcheck(torch.ops.fxfuse.clamped_swiglu_packed_backward,
                          (d, gate_up.detach(), ALPHA, LIMIT, False, True))
    for interleaved, up_first in LAYOUTS:
        torch.library.opcheck(torch.ops.fxfuse.softcapped_swiglu_packed, (gate_up, GATE_CAP, UP_CAP, interleaved,
                                                                          up_first))
    torch.library.opcheck(torch.ops.fxfuse.softcapped_swiglu_packed_backward,
                          (d, gate_up.detach(), GATE_CAP, UP_CAP, True, True))


@pytest.mark.parametrize("act", ["silu", "clamped", "softcapped"])
def test_compile_dynamic_two_sizes(act):
    """Compile axis: aot_eager with dynamic shapes, two sizes, parity with eager in fp32."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: packed(x, act, True, True), backend="aot_eager", dynamic=True)
    for rows, i in ((5, 24), (9, 40)):
        gate_up, dout = make((rows, i), torch.float32)
        out, dx = grad_of(compiled, gate_up, dout)
        ref, ref_dx = grad_of(lambda x: eager(x[..., 1::2], x[..., ::2], act), gate_up, dout)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, ref_dx, rtol=1e-5, atol=1e-5)


def test_pair_detects_interleaved_views_only():
    """_gated.pair: one paired tile only for two stride-2 views that interleave one tensor's columns."""
    from fxfuse.kernels._gated import pair

    x = torch.randn(5, 12)
    assert pair(x[:, ::2], x[:, 1::2])[1] == 1
    assert pair(x[:, 1::2], x[:, ::2])[1] == 2
    base = pair(x[:, 1::2], x[:, ::2])[0][0]
    assert base.data_ptr() == x.data_ptr() and base.shape == (5, 12) and base.stride() == (12, 1)
    assert pair(x[:, :6], x[:, 6:])[1] == 0  # halves: two strided tiles
    assert pair(x[:, ::2], x[:, ::2])[1] == 0  # the same view twice
    assert pair(x[:, ::2], torch.randn(5, 12)[:, 1::2])[1] == 0  # two tensors
    y = torch.randn(64)
    assert pair(y.as_strided((5, 6), (4, 2)), y.as_strided((5, 6), (4, 2), 1))[1] == 0  # rows overlap
