"""Tests of fxfuse.linear_cross_entropy, both algorithms ("fast": 3 matmuls, gradients in the
forward; "lean": 4 matmuls): the Triton path under the interpreter (CPU), forced into many small
row passes and vocab chunks, against eager linear + F.cross_entropy, in fp32; the low-precision
numerics are in test_kernel_linear_cross_entropy_numerics.py, shared pieces in lce_cases.py."""
import pytest
import torch

import fxfuse.kernels._lce_chunks as lce_chunks
import fxfuse.kernels.linear_cross_entropy as lce
import fxfuse.kernels.linear_cross_entropy_fast as lcef
from helpers import load_script
from lce_cases import ALGOS, EAGER, FAST, OP, fwd_bwd, inputs, op_with, rel, small_chunks  # noqa: F401

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)


CASES = [
    # n, h, v, bias, ignore_index, reduction, label_smoothing, softcap, logit_scale
    (37, 24, 211, False, -100, "mean", 0.0, 0.0, 1.0),
    (37, 24, 211, True, -1, "sum", 0.0, 0.0, 1.0),
    (37, 24, 211, False, -100, "mean", 0.1, 0.0, 1.0),
    (37, 24, 211, True, -100, "sum", 0.2, 0.0, 1.0),
    (37, 24, 211, False, -100, "mean", 0.0, 3.0, 1.0),
    (37, 24, 211, True, -1, "mean", 0.1, 5.0, 0.5),
    (1, 24, 211, False, -100, "mean", 0.0, 0.0, 2.0),
    (20, 40, 64, True, 3, "mean", 0.1, 0.0, 1.0),
    (199, 24, 300, True, -100, "mean", 0.1, 4.0, 1.5),
]


# rows per program of the row kernels: the interpreter's choice (a pass's 16 rows in one program),
# the GPU's 1, or 4 (a ragged last program: passes of 16 rows, then N % 16 = 5 or 7). The GPU's 1
# skips the 199-row case: 199 one-row programs per pass under the interpreter cost ~30 s of CI.
PARITY = [(rpp, *c) for rpp in (None, 4) for c in CASES] + [(1, *c) for c in CASES if c[0] < 199]


@pytest.mark.parametrize("rows_per_program,n,h,v,bias,ii,red,ls,cap,scale", PARITY,
                         ids=[f"r{p[0]}-n{p[1]}-{i}" for i, p in enumerate(PARITY)])
def test_fp32_parity(monkeypatch, rows_per_program, n, h, v, bias, ii, red, ls, cap, scale):
    """fast, lean and eager agree to fp32 rounding (loss, dx, dW, db)."""
    monkeypatch.setattr(lce_chunks, "_ROWS_PER_PROGRAM_OVERRIDE", rows_per_program)
    x, w, b, t = inputs(n, h, v, torch.float32, bias, ii, logit_std=3.0)
    if n == 1:
        t[0] = 5
    args = (ii, red, ls, cap, scale)
    fast = fwd_bwd(op_with("fast"), x, w, b, t, *args)
    lean = fwd_bwd(op_with("lean"), x, w, b, t, *args)
    ref = fwd_bwd(EAGER, x, w, b, t, *args)
    assert fast[0].dtype == torch.float32 and fast[0].dim() == 0
    for f, g, r in zip(fast, lean, ref):
        assert f.dtype == g.dtype == r.dtype and f.shape == g.shape == r.shape
        assert rel(f, r) < 1e-5 and rel(g, r) < 1e-5 and rel(f, g) < 1e-5


@pytest.mark.parametrize("algo", ALGOS)
def test_199_rows_reference_path(monkeypatch, algo):
    """The PyTorch chunked fallback (no interpreter) on 199 rows, wider chunks (fast: 4 passes)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", (50, 64, 192))
    x, w, b, t = inputs(199, 24, 211, torch.float32, True, logit_std=3.0)
    args = (-100, "mean", 0.1, 4.0, 1.5)
    for g, r in zip(fwd_bwd(op_with(algo), x, w, b, t, *args), fwd_bwd(EAGER, x, w, b, t, *args)):
        assert rel(g, r) < 1e-5


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("red", ["mean", "sum"])
def test_all_ignored(red, algo):
    x, w, b, t = inputs(20, 24, 211, torch.float32, True)
    t.fill_(-100)
    got = fwd_bwd(op_with(algo), x, w, b, t, -100, red, 0.1, 0.0, 1.0)
    ref = fwd_bwd(EAGER, x, w, b, t, -100, red, 0.1, 0.0, 1.0)
    assert torch.isnan(ref[0]) == (red == "mean")
    torch.testing.assert_close(got[0], ref[0], equal_nan=True)
    for g, r in zip(got[1:], ref[1:]):
        assert torch.equal(r, torch.zeros_like(r)) and torch.equal(g, r)



@pytest.mark.parametrize("algo", ALGOS)
def test_all_ignored_over_its_own_count_gives_zero_gradients(algo):
    """An all-ignored micro-batch normalised by its own token count: loss = CE(sum) / 0 = nan, and
    eager's gradients are zeros. The fast algorithm scaled its gradients (made for an upstream
    gradient of 1) by the real one, inf: 0 * inf = nan in every entry of dx and dW."""
    x, w, b, t = inputs(20, 24, 211, torch.float32, True)
    t.fill_(-100)

    def over_count(op):
        return lambda x, w, b, t, *args: op(x, w, b, t, *args) / (t != -100).sum()

    got = fwd_bwd(over_count(op_with(algo)), x, w, b, t, -100, "sum", 0.0, 0.0, 1.0)
    ref = fwd_bwd(over_count(EAGER), x, w, b, t, -100, "sum", 0.0, 0.0, 1.0)
    assert torch.isnan(ref[0]) and torch.isnan(got[0])
    for g, r in zip(got[1:], ref[1:]):
        assert torch.equal(r, torch.zeros_like(r)) and torch.equal(g, r)


@pytest.mark.parametrize("algo", ALGOS)
def test_strided_bias_and_empty_batch(algo):
    """A bias that is a strided view (bias[::2] of a wider buffer) was read as its buffer's first V
    elements by the lean kernels; an empty batch (N = 0) left the lean dW uninitialised."""
    x, w, b, t = inputs(20, 24, 211, torch.float32, True)
    wide = torch.randn(2 * 211, generator=torch.Generator().manual_seed(3))
    got = fwd_bwd(lambda x, w, b, t, *a: op_with(algo)(x, w, b[::2], t, *a), x, w, wide, t, -100, "mean", 0.0, 0.0, 1.0)
    ref = fwd_bwd(lambda x, w, b, t, *a: EAGER(x, w, b[::2], t, *a), x, w, wide, t, -100, "mean", 0.0, 0.0, 1.0)
    for g, r in zip(got, ref):
        assert rel(g, r) < 1e-5
    got = fwd_bwd(op_with(algo), x[:0], w, b, t[:0], -100, "sum", 0.0, 0.0, 1.0)
    assert got[0].item() == 0.0 and all(torch.equal(g, torch.zeros_like(g)) for g in got[1:])

@pytest.mark.parametrize("n", [1, 8, 128, 1000])
@pytest.mark.parametrize("ii", [-100, 0, -1])
@pytest.mark.parametrize("red", ["mean", "sum"])
@pytest.mark.parametrize("ignored", [False, True])
def test_rows_reduced_like_eager(n, ii, red, ignored):
    """Both algorithms' row losses are summed in F.cross_entropy's own order, so given eager's rows the
    loss is eager's to the bit on any CPU (rows.sum() follows the vector width: on an AVX2 machine it
    differed from eager in the last bit at n = 8 and 128 with no row ignored); ignore_index 0 and an
    all-ignored batch (n = 1, every third row ignored) included."""
    g = torch.Generator().manual_seed(n)
    z = torch.randn(n, 512, generator=g)
    t = torch.randint(0, 512, (n,), generator=g)
    if ignored:
        t[::3] = ii
    else:
        t[t == ii] = 5
    rows = torch.nn.functional.cross_entropy(z, t, ignore_index=ii, reduction="none")
    got = lce._reduce_like_eager(rows, t, ii, red)
    ref = torch.nn.functional.cross_entropy(z, t, ignore_index=ii, reduction=red)
    torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)  # n = 1: all ignored, nan


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("frozen", ["w", "x"])
def test_frozen_input(algo, frozen):
    """Only the inputs that require grad get one (the fast op forms only those)."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    xs, ws = x.clone().requires_grad_(frozen != "x"), w.clone().requires_grad_(frozen != "w")
    bs = b.clone().requires_grad_()
    got = torch.autograd.grad(OP(xs, ws, bs, t, -100, "mean", 0.1, 0.0, 1.0, algo),
                              [p for p in (xs, ws, bs) if p.requires_grad])
    ref = torch.autograd.grad(EAGER(xs, ws, bs, t, -100, "mean", 0.1, 0.0, 1.0),
                              [p for p in (xs, ws, bs) if p.requires_grad])
    assert len(got) == 2
    for g, r in zip(got, ref):
        assert rel(g, r) < 1e-5


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("ls,cap", [(0.0, 0.0), (0.1, 5.0)], ids=["plain", "smoothed_softcap"])
def test_reduction_none_rows_and_their_gradients(algo, ls, cap):
    """reduction "none": [N] fp32 row losses, 0 on ignored rows, as eager's; a per-row upstream
    gradient (a weighted SFT loss) reaches x, W and b through the lean backward, whichever algorithm
    is asked for (the fast one forms gradients for one scalar loss)."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True, logit_std=3.0)
    args = (-100, "none", ls, cap, 1.0)
    rows, ref = OP(x, w, b, t, *args, algo), EAGER(x, w, b, t, *args)
    assert rows.shape == (37,) and rows.dtype == torch.float32 and rel(rows, ref) < 1e-5
    assert (t == -100).any() and rows[t == -100].abs().max() == 0
    weights = torch.rand(37, generator=torch.Generator().manual_seed(1))
    got = fwd_bwd(lambda *a: (OP(*a, algo) * weights).sum(), x, w, b, t, *args)
    want = fwd_bwd(lambda *a: (EAGER(*a) * weights).sum(), x, w, b, t, *args)
    for name, g, e in zip(["loss", "dx", "dw", "db"], got, want):
        assert rel(g, e) < 1e-5, name


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("red", ["mean", "sum", "none"])
@pytest.mark.parametrize("bad", [211, 5000, -1, -7])
def test_out_of_range_target_gives_nan_not_a_wrong_loss(algo, red, bad):
    """A target outside [0, V) that is not ignore_index: eager raises; the ops cannot without a host
    sync, and their kernels clamp it to a class, which alone would give a finite, wrong loss. The
    loss and every gradient are nan instead; under "none" the other rows stay exact."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    t[5] = bad
    args = (-100, red, 0.1, 0.0, 1.0)
    with pytest.raises((IndexError, RuntimeError)):
        EAGER(x, w, b, t, *args)
    fused = op_with(algo)
    loss, *grads = fwd_bwd(lambda *a: fused(*a).sum(), x, w, b, t, *args)
    assert torch.isnan(loss) and all(torch.isnan(g).any() for g in grads)
    assert torch.isnan(grads[1]).all()  # dW: every class's gradient sums the bad row's
    if red == "none":
        rows, ok = fused(x, w, b, t, *args), torch.arange(37) != 5
        assert torch.isnan(rows[5]) and rel(rows[ok], EAGER(x[ok], w, b, t[ok], *args)) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algo", ALGOS)
def test_out_of_range_target_on_cuda_is_nan_without_a_host_sync(algo):
    """The compiled kernels on a bad target (eager's CUDA kernel asserts on the device): nan loss and
    gradients, no illegal access (the kernels clamp it), and no host sync in forward or backward."""
    x, w, b, t = (v.cuda() for v in inputs(37, 24, 211, torch.bfloat16, True))
    t[5] = 211
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = op_with(algo)(xs, ws, b, t, -100, "mean", 0.1, 0.0, 1.0)
        dx, dw = torch.autograd.grad(loss, (xs, ws))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isnan(loss) and torch.isnan(dx).any() and torch.isnan(dw).all()


def test_bwd_skips_unneeded_grads():
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    rows, lse = torch.ops.fxfuse.linear_cross_entropy_fwd(x, w, b, t, -100, 0.0, 0.0, 1.0, False, False)
    dx, dw, db, ds = torch.ops.fxfuse.linear_cross_entropy_bwd(
        torch.ones_like(rows), x, w, b, t, lse, -100, 0.0, 0.0, 1.0, False, False, True, False, False)
    assert dx.shape == x.shape and dw.numel() == 0 and db.numel() == 0 and ds.numel() == 0
    x.requires_grad_()
    EAGER(x, w, b, t, -100, "sum").backward()
    assert rel(dx, x.grad) < 1e-5


def test_fast_op_skips_unneeded_grads():
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    loss, dx, dw, db, ds = FAST(x, w, b, t, -100, "sum", 0.0, 0.0, 1.0, False, False, False, True, False)
    assert dx.numel() == 0 and dw.shape == w.shape and db.numel() == 0 and ds.numel() == 0
    w.requires_grad_()
    ref = EAGER(x, w, b, t, -100, "sum")
    ref.backward()
    assert rel(loss, ref) < 1e-5 and rel(dw, w.grad) < 1e-5
def test_rejects_bad_reduction_and_algorithm():
    x, w, b, t = inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="reduction"):
        OP(x, w, b, t, -100, "batchmean", 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="algorithm"):
        OP(x, w, b, t, -100, "mean", 0.0, 0.0, 1.0, "fastest")


def test_never_allocates_n_by_v(monkeypatch):
    """lean: every logits chunk is at most rows x cols of the plan, in the forward and the backward."""
    shapes = []
    raw = lce._raw_logits

    def spy(*args):
        z, bias = raw(*args)
        shapes.append(tuple(z.shape))
        return z, bias

    monkeypatch.setattr(lce, "_raw_logits", spy)
    for dtype, rounding in ((torch.float32, False), (torch.bfloat16, True)):  # fp32 sums / eager's matmul
        shapes.clear()
        x, w, b, t = inputs(37, 24, 211, dtype, True)
        fwd_bwd(OP, x, w, b, t, -100, "mean", 0.0, 0.0, 1.0, "lean", rounding)
        assert len(shapes) == 2 * 3 * 4 and all(r <= 16 and c <= 64 for r, c in shapes)


def _spy_fast_rows(monkeypatch):
    """Shapes of the logits blocks the fast path's row kernel sees, one per pass."""
    shapes = []
    rows = lcef._fast_rows

    def spy(z, *args):
        shapes.append(tuple(z.shape))
        rows(z, *args)

    monkeypatch.setattr(lcef, "_fast_rows", spy)
    return shapes


def test_fast_passes(monkeypatch):
    """fast with a gradient: 3 passes of [<= 16, V] blocks, all in the forward."""
    shapes = _spy_fast_rows(monkeypatch)
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    x.requires_grad_()
    loss = OP(x, w, b, t, -100, "mean", 0.0, 0.0, 1.0, "fast")
    assert shapes == [(16, 211), (16, 211), (5, 211)]
    loss.backward()
    assert len(shapes) == 3


@pytest.mark.parametrize("algo", ["fast", "lean"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_requires_grad", "compiled_no_grad"])
def test_forward_only_forms_no_gradient(monkeypatch, algo, mode):
    """Eval forwards run the lean lse-only forward: the fast op (gradients) never runs."""
    shapes = _spy_fast_rows(monkeypatch)
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    args = (-100, "mean", 0.1, 0.0, 1.0, algo)
    ref = EAGER(x, w, b, t, *args[:-1])
    if mode == "no_requires_grad":
        got = OP(x, w, b, t, *args)
    else:
        x, w = x.requires_grad_(), w.requires_grad_()
        fn = torch.compile(OP, backend="aot_eager", fullgraph=True) if mode == "compiled_no_grad" else OP
        with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
            got = fn(x, w, b, t, *args)
    assert shapes == [] and not got.requires_grad and rel(got, ref) < 1e-5


def test_upstream_grad_scales_and_retain_graph():
    """Backward scales the forward's gradients by the 0-dim upstream gradient, out of place:
    a second backward (retain_graph) gives the same; double backward raises."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    loss = OP(x, w, b, t, -100, "mean", 0.1, 3.0, 1.0, "fast")
    ref = EAGER(x, w, b, t, -100, "mean", 0.1, 3.0, 1.0)
    want = torch.autograd.grad(ref * -2.5, (x, w, b))
    for _ in range(2):
        got = torch.autograd.grad(loss * -2.5, (x, w, b), retain_graph=True)
        for g, r in zip(got, want):
            assert rel(g, r) < 1e-5
    (dx,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="linear_cross_entropy_fast"):
        dx.sum().backward()


def test_chunk_plan_budgets(monkeypatch):
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", None)
    # fast: at most 8 passes, a logits block of at least 64 MiB, never more rows than tokens
    assert lcef._fast_rows_per_pass(8192, 128256, 2) == 1024  # 250.5 MiB block
    assert lcef._fast_rows_per_pass(2048, 128256, 2) == 262  # 64 MiB block, 8 passes
    assert lcef._fast_rows_per_pass(100_000, 128256, 2) == 12500
    assert lcef._fast_rows_per_pass(199, 211, 4) == 199 and lcef._fast_tile(128256) == 4096
    assert lcef._fast_tile(211) == 256
    rows, cols = lce._rows_per_pass(8192, 4096), lce._cols_per_chunk(4096, 128256)
    group = lce._cols_per_group(rows, cols, 128256, 2)
    assert (rows, cols, group) == (4096, 1024, 3072)
    assert rows * 4096 * 4 <= 64 << 20 and rows * cols * 4 <= 16 << 20 and rows * group * 2 <= 24 << 20
    assert lce._rows_per_pass(37, 24) == 37 and lce._cols_per_chunk(37, 211) == 211
    assert lce._cols_per_group(37, 211, 211, 4) == 211


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(bias):
    x, w, b, t = inputs(37, 24, 211, torch.float32, bias)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.fxfuse.linear_cross_entropy_fwd, (x, w, b, t, -100, 0.1, 2.0, 1.0, False, False))
    rows, lse = torch.ops.fxfuse.linear_cross_entropy_fwd(x, w, b, t, -100, 0.1, 2.0, 1.0, False, False)
    torch.library.opcheck(torch.ops.fxfuse.linear_cross_entropy_bwd,
                          (torch.rand_like(rows), x.detach(), w.detach(), b, t, lse.detach(), -100, 0.1,
                           2.0, 1.0, False, False, True, True, bias))


@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_opcheck_column_major_inputs(monkeypatch, on_triton):
    """x [N, H] and weight [V, H] stored column-major: dx and dW come back contiguous, as the fake
    says (opcheck compares strides; Inductor asserts them)."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    x, w = (a.t().contiguous().t() for a in (x, w))
    rows, lse = torch.ops.fxfuse.linear_cross_entropy_fwd(x, w, b, t, -100, 0.0, 0.0, 1.0, False, False)
    torch.library.opcheck(torch.ops.fxfuse.linear_cross_entropy_bwd,
                          (torch.rand_like(rows), x, w, b, t, lse, -100, 0.0, 0.0, 1.0, False, False, True, True, True))


@pytest.mark.parametrize("bias,red", [(False, "mean"), (True, "sum")])
def test_opcheck_fast(bias, red):
    x, w, b, t = inputs(37, 24, 211, torch.float32, bias)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(FAST, (x, w, b, t, -100, red, 0.1, 2.0, 1.0, False, False, True, True, bias))
    t7 = t.masked_fill(t == -100, 7)  # ignore_index 7: a -100 left would be out of range (nan)
    torch.library.opcheck(FAST, (x, w, b, t7, 7, red, 0.0, 0.0, 0.5, True, True, False, True, False))


@pytest.mark.parametrize("algo", ALGOS)
def test_compile_axis(algo):
    """aot_eager with dynamic shapes: one graph serves two token counts, matching eager."""
    fn = torch.compile(op_with(algo), backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (13, 29):
        x, w, b, t = inputs(n, 24, 211, torch.float32, True, seed=n)
        args = (-100, "mean", 0.1, 0.0, 1.0)
        for g, r in zip(fwd_bwd(fn, x, w, b, t, *args), fwd_bwd(EAGER, x, w, b, t, *args)):
            assert rel(g, r) < 1e-5


def test_compile_inductor_fast():
    """Inductor (min-cut partitioner): the fast op's gradients are saved, backward only scales."""
    fn = torch.compile(OP, backend="inductor", fullgraph=True)
    x, w, b, t = inputs(29, 24, 211, torch.float32, True)
    args = (-100, "sum", 0.0, 3.0, 1.0)
    for g, r in zip(fwd_bwd(fn, x, w, b, t, *args), fwd_bwd(EAGER, x, w, b, t, *args)):
        assert rel(g, r) < 1e-5


def test_bench_counts(monkeypatch):
    """The benchmark imports on CPU; its byte and FLOP counts match hand counts at the target shape."""
    bench = load_script("bench", "bench_linear_cross_entropy")
    n, h, v = 8192, 4096, 128256
    assert bench.lce_bytes(n, h, v, 2) == 2 * 2 * (n * h + v * h) + 8 * n
    assert bench.lce_flops(n, h, v) == 3 * 2 * n * h * v
    assert round(bench.floor_mib(n, h, v, 2)) == 1066
    assert {"fxfuse", "fxfuse-fast", "matmuls", "matmuls-passes"} <= set(bench.LCE_PROVIDERS)
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", None)  # this file's fixture forces small chunks
    assert bench._fast_rows(n, v, 2) == 1024  # the fast algorithm's own pass size at the target shape
    bench._matmul_step(torch.randn(10, 8), torch.randn(30, 8), 4)()  # the floor's three matmuls, 3 passes


@pytest.mark.parametrize("frozen", [False, True], ids=["trained_scale", "frozen_scale"])
def test_bench_vocab_scale_case_is_fused_and_agrees_with_eager(frozen):
    """--vocab-scale (Dory's head) on CPU: fxfuse-compiled fuses it, and it and the bare op (its
    vocab_scale) give the loss and gradients, the scale's included unless --frozen-scale, of the
    eager definition the benchmark times."""
    import argparse

    bench = load_script("bench", "bench_linear_cross_entropy")
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    args = parser.parse_args(["--vocab-scale", "--bias"] + (["--frozen-scale"] if frozen else []))
    torch._dynamo.reset()
    compiled, note = bench._provider_fn("fxfuse-compiled-lean", args)
    assert note == "loss head fused 1x, 0 unmatched", note
    eager, _ = bench._provider_fn("eager", args)
    assert bench._provider_fn("liger", args)[0] is None
    x, w, b, t, s = bench._inputs(40, 16, 70, torch.float32, args, device="cpu")
    ref = bench._fwd_bwd(eager, x, w, b, t, s)
    assert s.requires_grad is not frozen and len(ref) == 5 - frozen  # loss, dx, dW, db (, ds)
    for fused in (compiled, bench._provider_fn("fxfuse", args)[0], bench._provider_fn("fxfuse-fast", args)[0]):
        for g, r in zip(bench._fwd_bwd(fused, x, w, b, t, s), ref, strict=True):
            assert rel(g, r) < 1e-5
