"""CPU tests of fxfuse::rms_norm's launch paths (kernels/_rms_norm_launch.py) under the Triton
interpreter: the persistent and chunked forwards, the row backward's sums, the split backward and the
dw reduction, each on the rows that take it and forced onto narrow, ragged rows (launch_patch)."""
import pytest
import torch

from fxfuse.kernels.rms_norm import rms_norm, rms_norm_reference
from tests.rms_norm_cases import EPS, fp64_grads, gemma_eager, gemma_op, grads, inputs, llama_eager, llama_op, rel

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)


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
    x, w, dy = inputs((37,), d, torch.bfloat16, w_center)
    ref, got, base = fp64_grads(eager, x, w, dy), grads(op, x, w, dy), grads(eager, x, w, dy)
    for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
        assert rel(a, r) <= 2 * rel(b, r), name


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
    x, w, _ = inputs(lead, d, torch.float32)
    assert launch.fwd_launch(x.numel() // d, d, 4, x.device)[0]
    for weight in (w, None):
        got = rms_norm(x, weight, EPS, offset, True, torch.float32)
        assert rel(got, rms_norm_reference(x, weight, EPS, offset, True, torch.float32)) < 1e-5


def test_chunked_forward_on_wide_rows():
    """Rows wider than 16K elements whose power-of-two tile would be under 7/8 full, or 64K lanes,
    take the chunked forward (launch.fwd_chunked): 3 rows of 16500 against the reference in fp32
    (< 1e-5) and bf16 (within 2x eager's error against fp64), with and without weight; rows of 16K
    elements and full 32K tiles keep the row forward."""
    from fxfuse.kernels import _rms_norm_launch as launch

    assert launch.fwd_chunked_launch(16500, 2) == launch.fwd_chunked_config(16500, 2) == (4096, 8, 4)
    assert launch.fwd_chunked_launch(65536, 4) == (8192, 16, 4)
    assert launch.fwd_chunked_launch(16384, 2) is None and launch.fwd_chunked_launch(32768, 2) is None
    x, w, dy = inputs((3,), 16500, torch.float32)
    for weight in (w, None):
        got = rms_norm(x, weight, EPS, 0.0, True, torch.float32)
        assert rel(got, rms_norm_reference(x, weight, EPS, 0.0, True, torch.float32)) < 1e-5
    xb, wb, dyb = (t.to(torch.bfloat16) for t in (x, w, dy))
    ref, got, base = fp64_grads(llama_eager, xb, wb, dyb), grads(llama_op, xb, wb, dyb), grads(llama_eager, xb, wb, dyb)
    assert rel(got[0], ref[0]) <= 2 * rel(base[0], ref[0])


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
    x, w, dy = inputs(lead, d, torch.float32, w_center)
    assert rel(op(x, w), fp64_grads(eager, x, w, dy)[0]) < 1e-5
    offset = 1.0 if style == "gemma" else 0.0
    cast = style == "llama"
    for weight in (w, None):
        got = rms_norm(x, weight, EPS, offset, cast, torch.float32)
        assert rel(got, rms_norm_reference(x, weight, EPS, offset, cast, torch.float32)) < 1e-5
    xb, wb, dyb = (t.to(torch.bfloat16) for t in (x, w, dy))
    assert rel(op(xb, wb), fp64_grads(eager, xb, wb, dyb)[0]) <= 2 * rel(eager(xb, wb), fp64_grads(eager, xb, wb, dyb)[0])
    for xd, out in ((x.half(), torch.float16), (xb, torch.float32)):
        got = rms_norm(xd, w.to(xd.dtype), EPS, offset, cast, out)
        want = rms_norm_reference(xd, w.to(xd.dtype), EPS, offset, cast, out)
        assert got.dtype == out and rel(got, want) <= 2 ** -8


@pytest.mark.parametrize("lead,d", [((600,), 40), ((199,), 1000), ((2, 150), 24)])
@pytest.mark.parametrize("block_p", [1, 2])
def test_dw_reduction_loops_over_partials(launch_patch, lead, d, block_p):
    """dw summed over the [P, D] partials in several [BLOCK_P, BLOCK_D] steps and a ragged last
    column block (on CPU P <= 32 partials fit one step unless forced smaller)."""
    from fxfuse.kernels import _rms_norm_launch as launch

    launch_patch("dw_block_p", lambda p, bd: block_p)
    launch_patch("dw_block_d", lambda d, p: 16)
    x, w, dy = inputs(lead, d, torch.float32)
    grid = launch.bwd_launch(x.numel() // d, d, 4, x.device)[0]
    assert grid > block_p
    _, dx, dw = grads(llama_op, x, w, dy)
    ref = fp64_grads(llama_eager, x, w, dy)
    assert rel(dx, ref[1]) < 1e-5 and rel(dw, ref[2]) < 1e-5


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
    x, w, dy = inputs((5,), 16500, torch.float32)
    ref = fp64_grads(llama_eager, x, w, dy)
    _, dx, dw = grads(llama_op, x, w, dy)
    assert rel(dx, ref[1]) < 1e-5 and rel(dw, ref[2]) < 1e-5
    xd = x.double().requires_grad_()
    (ref_dx,) = torch.autograd.grad(rms_norm_reference(xd, None, EPS, 0.0, True, torch.float64), xd, dy.double())
    assert rel(grads(lambda x, w: rms_norm(x, None, EPS, 0.0, True, torch.float32), x, None, dy)[1], ref_dx) < 1e-5


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
    x, w, dy = inputs(lead, d, torch.float32, w_center)
    ref = fp64_grads(eager, x, w, dy)
    _, dx, dw = grads(op, x, w, dy)
    assert rel(dx, ref[1]) < 1e-5 and rel(dw, ref[2]) < 1e-5
    _, dx_frozen, _ = grads(lambda x, w_: op(x, w), x, None, dy)  # weight a constant: dx only
    assert rel(dx_frozen, ref[1]) < 1e-5
    xb, wb, dyb = (t.to(torch.bfloat16) for t in (x, w, dy))
    ref, got, base = fp64_grads(eager, xb, wb, dyb), grads(op, xb, wb, dyb), grads(eager, xb, wb, dyb)
    for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
        assert rel(a, r) <= 2 * rel(b, r), name


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
    base, w, dy = inputs((37,), 56, torch.float32)
    w, dy = w[:40].contiguous(), dy[:, :40].contiguous()
    ref = fp64_grads(llama_eager, base[:, :40], w, dy)
    base = base.clone().requires_grad_()
    w = w.clone().requires_grad_()
    x = base[:, :40]
    assert x.stride(0) == 56
    y = llama_op(x, w)
    y.backward(dy)
    for a, r in zip((y, base.grad[:, :40], w.grad), ref):
        assert rel(a, r) < 1e-5
    assert not base.grad[:, 40:].any()


def test_independent_sums_on_8k_rows():
    """Rows of 8K lanes take both backward row sums from the loaded row (launch.bwd_independent_sums),
    4K-lane rows keep the dependent sums: 5 rows of 6000 (8K lanes, the row kernel, not the split
    backward), fp32 grads within 1e-5 of fp64 eager."""
    from fxfuse.kernels import _rms_norm_launch as launch

    assert launch.bwd_independent_sums(8192) and not launch.bwd_independent_sums(4096)
    assert launch.bwd_split_launch(5, 6000, 4, torch.device("cpu")) is None
    x, w, dy = inputs((5,), 6000, torch.float32)
    got, ref = grads(llama_op, x, w, dy), fp64_grads(llama_eager, x, w, dy)
    for a, r in zip(got, ref):
        assert rel(a, r) < 1e-5


@pytest.mark.parametrize("independent", [True, False], ids=["independent", "dependent"])
@pytest.mark.parametrize("lead,d", [((600,), 40), ((199,), 1000), ((1,), 64), ((3, 5), 96)])
@pytest.mark.parametrize("style", ["llama", "gemma"])
def test_row_backward_sums_any_width(launch_patch, independent, lead, d, style):
    """Both forms of the row backward's sums forced onto narrow, ragged rows (several rows per tile,
    one row): fp32 grads within 1e-5 of fp64 eager with and without weight, bf16 within 2x eager's
    error, and numerics="eager" rounding within one bf16 unit of eager's."""
    from fxfuse.kernels import _rms_norm_launch as launch

    launch_patch("bwd_independent_sums", lambda bn: independent)
    assert launch.bwd_independent_sums(launch.block_n(d)) is independent
    eager, op, w_center = (llama_eager, llama_op, 1.0) if style == "llama" else (gemma_eager, gemma_op, 0.0)
    x, w, dy = inputs(lead, d, torch.float32, w_center)
    for a, r in zip(grads(op, x, w, dy), fp64_grads(eager, x, w, dy)):
        assert rel(a, r) < 1e-5
    no_weight = grads(lambda x, w: rms_norm(x, None, EPS, 0.0, True, torch.float32), x, None, dy)
    ref = grads(lambda x, w: rms_norm_reference(x, None, EPS, 0.0, True, torch.float32), x.double(), None, dy.double())
    assert rel(no_weight[1], ref[1]) < 1e-5
    xb, wb, dyb = (t.to(torch.bfloat16) for t in (x, w, dy))
    ref, got, base = fp64_grads(eager, xb, wb, dyb), grads(op, xb, wb, dyb), grads(eager, xb, wb, dyb)
    for name, a, b, r in zip(("y", "dx", "dw"), got, base, ref):
        assert rel(a, r) <= 2 * rel(b, r), name
    if style == "llama":
        xe, we = xb.clone().requires_grad_(), wb.clone().requires_grad_()
        want = torch.autograd.grad(llama_eager(xe, we), (xe, we), dyb)
        have = torch.autograd.grad(rms_norm(xe, we, EPS, 0.0, True, torch.bfloat16, True), (xe, we), dyb)
        for a, r in zip(have, want):
            assert ((a.double() - r.double()).abs() <= 2.0 ** -7 * r.double().abs()).all()


@pytest.mark.parametrize("m,tail_k", [(10, [2, 4]), (11, [4])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_tail_split_matches_the_shipped_kernels(m, tail_k, dtype):
    """bench/probe_rms_tail.py's split kernels (the loop stops at the last whole wave of rows; the
    last M % SMs rows are shared column-wise by the other programs) give the shipped kernels' y and
    dx bit for bit and dw to fp32 summation order (on CPU num_sms is 4: 10 rows leave 2, 11 leave 3)."""
    from tests.helpers import load_script

    probe = load_script("bench", "probe_rms_tail")
    _, bad = probe.split_cases(m, 8192, dtype, "cpu", tail_k)
    assert bad == []


@pytest.mark.parametrize("device,hip,capability,expect", [
    ("cpu", None, None, False), ("cuda", None, (9, 0), True), ("cuda", None, (10, 0), True),
    ("cuda", None, (8, 9), False), ("cuda", "6.2", (9, 4), False)], ids=["cpu", "sm90", "sm100", "sm89", "rocm"])
def test_dw_pdl_only_where_griddepcontrol_exists(monkeypatch, device, hip, capability, expect):
    """The dw reduction is a programmatic dependent launch on NVIDIA sm_90+ only: not on CPU (the
    interpreter), older cards, or ROCm, whose MI300 reports capability 9.4."""
    from fxfuse.kernels import _rms_norm_launch as launch

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability)
    assert launch.dw_pdl.__wrapped__(torch.device(device)) is expect
