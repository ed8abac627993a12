"""Tests of fxfuse.linear_cross_entropy: the Triton path under the interpreter (CPU), forced into
many small row passes and vocab chunks, against eager linear + F.cross_entropy.
FXFUSE_TEST_DEVICE=cuda (as tests/conftest.py) leaves the interpreter off for the gpu test."""
import os

if os.environ.get("FXFUSE_TEST_DEVICE", "cpu") != "cuda":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxfuse.kernels.linear_cross_entropy as lce  # noqa: E402

OP = torch.ops.fxfuse.linear_cross_entropy


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """16-row passes x 64-column logits chunks x 128-column gradient groups: N=37, V=211 runs
    3 passes x 4 chunks in 2 groups (the last pass, chunk and group ragged)."""
    monkeypatch.setattr(lce, "_CHUNK_OVERRIDE", (16, 64, 128))


def _inputs(n, h, v, dtype, bias=False, ignore_index=-100, logit_std=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(v, h, generator=g) * logit_std / h**0.5).to(dtype)
    b = torch.randn(v, generator=g).to(dtype) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.2] = ignore_index
    return x, w, b, t


def _fwd_bwd(fn, x, w, b, t, *args, frozen_w=False):
    """[loss, dx, (dW), (db)] on fresh leaf copies of x, w, b."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_(not frozen_w)
    b = b.detach().clone().requires_grad_() if b is not None else None
    wrt = [p for p in (x, w, b) if p is not None and p.requires_grad]
    loss = fn(x, w, b, t, *args)
    return [loss, *torch.autograd.grad(loss, wrt)]


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


EAGER = lce.linear_cross_entropy_eager

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
]


@pytest.mark.parametrize("n,h,v,bias,ii,red,ls,cap,scale", CASES)
def test_fp32_parity(n, h, v, bias, ii, red, ls, cap, scale):
    x, w, b, t = _inputs(n, h, v, torch.float32, bias, ii, logit_std=3.0)
    if n == 1:
        t[0] = 5
    args = (ii, red, ls, cap, scale)
    got = _fwd_bwd(OP, x, w, b, t, *args)
    ref = _fwd_bwd(EAGER, x, w, b, t, *args)
    assert got[0].dtype == torch.float32 and got[0].dim() == 0
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert _rel(g, r) < 1e-5


def test_199_rows_reference_path(monkeypatch):
    """The PyTorch chunked fallback (no interpreter) on 199 rows, wider chunks."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(lce, "_CHUNK_OVERRIDE", (50, 64, 192))
    x, w, b, t = _inputs(199, 24, 211, torch.float32, True, logit_std=3.0)
    args = (-100, "mean", 0.1, 4.0, 1.5)
    for g, r in zip(_fwd_bwd(OP, x, w, b, t, *args), _fwd_bwd(EAGER, x, w, b, t, *args)):
        assert _rel(g, r) < 1e-5


@pytest.mark.parametrize("red", ["mean", "sum"])
def test_all_ignored(red):
    x, w, b, t = _inputs(20, 24, 211, torch.float32, True)
    t.fill_(-100)
    got = _fwd_bwd(OP, x, w, b, t, -100, red, 0.1, 0.0, 1.0)
    ref = _fwd_bwd(EAGER, x, w, b, t, -100, red, 0.1, 0.0, 1.0)
    assert torch.isnan(ref[0]) == (red == "mean")
    torch.testing.assert_close(got[0], ref[0], equal_nan=True)
    for g, r in zip(got[1:], ref[1:]):
        assert torch.equal(r, torch.zeros_like(r)) and torch.equal(g, r)


def test_frozen_weight():
    x, w, b, t = _inputs(37, 24, 211, torch.float32)
    got = _fwd_bwd(OP, x, w, b, t, -100, "mean", 0.0, 0.0, 1.0, frozen_w=True)
    ref = _fwd_bwd(EAGER, x, w, b, t, -100, "mean", 0.0, 0.0, 1.0, frozen_w=True)
    assert len(got) == 2
    for g, r in zip(got, ref):
        assert _rel(g, r) < 1e-5


def test_bwd_skips_unneeded_grads():
    x, w, b, t = _inputs(37, 24, 211, torch.float32, True)
    rows, lse = torch.ops.fxfuse.linear_cross_entropy_fwd(x, w, b, t, -100, 0.0, 0.0, 1.0)
    dx, dw, db = torch.ops.fxfuse.linear_cross_entropy_bwd(
        torch.ones_like(rows), x, w, b, t, lse, -100, 0.0, 0.0, 1.0, True, False, False)
    assert dx.shape == x.shape and dw.numel() == 0 and db.numel() == 0
    x.requires_grad_()
    EAGER(x, w, b, t, -100, "sum").backward()
    assert _rel(dx, x.grad) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunks", [(64, 128, 256), (8, 128, 128)], ids=["1pass", "8passes"])
def test_low_precision_vs_fp64(monkeypatch, dtype, chunks):
    """Error of loss and each grad vs an fp64 reference is <= 2x eager's own error in dtype.
    8passes: dW is rounded to dtype after each of 8 row passes (the bf16 accumulation cost)."""
    monkeypatch.setattr(lce, "_CHUNK_OVERRIDE", chunks)
    x, w, b, t = _inputs(64, 64, 300, dtype, True, logit_std=4.0)
    args = (-100, "mean", 0.1, 0.0, 1.0)
    ref = _fwd_bwd(EAGER, x.double(), w.double(), b.double(), t, *args)
    got = _fwd_bwd(OP, x, w, b, t, *args)
    eager = _fwd_bwd(EAGER, x, w, b, t, *args)
    for name, g, e, r in zip(["loss", "dx", "dw", "db"], got, eager, ref):
        assert g.dtype == e.dtype
        assert _rel(g, r) <= 2 * _rel(e, r), name


def test_rejects_bad_reduction():
    x, w, b, t = _inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError):
        OP(x, w, b, t, -100, "none", 0.0, 0.0, 1.0)


def test_never_allocates_n_by_v(monkeypatch):
    """Every logits chunk is at most rows x cols of the plan, in the forward and the backward."""
    shapes = []
    mm = lce._mm_f32

    def spy(a, b, out):
        mm(a, b, out)
        shapes.append(tuple(out.shape))

    monkeypatch.setattr(lce, "_mm_f32", spy)
    x, w, b, t = _inputs(37, 24, 211, torch.float32)
    _fwd_bwd(OP, x, w, b, t, -100, "mean", 0.0, 0.0, 1.0)
    assert len(shapes) == 2 * 3 * 4 and all(r <= 16 and c <= 64 for r, c in shapes)


def test_chunk_plan_budgets(monkeypatch):
    monkeypatch.setattr(lce, "_CHUNK_OVERRIDE", None)
    rows, cols = lce._rows_per_pass(8192, 4096), lce._cols_per_chunk(4096, 128256)
    group = lce._cols_per_group(rows, cols, 128256, 2)
    assert (rows, cols, group) == (4096, 1024, 3072)
    assert rows * 4096 * 4 <= 64 << 20 and rows * cols * 4 <= 16 << 20 and rows * group * 2 <= 24 << 20
    assert lce._rows_per_pass(37, 24) == 37 and lce._cols_per_chunk(37, 211) == 211
    assert lce._cols_per_group(37, 211, 211, 4) == 211


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(bias):
    x, w, b, t = _inputs(37, 24, 211, torch.float32, bias)
    x.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.fxfuse.linear_cross_entropy_fwd, (x, w, b, t, -100, 0.1, 2.0, 1.0))
    rows, lse = torch.ops.fxfuse.linear_cross_entropy_fwd(x, w, b, t, -100, 0.1, 2.0, 1.0)
    torch.library.opcheck(torch.ops.fxfuse.linear_cross_entropy_bwd,
                          (torch.rand_like(rows), x.detach(), w.detach(), b, t, lse.detach(), -100, 0.1,
                           2.0, 1.0, True, True, bias))


def test_compile_axis():
    """aot_eager with dynamic shapes: one graph serves two token counts, matching eager."""
    fn = torch.compile(OP, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (13, 29):
        x, w, b, t = _inputs(n, 24, 211, torch.float32, True, seed=n)
        args = (-100, "mean", 0.1, 0.0, 1.0)
        for g, r in zip(_fwd_bwd(fn, x, w, b, t, *args), _fwd_bwd(EAGER, x, w, b, t, *args)):
            assert _rel(g, r) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_vs_fp64(monkeypatch):
    """The CUDA path (cuBLAS fp32-output chunks + compiled kernels) at a shape with several passes."""
    monkeypatch.setattr(lce, "_CHUNK_OVERRIDE", (512, 1024, 2048))
    x, w, b, t = (a.cuda() if a is not None else None
                  for a in _inputs(2000, 512, 5000, torch.bfloat16, True, logit_std=4.0))
    args = (-100, "mean", 0.1, 30.0, 1.0)
    ref = _fwd_bwd(EAGER, x.double(), w.double(), b.double(), t, *args)
    got = _fwd_bwd(OP, x, w, b, t, *args)
    eager = _fwd_bwd(EAGER, x, w, b, t, *args)
    for name, g, e, r in zip(["loss", "dx", "dw", "db"], got, eager, ref):
        assert _rel(g, r) <= 2 * _rel(e, r), name


def test_bench_counts():
    """The benchmark imports on CPU; its byte and FLOP counts match hand counts at the target shape."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "bench" / "bench_linear_cross_entropy.py"
    spec = importlib.util.spec_from_file_location("bench_lce", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    n, h, v = 8192, 4096, 128256
    assert bench.lce_bytes(n, h, v, 2) == 2 * 2 * (n * h + v * h) + 8 * n
    assert bench.lce_flops(n, h, v) == 3 * 2 * n * h * v
    assert round(bench.floor_mib(n, h, v, 2)) == 1066
