"""fxfuse.swiglu with gate and up in different dtypes (a bf16 gate projection times an fp32 up under
bf16 autocast: Mamba's mixers, Gemma 3n's per-layer gate): out in the promoted dtype, dgate in gate's
and dup in up's; the Triton kernels under the interpreter (TRITON_INTERPRET=1) and the reference."""
import pytest
import torch

from fxfuse.kernels import swiglu as S
from tests.helpers import gated_grads as grads
from tests.test_kernel_swiglu import ACTS, eager, rel_err

pytestmark = pytest.mark.interpreter

_bf, _h, _f = torch.bfloat16, torch.float16, torch.float32
PAIRS = [(_bf, _f), (_f, _bf), (_h, _f), (_bf, _h)]  # (gate, up)
SHAPES = [(1, 7), (199, 33), (3, 5, 130), (4, 1100)]


def make(shape, gate_dtype, up_dtype, transposed=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = (torch.randn(shape, generator=gen) * 2).to(gate_dtype)
    u = torch.randn(shape, generator=gen).to(up_dtype)
    if transposed:  # last-dim stride != 1
        g = g.transpose(-1, -2).contiguous().transpose(-1, -2)
    dout = torch.randn(shape, generator=gen).to(torch.promote_types(gate_dtype, up_dtype))
    return g.requires_grad_(), u.requires_grad_(), dout


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtypes", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_matches_reference_in_each_dtype(act, shape, dtypes):
    g, u, dout = make(shape, *dtypes, transposed=shape == (199, 33))
    out, dg, du = grads(lambda a, b: torch.ops.fxfuse.swiglu(a, b, act), g, u, dout)
    assert out.dtype == torch.promote_types(*dtypes) and dg.dtype == dtypes[0] and du.dtype == dtypes[1]
    assert out.is_contiguous() and out.shape == g.shape
    ref = S._swiglu_reference(g.detach(), u.detach(), act)
    rdg, rdu = S._swiglu_backward_reference(dout, g.detach(), u.detach(), act, True, True)
    for x, r in ((out, ref), (dg, rdg), (du, rdu)):
        assert x.dtype == r.dtype
        tol = 1e-5 if x.dtype == _f else 2.0 ** -7  # one rounding of the same fp32 value, or a tie
        assert rel_err(x, r) < tol


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtypes", PAIRS[:3], ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_error_within_2x_eager(act, dtypes):
    """Against fp64, each low-precision result no further off than eager's mixed-dtype F.silu(g) * u,
    each fp32 one within fp32 parity (there eager's error is the act formula's last bits)."""
    g, u, dout = make((199, 65), *dtypes)
    g64, u64 = (t.detach().double().requires_grad_() for t in (g, u))
    ref = grads(lambda a, b: eager(a, b, act), g64, u64, dout.double())
    got = grads(lambda a, b: torch.ops.fxfuse.swiglu(a, b, act), g, u, dout)
    base = grads(lambda a, b: eager(a, b, act), g, u, dout)
    for x, e, r in zip(got, base, ref):
        assert x.dtype == e.dtype
        if x.dtype == _f:
            assert rel_err(x, r) < 1e-5
        else:
            assert (x.double() - r).abs().max() <= 2 * (e.double() - r).abs().max()


@pytest.mark.parametrize("act", [a for a in ACTS if a != "gelu"])  # erf GELU: another formula than torch's
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_round_act_rounds_as_eager(monkeypatch, act, on_triton):
    """round_act: act(gate) rounded to gate's dtype before the fp32 product, dout * up rounded to it
    before act'(gate), as eager's F.silu(g_bf16) * u_fp32 and its backward store them: < 3% of the
    elements differ, where act(gate) sits on a bf16 rounding tie (the fp32 results then differ by one
    bf16 unit of act(gate)). Where GELU-tanh's derivative is tiny (gate ~ -5) eager's 1 + tanh cancels
    to 0 and the kernel's sigmoid form does not: an absolute slack of 1e-5 of the largest value."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    g, u, dout = make((199, 33), _bf, _f)
    got = grads(lambda a, b: torch.ops.fxfuse.swiglu(a, b, act, True), g, u, dout)
    ref = grads(lambda a, b: eager(a, b, act), g, u, dout)
    for name, x, r in zip(["out", "dgate", "dup"], got, ref):
        assert x.dtype == r.dtype, name
        x, r = x.detach().double(), r.detach().double()
        assert ((x - r).abs() <= 2.0 ** -7 * r.abs() + 1e-5 * r.abs().max()).all(), name  # slack: GELU' near 0
        assert (x != r).double().mean() < 0.03, name


@pytest.mark.parametrize("need", [(True, False), (False, True)])
def test_one_gradient_each_in_its_dtype(need):
    g, u, dout = make((3, 20), _bf, _f)
    dg, du = torch.ops.fxfuse.swiglu_backward(dout, g.detach(), u.detach(), "silu", *need)
    assert (dg.dtype, du.dtype) == (_bf, _f)
    assert (dg.numel() > 0) == need[0] and (du.numel() > 0) == need[1]


def test_mixing_fp64_or_shapes_is_an_error():
    g = torch.randn(2, 8)
    with pytest.raises(ValueError, match="one dtype unless"):
        torch.ops.fxfuse.swiglu(g, g.double(), "silu")
    with pytest.raises(ValueError, match="one shape"):
        torch.ops.fxfuse.swiglu(g.bfloat16(), torch.randn(2, 9), "silu")


@pytest.mark.parametrize("dtypes", PAIRS[:2], ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_opcheck(dtypes):
    g, u, dout = make((3, 24), *dtypes)
    torch.library.opcheck(torch.ops.fxfuse.swiglu, (g, u, "silu"))
    torch.library.opcheck(torch.ops.fxfuse.swiglu_backward, (dout, g.detach(), u.detach(), "silu", True, True))
    torch.library.opcheck(torch.ops.fxfuse.swiglu_backward, (dout, g.detach(), u.detach(), "gelu_tanh", False, True))


@pytest.mark.gpu
@pytest.mark.parametrize("round_act", [False, True])
@pytest.mark.parametrize("dtypes", PAIRS, ids=lambda p: f"{p[0]}-{p[1]}".replace("torch.", ""))
def test_cuda_kernels_match_the_reference(dtypes, round_act):
    """The compiled kernels (two store dtypes in one launch, bf16 rounding on the GPU's own path)
    against the PyTorch reference on the same CUDA tensors: a result rounded to a low-precision dtype
    on its way (a low-precision output, or with round_act an fp32 one computed from act(gate) rounded to
    gate's dtype) differs in < 3% of its elements (rounding ties, where a flip moves it by one unit of
    that dtype); any other fp32 result is within fp32 parity (the GPU's fast exp gives other last bits
    than torch's sigmoid in ~35% of its elements: H200, forty-fourth session)."""
    g, u, dout = (t.detach().cuda() for t in make((333, 777), *dtypes))
    out = torch.ops.fxfuse.swiglu(g, u, "silu", round_act)
    dg, du = torch.ops.fxfuse.swiglu_backward(dout, g, u, "silu", True, True, round_act)
    ref = (S._swiglu_reference(g, u, "silu", round_act),
           *S._swiglu_backward_reference(dout, g, u, "silu", True, True, round_act))
    for x, r in zip((out, dg, du), ref):
        assert x.dtype == r.dtype
        unrounded = x.dtype == _f and not (round_act and dtypes[0] != _f)
        x, r = x.double(), r.double()
        assert ((x - r).abs() <= 2.0 ** -7 * r.abs() + 1e-5 * r.abs().max()).all()
        if unrounded:
            assert rel_err(x, r) < 1e-5
        else:
            assert (x != r).double().mean() < 0.03
