"""CPU tests of fxfuse.swiglu: the Triton kernels run under the interpreter (TRITON_INTERPRET=1)."""
import pytest
import torch
import torch.nn.functional as F

from fxfuse.kernels import swiglu as S
from tests.helpers import gated_grads as grads
from tests.helpers import load_script

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)

ACTS = ("silu", "gelu", "gelu_tanh", "relu", "relu2")
SHAPES = [(1, 7), (199, 33), (3, 5, 130), (4, 1100)]  # 1 row, odd rows, 3-D, I > BLOCK_N (2 col blocks)


def op(gate, up, act):
    return torch.ops.fxfuse.swiglu(gate, up, act)


def eager(gate, up, act):
    """What users write, in the inputs' dtype (two roundings in bf16)."""
    if act == "silu":
        return F.silu(gate) * up
    if act == "relu":
        return F.relu(gate) * up
    if act == "relu2":  # HF's ReLUSquaredActivation (BitNet)
        return torch.square(F.relu(gate)) * up
    return F.gelu(gate, approximate="tanh" if act == "gelu_tanh" else "none") * up


def make(shape, dtype, layout, seed=0):
    """gate, up leaves-or-views of `shape`, in one of three layouts, plus their leaves."""
    gen = torch.Generator().manual_seed(seed)
    *lead, i = shape
    if layout == "chunked":  # gate_up.chunk(2, -1): row stride 2I, last dim contiguous
        gu = (torch.randn(*lead, 2 * i, generator=gen) * 2).to(dtype).requires_grad_()
        g, u = gu.chunk(2, dim=-1)
        return g, u, (gu,)
    g = (torch.randn(*shape, generator=gen) * 2).to(dtype)
    u = torch.randn(*shape, generator=gen).to(dtype)
    if layout == "transposed":  # last-dim stride != 1: the op must copy
        g = g.transpose(-1, -2).contiguous().transpose(-1, -2)
    g, u = g.requires_grad_(), u.requires_grad_()
    return g, u, (g, u)


def rel_err(x, ref):
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "chunked", "transposed"])
def test_fp32_matches_reference(act, shape, layout):
    g, u, _ = make(shape, torch.float32, layout)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    out, dg, du = grads(lambda a, b: op(a, b, act), g, u, dout)
    assert out.is_contiguous() and out.shape == g.shape and out.dtype == g.dtype
    assert dg.shape == g.shape and du.shape == u.shape
    ref = S._swiglu_reference(g.detach(), u.detach(), act)
    rdg, rdu = S._swiglu_backward_reference(dout, g.detach(), u.detach(), act, True, True)
    for x, r in ((out, ref), (dg, rdg), (du, rdu)):
        assert rel_err(x, r) < 1e-5


@pytest.mark.parametrize("act", ACTS)
def test_reference_backward_matches_autograd(act):
    """The hand-written act'(g) (shared with the kernel) against autograd of F.silu / F.gelu in fp64."""
    g = (torch.randn(4097, dtype=torch.float64) * 4).requires_grad_()
    (auto,) = torch.autograd.grad(S._act_ref(g, act).sum(), g)
    assert rel_err(S._act_grad_ref(g.detach(), act), auto) < 1e-12


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(199, 65), (2, 3, 1030)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_error_within_2x_eager(act, shape, dtype):
    g, u, _ = make(shape, dtype, "chunked")
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    g64 = g.detach().double().requires_grad_()
    u64 = u.detach().double().requires_grad_()
    ref = grads(lambda a, b: eager(a, b, act), g64, u64, dout.double())
    got = grads(lambda a, b: op(a, b, act), g, u, dout)
    base = grads(lambda a, b: eager(a, b, act), g, u, dout)
    for x, e, r in zip(got, base, ref):
        assert x.dtype == dtype
        assert (x.double() - r).abs().max() <= 2 * (e.double() - r).abs().max()


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("frozen", ["gate", "up", "both"])
def test_frozen_inputs(act, frozen):
    g = torch.randn(5, 40, requires_grad=frozen != "gate")
    u = torch.randn(5, 40, requires_grad=frozen != "up")
    if frozen == "both":
        g.requires_grad_(False), u.requires_grad_(False)
        assert not op(g, u, act).requires_grad
        return
    dout = torch.randn(5, 40)
    op(g, u, act).backward(dout)
    rdg, rdu = S._swiglu_backward_reference(dout, g.detach(), u.detach(), act, True, True)
    live, dead, ref = (u, g, rdu) if frozen == "gate" else (g, u, rdg)
    assert dead.grad is None
    assert rel_err(live.grad, ref) < 1e-5


@pytest.mark.parametrize("need", [(True, False), (False, True)])
def test_backward_op_skips_unneeded_grad(need):
    g, u, d = torch.randn(3, 20), torch.randn(3, 20), torch.randn(3, 20)
    dg, du = torch.ops.fxfuse.swiglu_backward(d, g, u, "silu", *need)
    rdg, rdu = S._swiglu_backward_reference(d, g, u, "silu", True, True)
    for flag, x, r in ((need[0], dg, rdg), (need[1], du, rdu)):
        assert (rel_err(x, r) < 1e-5) if flag else (x.numel() == 0)


def test_inputs_and_grad_output_not_mutated():
    g, u, (gu,) = make((6, 50), torch.float32, "chunked")
    dout = torch.randn(6, 50)
    before = (gu.detach().clone(), dout.clone())
    op(g, u, "gelu_tanh").backward(dout)
    assert torch.equal(gu.detach(), before[0]) and torch.equal(dout, before[1])


def test_bad_arguments():
    g = torch.randn(2, 8)
    with pytest.raises(ValueError, match="silu.*gelu.*gelu_tanh.*relu.*relu2"):
        op(g, g, "tanh")
    with pytest.raises(ValueError):
        op(g, g.double(), "silu")
    with pytest.raises(ValueError):
        op(g, torch.randn(2, 9), "silu")


def test_empty():
    g = torch.randn(0, 8, requires_grad=True)
    out = op(g, g, "silu")
    assert out.shape == (0, 8)
    out.sum().backward()
    assert g.grad.shape == (0, 8)


@pytest.mark.parametrize("act", ACTS)
def test_opcheck(act):
    g, u, _ = make((3, 24), torch.float32, "chunked")
    torch.library.opcheck(torch.ops.fxfuse.swiglu, (g, u, act))
    d = torch.randn(3, 24)
    torch.library.opcheck(torch.ops.fxfuse.swiglu_backward, (d, g.detach(), u.detach(), act, True, False))


def test_compile_dynamic_two_sizes():
    """Compile axis: aot_eager with dynamic shapes, two sizes, parity with eager in fp32."""
    torch._dynamo.reset()

    def mlp_act(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.ops.fxfuse.swiglu(gate, up, "silu")

    compiled = torch.compile(mlp_act, backend="aot_eager", dynamic=True)
    for rows, i in ((5, 24), (9, 40)):
        x = torch.randn(rows, 2 * i, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        dout = torch.randn(rows, i)
        out = compiled(x)
        out.backward(dout)
        g, u = x_ref.chunk(2, dim=-1)
        ref = F.silu(g) * u
        ref.backward(dout)
        assert rel_err(out, ref) < 1e-5 and rel_err(x.grad, x_ref.grad) < 1e-5


def test_bench_byte_count():
    mod = load_script("bench", "bench_swiglu")
    assert mod.swiglu_bytes(16384, 14336, 2) == 8 * 16384 * 14336 * 2
    # bf16 gate, fp32 up and out: g read twice and dg written (3 x 2 bytes), u likewise (3 x 4), out and dout (2 x 4)
    assert mod.swiglu_bytes(10, 3, 2, 4, 4) == 10 * 3 * (3 * 2 + 3 * 4 + 2 * 4)
    assert callable(mod.run) and callable(mod.add_args) and callable(mod.main)


@pytest.mark.parametrize("act", [a for a in ACTS if a != "relu"])  # relu: exact, test_relu_rounds_as_eager
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_round_act_matches_eager(monkeypatch, act, dtype, on_triton):
    """round_act=True (numerics="eager") rounds act(gate) and dout * up where eager's two ops store
    them, so out, dgate and dup round like eager's own results: with one rounding (the default op)
    ~25% of the nonzero elements differ from eager by a unit in the last place; with round_act only those
    whose fp32 act (another formula than PyTorch's for GELU) sits on a rounding tie: < 3%."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    g, u, _ = make((199, 33), dtype, "contiguous")
    dout = torch.randn((199, 33), generator=torch.Generator().manual_seed(1)).to(dtype)
    got = grads(lambda a, b: torch.ops.fxfuse.swiglu(a, b, act, True), g, u, dout)
    ref = grads(lambda a, b: eager(a, b, act), g, u, dout)
    once = grads(lambda a, b: op(a, b, act), g, u, dout)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for name, x, r, o in zip(["out", "dgate", "dup"], got, ref, once):
        x, r, o = x.detach().double(), r.detach().double(), o.detach().double()
        assert ((x - r).abs() <= 2 * ulp * r.abs() + 1e-3 * ulp * r.abs().max()).all(), name
        live = (r != 0) | (o != 0)  # relu2: a gate <= 0 gives an exact 0 in every mode
        assert (x != r)[live].double().mean() < 0.03 < 0.2 < (o != r)[live].double().mean(), name


@pytest.mark.parametrize("round_act", [False, True])
def test_relu_rounds_as_eager(round_act):
    """relu(gate) is exact in any dtype, so ReGLU's single rounding per output is eager's: out, dgate
    and dup equal eager's bf16 results bit for bit, with or without round_act; NaN gates stay NaN."""
    g, u, _ = make((199, 33), torch.bfloat16, "contiguous")
    with torch.no_grad():
        g[0, :3] = torch.tensor([0.0, -0.0, float("nan")])
    dout = torch.randn((199, 33), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = grads(lambda a, b: torch.ops.fxfuse.swiglu(a, b, "relu", round_act), g, u, dout)
    ref = grads(lambda a, b: eager(a, b, "relu"), g, u, dout)
    for x, r in zip(got, ref):
        torch.testing.assert_close(x, r, rtol=0, atol=0, equal_nan=True)


def test_bench_softcapped_case_is_inklings_activation():
    """bench_swiglu's softcapped_swiglu case: its eager function (Inkling 2's module on the halves of
    gate_up) and the fxfuse op it times agree, value and gradient, on the chunked layout."""
    mod = load_script("bench", "bench_swiglu")
    gu = (torch.randn(199, 66, generator=torch.Generator().manual_seed(0)) * 8).requires_grad_()
    dout = torch.randn(199, 33, generator=torch.Generator().manual_seed(1))
    fused = mod._fxfuse_fn("softcapped_swiglu", "chunked", False)
    got = mod._fwd_bwd(fused, (gu,), dout)
    ref = mod._fwd_bwd(lambda t: mod.eager_swiglu(*t.chunk(2, -1), "softcapped_swiglu"), (gu,), dout)
    assert rel_err(got[0], ref[0]) < 1e-5 and rel_err(got[1], ref[1]) < 1e-5


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_bench_fp32_act_case(act):
    """bench_swiglu --fp32-act: eager's act(g.float()) * u and the fxfuse op it times (out_dtype=float32)
    both give an fp32 out from bf16 gate and up, equal to within fp32 rounding; the bf16 gradients
    within one bf16 rounding of each other (each rounds its fp32 gradient once)."""
    mod = load_script("bench", "bench_swiglu")
    gen = torch.Generator().manual_seed(0)
    g, u = (torch.randn(199, 33, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(2))
    dout = torch.randn(199, 33, generator=gen)
    got = mod._fwd_bwd(mod._fxfuse_fn(act, "separate", False, fp32_act=True), (g, u), dout)
    ref = mod._fwd_bwd(lambda a, b: mod.eager_swiglu(a, b, act, fp32_act=True), (g, u), dout)
    assert got[0].dtype == ref[0].dtype == torch.float32 and rel_err(got[0], ref[0]) < 1e-5
    for x, r in zip(got[1:], ref[1:]):
        assert x.dtype == torch.bfloat16
        torch.testing.assert_close(x, r, rtol=2 ** -7, atol=1e-6)
