"""CPU tests of fxfuse::rms_norm: the Triton kernels run under the interpreter (tests/conftest.py
turns it on before triton is imported) and are checked against the PyTorch reference and eager HF-style
modules (Llama: cast before weight; Gemma: (1 + w) in fp32, cast at the end)."""
import os

import pytest
import torch

from fxfuse.kernels._dispatch import use_triton
from fxfuse.kernels.rms_norm import rms_norm, rms_norm_reference

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)

EPS = 1e-6
# (leading shape, D): 1 row, 199 rows, non-powers of two, per-head [B, T, H, D], several row blocks
# per backward program (600 x 40 -> 10 blocks of 64 rows; 199 x 1000 -> 50 blocks of 4 rows).
SHAPES = [((1,), 64), ((199,), 40), ((3, 5), 96), ((2, 3, 4), 24), ((600,), 40), ((199,), 1000)]
LOW = [torch.bfloat16, torch.float16]


def _inputs(lead, d, dtype, w_center=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*lead, d, generator=g)).to(dtype)
    w = (w_center + 0.3 * torch.randn(d, generator=g)).to(dtype)
    dy = torch.randn(*lead, d, generator=g).to(dtype)
    return x, w, dy


def _grads(fn, x, w, dy):
    x = x.detach().clone().requires_grad_()
    w = None if w is None else w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(dy)
    return y.detach(), x.grad, None if w is None else w.grad


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def llama_eager(x, w):
    """transformers' LlamaRMSNorm.forward (also Mistral, Qwen2, Phi-3)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return w * xf.to(x.dtype)


def gemma_eager(x, w):
    """transformers' GemmaRMSNorm.forward (weight stored zero-centred)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return (out * (1.0 + w.float())).type_as(x)


def llama_op(x, w):
    return rms_norm(x, w, EPS, 0.0, True, torch.promote_types(x.dtype, w.dtype))


def gemma_op(x, w):
    return rms_norm(x, w, EPS, 1.0, False, x.dtype)


def _fp64_grads(fn, x, w, dy):
    """The eager module evaluated in fp64 with fp64 leaves (the accuracy reference)."""
    return _grads(fn, x.double(), w.double(), dy.double())


def test_triton_path_is_taken_on_cpu():
    assert use_triton(torch.empty(1))


@pytest.mark.parametrize("lead,d", SHAPES)
@pytest.mark.parametrize("cast_before_weight", [True, False])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fp32_matches_reference(lead, d, cast_before_weight, offset):
    x, w, dy = _inputs(lead, d, torch.float32)
    args = (EPS, offset, cast_before_weight, torch.float32)
    got = _grads(lambda x, w: rms_norm(x, w, *args), x, w, dy)
    ref = _grads(lambda x, w: rms_norm_reference(x, w, *args), x, w, dy)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("lead,d", SHAPES[:4])
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_fp32_no_weight(lead, d, cast_before_weight):
    x, _, dy = _inputs(lead, d, torch.float32)
    args = (EPS, 0.0, cast_before_weight, torch.float32)
    got = _grads(lambda x, w: rms_norm(x, None, *args), x, None, dy)
    ref = _grads(lambda x, w: rms_norm_reference(x, None, *args), x, None, dy)
    assert got[2] is None
    for a, b in zip(got[:2], ref[:2]):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("lead,d", SHAPES)
@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_low_precision_vs_eager_modules(lead, d, dtype, style):
    eager, op, w_center = (llama_eager, llama_op, 1.0) if style == "llama" else (gemma_eager, gemma_op, 0.0)
    x, w, dy = _inputs(lead, d, dtype, w_center)
    ref = _fp64_grads(eager, x, w, dy)
    got = _grads(op, x, w, dy)
    base = _grads(eager, x, w, dy)
    for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _rel(a, r) <= 2 * _rel(b, r), name
    # The forward reproduces eager's rounding points: at most one ulp apart, element by element.
    ulp_rel = torch.finfo(dtype).eps
    assert ((got[0].float() - base[0].float()).abs() <= ulp_rel * base[0].float().abs() + 1e-6).all()


def test_low_precision_x_fp32_weight():
    """Llama with an fp32 weight and bf16 activations: w * y.to(bf16) promotes to an fp32 output."""
    x, w, dy = _inputs((199,), 96, torch.bfloat16)
    w = w.float()
    got = _grads(llama_op, x, w, dy.float())
    base = _grads(llama_eager, x, w, dy.float())
    ref = _fp64_grads(llama_eager, x, w, dy)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    for a, b, r in zip(got, base, ref):
        assert _rel(a, r) <= 2 * _rel(b, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_weight_and_frozen_input(dtype):
    x, w, dy = _inputs((199,), 40, dtype)
    full = _grads(llama_op, x, w, dy)

    xg = x.clone().requires_grad_()
    llama_op(xg, w).backward(dy)
    assert xg.grad is not None and torch.equal(xg.grad, full[1])

    wg = w.clone().requires_grad_()
    llama_op(x, wg).backward(dy)
    assert wg.grad is not None and torch.equal(wg.grad, full[2])


def test_non_contiguous_inputs():
    """Per-head q norm on a [B, H, T, D] transpose of [B, T, H, D], and a stride(-1) != 1 view."""
    x, w, dy = _inputs((2, 5, 3), 24, torch.float32)
    xt = x.transpose(1, 2)
    got = _grads(llama_op, xt, w, dy.transpose(1, 2))
    ref = _grads(lambda x, w: rms_norm_reference(x, w, EPS, 0.0, True, x.dtype), xt, w, dy.transpose(1, 2))
    assert got[0].shape == xt.shape
    for a, b in zip(got, ref):
        assert _rel(a, b) < 1e-5

    xs = torch.randn(24, 7).t()
    assert xs.stride(-1) != 1
    got = rms_norm(xs, w, EPS, 0.0, False, xs.dtype)
    assert _rel(got, rms_norm_reference(xs, w, EPS, 0.0, False, xs.dtype)) < 1e-5


def test_out_dtype_and_fake_shapes():
    x, w, _ = _inputs((3, 5), 40, torch.bfloat16)
    y = rms_norm(x, w, EPS, 0.0, False, torch.float32)
    assert y.dtype == torch.float32 and y.shape == x.shape and y.is_contiguous()
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fx = torch.empty(3, 5, 40, dtype=torch.bfloat16)
        fy = torch.ops.fxfuse.rms_norm(fx, torch.empty(40, dtype=torch.bfloat16), EPS, 0.0, True, torch.float16)
        assert fy.shape == fx.shape and fy.dtype == torch.float16


@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_opcheck(with_weight, cast_before_weight):
    x, w, _ = _inputs((3, 4), 40, torch.float32)
    x.requires_grad_()
    w = w.requires_grad_() if with_weight else None
    torch.library.opcheck(torch.ops.fxfuse.rms_norm.default, (x, w, EPS, 1.0, cast_before_weight, torch.float32))


def test_opcheck_backward_op():
    x, w, dy = _inputs((3, 4), 40, torch.float32)
    for compute_dw in (True, False):
        torch.library.opcheck(torch.ops.fxfuse.rms_norm_backward.default, (dy, x, w, EPS, 0.0, compute_dw))
    torch.library.opcheck(torch.ops.fxfuse.rms_norm_backward.default, (dy, x, None, EPS, 0.0, False))


def test_compile_dynamic_two_sizes():
    """The compile axis: aot_eager with dynamic shapes, two sizes, fwd + grads vs the reference."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: llama_op(x, w) * 2, backend="aot_eager", dynamic=True)
    for lead, d in [((7,), 40), ((3, 11), 40)]:
        x, w, dy = _inputs(lead, d, torch.float32, seed=d + len(lead))
        got = _grads(fn, x, w, dy)
        ref = _grads(lambda x, w: rms_norm_reference(x, w, EPS, 0.0, True, x.dtype) * 2, x, w, dy)
        for a, b in zip(got, ref):
            assert a.shape == b.shape and _rel(a, b) < 1e-5


def test_bench_byte_count():
    """The benchmark imports on CPU, and its minimum byte count is x, y, dy, dx (bf16) + w read twice, dw."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "bench", "bench_rms_norm.py")
    spec = importlib.util.spec_from_file_location("bench_rms_norm", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.rms_norm_bytes(16384, 4096, torch.bfloat16) == 5 * 16384 * 4096 * 2 + 3 * 4096 * 2
    assert bench.rms_norm_bytes(7, 40, torch.bfloat16, torch.float32) == 5 * 7 * 40 * 2 + 3 * 40 * 4


@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("d,programs,block_n,warps,stages", [(8200, 8, 16384, 8, 3), (8192, 12, 8192, 4, 4)])
def test_persistent_forward_wide_rows(style, d, programs, block_n, warps, stages):
    """Rows of 8K+ elements take the persistent row forward (launch.fwd_persistent), one wave of
    programs looping over rows: 37 rows of 8200 -> 8 programs (4 "SMs" on CPU x 2: three staged
    32 KiB rows per program, two fit an SM's shared memory); of 8192 -> 12 (x 3, four 16 KiB
    stages); bf16 within 2x eager's error."""
    from fxfuse.kernels import _rms_norm_launch as launch

    got_launch = launch.fwd_launch(37, d, 2, torch.device("cpu"))
    assert got_launch == (True, programs, 1, block_n, warps, stages)
    eager, op, w_center = (llama_eager, llama_op, 1.0) if style == "llama" else (gemma_eager, gemma_op, 0.0)
    x, w, dy = _inputs((37,), d, torch.bfloat16, w_center)
    ref, got, base = _fp64_grads(eager, x, w, dy), _grads(op, x, w, dy), _grads(eager, x, w, dy)
    for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
        assert _rel(a, r) <= 2 * _rel(b, r), name


@pytest.fixture
def launch_patch(monkeypatch):
    """Patch a launch choice of kernels/_rms_norm_launch.py; the cached launches are cleared around it."""
    from fxfuse.kernels import _rms_norm_launch as launch

    cached = (launch.fwd_launch, launch.fwd_chunked_launch, launch.bwd_launch, launch.bwd_split_launch,
              launch.dw_launch)
    for f in cached:
        f.cache_clear()
    yield lambda name, fn: monkeypatch.setattr(launch, name, fn)
    monkeypatch.undo()
    for f in cached:
        f.cache_clear()


@pytest.mark.parametrize("lead,d", [((600,), 40), ((199,), 1000), ((1,), 64), ((3, 5), 96)])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_persistent_forward_any_width(launch_patch, lead, d, offset):
    """The persistent row loop on narrow, ragged rows and more programs than rows (forced on: such
    rows take it only when fwd_persistent says so); with and without weight."""
    from fxfuse.kernels import _rms_norm_launch as launch

    launch_patch("fwd_persistent", lambda bn: True)
    x, w, _ = _inputs(lead, d, torch.float32)
    assert launch.fwd_launch(x.numel() // d, d, 4, x.device)[0]
    for weight in (w, None):
        got = rms_norm(x, weight, EPS, offset, True, torch.float32)
        assert _rel(got, rms_norm_reference(x, weight, EPS, offset, True, torch.float32)) < 1e-5


def test_chunked_forward_on_wide_rows():
    """Rows wider than 16K elements whose power-of-two tile would be under 7/8 full, or 64K lanes,
    take the chunked forward (launch.fwd_chunked): 3 rows of 16500 against the reference in fp32
    (< 1e-5) and bf16 (within 2x eager's error against fp64), with and without weight; rows of 16K
    elements and full 32K tiles keep the row forward."""
    from fxfuse.kernels import _rms_norm_launch as launch

    assert launch.fwd_chunked_launch(16500, 2) == launch.fwd_chunked_config(16500, 2) == (4096, 8, 4)
    assert launch.fwd_chunked_launch(65536, 4) == (8192, 16, 4)
    assert launch.fwd_chunked_launch(16384, 2) is None and launch.fwd_chunked_launch(32768, 2) is None
    x, w, dy = _inputs((3,), 16500, torch.float32)
    for weight in (w, None):
        got = rms_norm(x, weight, EPS, 0.0, True, torch.float32)
        assert _rel(got, rms_norm_reference(x, weight, EPS, 0.0, True, torch.float32)) < 1e-5
    xb, wb, dyb = (t.to(torch.bfloat16) for t in (x, w, dy))
    ref, got, base = _fp64_grads(llama_eager, xb, wb, dyb), _grads(llama_op, xb, wb, dyb), _grads(llama_eager, xb, wb, dyb)
    assert _rel(got[0], ref[0]) <= 2 * _rel(base[0], ref[0])


@pytest.mark.parametrize("lead,d,block", [((23,), 1000, 128), ((1,), 64, 16), ((2, 3, 4), 24, 16), ((5,), 40, 64)])
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_chunked_forward_any_width(launch_patch, lead, d, block, style):
    """The chunked forward forced onto narrow rows: chunks that do not divide D (1000 / 128, 24 / 16),
    one chunk wider than the row (40 / 64), one row, zero-centred Gemma weights (offset 1, fp32
    multiply); fp32 within 1e-5 of fp64 eager with and without weight, bf16 y within 2x eager's
    error, fp16 and a bf16 x with fp32 out through the reference's rounding points."""
    from fxfuse.kernels import _rms_norm_launch as launch

    launch_patch("fwd_chunked", lambda d: True)
    launch_patch("fwd_chunked_config", lambda d, elem: (block, 1, 2))
    assert launch.fwd_chunked_launch(d, 4) == (block, 1, 2)
    eager, op, w_center = (llama_eager, llama_op, 1.0) if style == "llama" else (gemma_eager, gemma_op, 0.0)
    x, w, dy = _inputs(lead, d, torch.float32, w_center)
    assert _rel(op(x, w), _fp64_grads(eager, x, w, dy)[0]) < 1e-5
    offset = 1.0 if style == "gemma" else 0.0
    cast = style == "llama"
    for weight in (w, None):
        got = rms_norm(x, weight, EPS, offset, cast, torch.float32)
        assert _rel(got, rms_norm_reference(x, weight, EPS, offset, cast, torch.float32)) < 1e-5
    xb, wb, dyb = (t.to(torch.bfloat16) for t in (x, w, dy))
    assert _rel(op(xb, wb), _fp64_grads(eager, xb, wb, dyb)[0]) <= 2 * _rel(eager(xb, wb), _fp64_grads(eager, xb, wb, dyb)[0])
    for xd, out in ((x.half(), torch.float16), (xb, torch.float32)):
        got = rms_norm(xd, w.to(xd.dtype), EPS, offset, cast, out)
        want = rms_norm_reference(xd, w.to(xd.dtype), EPS, offset, cast, out)
        assert got.dtype == out and _rel(got, want) <= 2 ** -8


@pytest.mark.parametrize("lead,d", [((600,), 40), ((199,), 1000), ((2, 150), 24)])
@pytest.mark.parametrize("block_p", [1, 2])
def test_dw_reduction_loops_over_partials(launch_patch, lead, d, block_p):
    """dw summed over the [P, D] partials in several [BLOCK_P, BLOCK_D] steps and a ragged last
    column block (on CPU P <= 32 partials fit one step unless forced smaller)."""
    from fxfuse.kernels import _rms_norm_launch as launch

    launch_patch("dw_block_p", lambda p, bd: block_p)
    launch_patch("dw_block_d", lambda d, p: 16)
    x, w, dy = _inputs(lead, d, torch.float32)
    grid = launch.bwd_launch(x.numel() // d, d, 4, x.device)[0]
    assert grid > block_p
    _, dx, dw = _grads(llama_op, x, w, dy)
    ref = _fp64_grads(llama_eager, x, w, dy)
    assert _rel(dx, ref[1]) < 1e-5 and _rel(dw, ref[2]) < 1e-5


def test_split_backward_on_wide_rows():
    """Rows wider than 8K elements (16K+-lane tiles) take the split backward (launch.bwd_split_parts):
    3 programs per row of 16500 (parts of 5500 columns in 8192-lane tiles; 4 "SMs" on CPU: one row
    group), their row sums from a first kernel (launch.bwd_two_pass), fp32 grads within 1e-5 of
    fp64 eager, with and without weight; rows of 8K elements keep whole rows per program."""
    from fxfuse.kernels import _rms_norm_launch as launch

    groups, parts, part, _, _, row_sums = launch.bwd_split_launch(5, 16500, 4, torch.device("cpu"))
    assert (groups, parts, part, row_sums) == (1, 3, 8192, launch.row_sums_config())
    assert launch.bwd_split_launch(5, 16384, 4, torch.device("cpu"))[5] is None
    assert launch.bwd_split_launch(5, 8192, 4, torch.device("cpu")) is None
    x, w, dy = _inputs((5,), 16500, torch.float32)
    ref = _fp64_grads(llama_eager, x, w, dy)
    _, dx, dw = _grads(llama_op, x, w, dy)
    assert _rel(dx, ref[1]) < 1e-5 and _rel(dw, ref[2]) < 1e-5
    xd = x.double().requires_grad_()
    (ref_dx,) = torch.autograd.grad(rms_norm_reference(xd, None, EPS, 0.0, True, torch.float64), xd, dy.double())
    assert _rel(_grads(lambda x, w: rms_norm(x, None, EPS, 0.0, True, torch.float32), x, None, dy)[1], ref_dx) < 1e-5


@pytest.mark.parametrize("lead,d,parts", [((23,), 1000, 3), ((37,), 40, 4), ((2, 3, 4), 24, 2), ((1,), 64, 8)])
@pytest.mark.parametrize("style", ["llama", "gemma"])
@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_split_backward_any_width(launch_patch, lead, d, parts, style, two_pass):
    """The split backward forced onto narrow rows, in one pass (each program re-reads the other
    parts) and two (row sums first, in column blocks of 16 here): parts that do not divide D
    (1000 / 3), more programs than rows, one row, zero-centred Gemma weights (offset 1); fp32 dx and
    dw within 1e-5 of fp64 eager, bf16 within 2x eager's error, a frozen weight (no dw), no weight."""
    from fxfuse.kernels import _rms_norm_launch as launch

    launch_patch("bwd_split_parts", lambda d: parts)
    launch_patch("bwd_two_pass", lambda parts: two_pass)
    launch_patch("row_sums_config", lambda: (16, 1, 2))
    cfg = launch.bwd_split_launch(1, d, 4, torch.device("cpu"))
    assert cfg[1] == parts and (cfg[5] is not None) == two_pass
    eager, op, w_center = (llama_eager, llama_op, 1.0) if style == "llama" else (gemma_eager, gemma_op, 0.0)
    x, w, dy = _inputs(lead, d, torch.float32, w_center)
    ref = _fp64_grads(eager, x, w, dy)
    _, dx, dw = _grads(op, x, w, dy)
    assert _rel(dx, ref[1]) < 1e-5 and _rel(dw, ref[2]) < 1e-5
    _, dx_frozen, _ = _grads(lambda x, w_: op(x, w), x, None, dy)  # weight a constant: dx only
    assert _rel(dx_frozen, ref[1]) < 1e-5
    xb, wb, dyb = (t.to(torch.bfloat16) for t in (x, w, dy))
    ref, got, base = _fp64_grads(eager, xb, wb, dyb), _grads(op, xb, wb, dyb), _grads(eager, xb, wb, dyb)
    for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
        assert _rel(a, r) <= 2 * _rel(b, r), name


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


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_split_backward_eager_rounding(launch_patch, two_pass):
    """numerics="eager" on the split backward (forced, 3 parts of a 96-wide row, one pass or two):
    dx and dw round as eager's bf16 ``w * xhat.to(dtype)`` backward, within one unit in the last
    place (the row sums' fp32 order differs from eager's), and most of dw differs from the
    single-rounding result."""
    launch_patch("bwd_split_parts", lambda d: 3)
    launch_patch("bwd_two_pass", lambda parts: two_pass)
    launch_patch("row_sums_config", lambda: (16, 1, 2))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 96, generator=g).to(torch.bfloat16).requires_grad_()
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(37, 96, generator=g).to(torch.bfloat16)
    ref = torch.autograd.grad(llama_eager(x, w), (x, w), dy)
    got = torch.autograd.grad(rms_norm(x, w, EPS, 0.0, True, torch.bfloat16, True), (x, w), dy)
    once = torch.autograd.grad(rms_norm(x, w, EPS, 0.0, True, torch.bfloat16), (x, w), dy)
    for a, r in zip(got, ref):
        a, r = a.double(), r.double()
        assert ((a - r).abs() <= 2.0 ** -7 * r.abs()).all() and (a != r).double().mean() < 0.05
    assert (once[1] != ref[1]).double().mean() > 0.2


@pytest.mark.parametrize("parts,two_pass", [(1, False), (2, False), (3, True)])
def test_row_strided_input(launch_patch, parts, two_pass):
    """x a column slice of a wider tensor (row stride 56, not D = 40: read in place, never copied)
    on the row kernel and the split backward, one pass and two: fp32 grads within 1e-5 of fp64 eager."""
    launch_patch("bwd_split_parts", lambda d: parts)
    launch_patch("bwd_two_pass", lambda parts: two_pass)
    launch_patch("row_sums_config", lambda: (16, 1, 2))
    base, w, dy = _inputs((37,), 56, torch.float32)
    w, dy = w[:40].contiguous(), dy[:, :40].contiguous()
    ref = _fp64_grads(llama_eager, base[:, :40], w, dy)
    base = base.clone().requires_grad_()
    w = w.clone().requires_grad_()
    x = base[:, :40]
    assert x.stride(0) == 56
    y = llama_op(x, w)
    y.backward(dy)
    for a, r in zip((y, base.grad[:, :40], w.grad), ref):
        assert _rel(a, r) < 1e-5
    assert not base.grad[:, 40:].any()
