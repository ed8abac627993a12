"""fxfuse.linear_cross_entropy with a per-vocabulary logit scale (vocab_scale, Dory's learned
``logits.float() * s``): both algorithms' kernels under the interpreter in small passes and chunks
(lce_cases.small_chunks), and the CPU reference path, against eager; the scale's gradient; the op's
checks. The compiled models are in test_linear_cross_entropy_scale.py."""
import pytest
import torch
import torch.nn.functional as F

import fxfuse.kernels._lce_chunks as lce_chunks
from lce_cases import ALGOS, FAST, OP, inputs, rel, small_chunks  # noqa: F401

pytestmark = pytest.mark.interpreter


def eager(x, w, b, t, s, ignore_index=-100, reduction="mean", smoothing=0.0, softcap=0.0):
    """Dory's head (softcap and smoothing too): the lm_head's output in fp32 times s, then cross_entropy."""
    z = F.linear(x, w, b).float() * s
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing)


def fused(algo):
    def fn(x, w, b, t, s, ignore_index=-100, reduction="mean", smoothing=0.0, softcap=0.0):
        return OP(x, w, b, t, ignore_index, reduction, smoothing, softcap, 1.0, algo, False, False, s)
    return fn


def grads(fn, x, w, b, t, s, *args, need=(True, True, True, True)):
    """[loss, then the grads of x, w, b, s that are needed] on fresh leaves."""
    leaves = [p.detach().clone().requires_grad_(r) if p is not None else None for p, r in zip((x, w, b, s), need)]
    loss = fn(*leaves[:3], t, leaves[3], *args)
    return [loss, *torch.autograd.grad(loss, [p for p in leaves if p is not None and p.requires_grad])]


def scale(v, seed=1):
    return torch.rand(v, generator=torch.Generator().manual_seed(seed)) + 0.5


CASES = [  # n, h, v, bias, ignore_index, reduction, label_smoothing, softcap
    (37, 24, 211, False, -100, "mean", 0.0, 0.0),
    (37, 24, 211, True, -1, "sum", 0.1, 0.0),
    (37, 24, 211, True, -100, "mean", 0.1, 5.0),
    (1, 24, 211, False, -100, "mean", 0.0, 3.0),
    (20, 40, 64, True, 3, "mean", 0.0, 0.0),
]


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n,h,v,bias,ii,red,ls,cap", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_fp32_parity(algo, n, h, v, bias, ii, red, ls, cap):
    """Loss, dx, dW, db and the scale's grad equal eager's to fp32 rounding (3 passes x 4 chunks;
    the fast path's column sweep in 4-row x 64-column tiles)."""
    x, w, b, t = inputs(n, h, v, torch.float32, bias, ii, logit_std=3.0)
    if n == 1:
        t[0] = 5
    args = (ii, red, ls, cap)
    got, ref = grads(fused(algo), x, w, b, t, scale(v), *args), grads(eager, x, w, b, t, scale(v), *args)
    assert len(got) == len(ref) == (5 if bias else 4)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape and rel(g, r) < 1e-5


@pytest.mark.parametrize("algo", ALGOS)
def test_gpu_rows_per_program_and_reference_path(monkeypatch, algo):
    """The GPU's one row per program in the row kernels, then the PyTorch reference (no interpreter)."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True, logit_std=3.0)
    args = (-100, "mean", 0.1, 4.0)
    ref = grads(eager, x, w, b, t, scale(211), *args)
    monkeypatch.setattr(lce_chunks, "_ROWS_PER_PROGRAM_OVERRIDE", 1)
    for g, r in zip(grads(fused(algo), x, w, b, t, scale(211), *args), ref):
        assert rel(g, r) < 1e-5
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for g, r in zip(grads(fused(algo), x, w, b, t, scale(211), *args), ref):
        assert rel(g, r) < 1e-5


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("need", [(False, False, False, True), (True, True, True, False), (True, False, True, True)],
                         ids=["scale_only", "frozen_scale", "frozen_w"])
def test_only_needed_grads(algo, need):
    """The scale's grad alone (x, W, b frozen: the fast op still runs), a frozen scale, a frozen W."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    got = grads(fused(algo), x, w, b, t, scale(211), need=need)
    ref = grads(eager, x, w, b, t, scale(211), need=need)
    assert len(got) == len(ref) == 1 + sum(need)
    for g, r in zip(got, ref):
        assert rel(g, r) < 1e-5


@pytest.mark.parametrize("need_s", [False, True], ids=["frozen_scale", "trained_scale"])
def test_fast_column_sweep_only_for_the_scales_grad(monkeypatch, need_s):
    """The fast path's column kernel runs only when the scale's grad is needed (a frozen scale, as
    under LoRA, keeps sweep 2 in the row kernel); both give eager's grads."""
    import fxfuse.kernels.linear_cross_entropy_fast as fast
    launches = []
    kernel = fast._lce_fast_cols_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]
    monkeypatch.setattr(fast, "_lce_fast_cols_kernel", Spy())
    x, w, b, t = inputs(37, 24, 211, torch.float32, True, logit_std=3.0)
    args, need = (-100, "mean", 0.1, 4.0), (True, True, True, need_s)
    got = grads(fused("fast"), x, w, b, t, scale(211), *args, need=need)
    ref = grads(eager, x, w, b, t, scale(211), *args, need=need)
    assert len(launches) == (3 if need_s else 0)  # one per pass (small_chunks: 3 passes)
    assert len(got) == len(ref) == 4 + need_s
    for g, r in zip(got, ref):
        assert rel(g, r) < 1e-5


def test_probe_sub_blocks_match_the_whole_pass(monkeypatch):
    """bench/probe_lce_vscale.py's own check on CPU (so its kernel launches keep up with the kernels'
    signatures): the scaled pass in sub-blocks of rows gives the whole pass's dzr bit for bit and its
    scale grad; the probe asserts both."""
    import argparse

    from helpers import load_script

    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", None)  # the probe sizes its tiles as shipped
    probe = load_script("bench", "probe_lce_vscale")
    probe.fast_pass(argparse.Namespace(rows=40, vocab=300, device="cpu", sub_rows=[8, 16], check=True, tiles=[]))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("red", ["mean", "sum"])
def test_all_ignored(algo, red):
    """An all-ignored batch: eager's loss (nan for "mean", 0 for "sum") and every grad 0, the scale's too."""
    x, w, b, t = inputs(20, 24, 211, torch.float32, True)
    t.fill_(-100)
    got, ref = grads(fused(algo), x, w, b, t, scale(211), -100, red), grads(eager, x, w, b, t, scale(211), -100, red)
    torch.testing.assert_close(got[0], ref[0], equal_nan=True)
    for g, r in zip(got[1:], ref[1:]):
        assert torch.equal(r, torch.zeros_like(r)) and torch.equal(g, r)


def test_fast_upstream_grad_and_retain_graph():
    """The fast op's saved scale grad is scaled by the upstream grad, out of place (twice the same)."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    s = scale(211).requires_grad_()
    loss = fused("fast")(x, w, b, t, s, -100, "mean", 0.1, 3.0)
    (want,) = torch.autograd.grad(eager(x, w, b, t, s, -100, "mean", 0.1, 3.0) * -2.5, s)
    for _ in range(2):
        (got,) = torch.autograd.grad(loss * -2.5, s, retain_graph=True)
        assert rel(got, want) < 1e-5


def test_fast_op_outputs_and_opcheck():
    """The fast op returns the scale's grad only when asked; opcheck on fwd, bwd and fast with a scale."""
    x, w, b, t = inputs(37, 24, 211, torch.float32, True)
    s = scale(211)
    *_, ds = FAST(x, w, b, t, -100, "mean", 0.0, 0.0, 1.0, False, False, False, False, False, s, True)
    s_ = s.clone().requires_grad_()
    (ref,) = torch.autograd.grad(eager(x, w, b, t, s_), s_)
    assert rel(ds, ref) < 1e-5
    assert FAST(x, w, b, t, -100, "mean", 0.0, 0.0, 1.0, False, False, True, False, False, s, False)[4].numel() == 0
    x, w, s = x.requires_grad_(), w.requires_grad_(), s.requires_grad_()
    torch.library.opcheck(FAST, (x, w, b, t, -100, "sum", 0.1, 2.0, 1.0, False, False, True, True, True, s, True))
    fwd, bwd = torch.ops.fxfuse.linear_cross_entropy_fwd, torch.ops.fxfuse.linear_cross_entropy_bwd
    torch.library.opcheck(fwd, (x, w, b, t, -100, 0.1, 2.0, 1.0, False, False, s))
    rows, lse = fwd(x, w, b, t, -100, 0.1, 2.0, 1.0, False, False, s)
    torch.library.opcheck(bwd, (torch.rand_like(rows), x.detach(), w.detach(), b, t, lse.detach(), -100, 0.1, 2.0,
                                1.0, False, False, True, True, True, s.detach(), True))


def test_compiled_dynamic_shapes():
    """aot_eager with dynamic shapes: one graph for two token counts, the scale's grad included."""
    fn = torch.compile(fused("fast"), backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (13, 29):
        x, w, b, t = inputs(n, 24, 211, torch.float32, True, seed=n)
        for g, r in zip(grads(fn, x, w, b, t, scale(211)), grads(eager, x, w, b, t, scale(211))):
            assert rel(g, r) < 1e-5


@pytest.mark.parametrize("algo", ALGOS)
def test_rejects_a_bad_scale(algo):
    x, w, b, t = inputs(4, 8, 16, torch.float32)
    with pytest.raises(ValueError, match=r"vocab_scale must be float32 \[16\]"):
        fused(algo)(x, w, b, t, scale(15))
    with pytest.raises(ValueError, match=r"vocab_scale must be float32 \[16\]"):
        fused(algo)(x, w, b, t, scale(16).bfloat16())
    with pytest.raises(ValueError, match="eager_rounding"):
        OP(x.bfloat16(), w.bfloat16().requires_grad_(), None, t, -100, "mean", 0.0, 0.0, 1.0, algo, True, False,
           scale(16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("need_s", [True, False], ids=["trained_scale", "frozen_scale"])
@pytest.mark.parametrize("algo", ALGOS)
def test_gpu_bf16_vs_fp64(monkeypatch, algo, need_s):
    """The CUDA path (cuBLAS matmuls, compiled row and column kernels) in bf16 at a shape with several
    passes, softcap and smoothing: every output, the scale's grad included, no further from an fp64
    run than 2x eager bf16's own distance; fast's loss, dx and ds within 1.1x (eager's bf16 logits).
    A frozen scale: fast's sweep 2 in the row kernel, the same bounds."""
    monkeypatch.setattr(lce_chunks, "_CHUNK_OVERRIDE", (512, 1024, 2048))
    x, w, b, t = (a.cuda() if a is not None else None
                  for a in inputs(2000, 512, 5000, torch.bfloat16, True, logit_std=4.0))
    s, args = scale(5000).cuda(), (-100, "mean", 0.1, 30.0)
    need = (True, True, True, need_s)
    ref = grads(eager, x.double(), w.double(), b.double(), t, s.double(), *args, need=need)
    got, base = grads(fused(algo), x, w, b, t, s, *args, need=need), grads(eager, x, w, b, t, s, *args, need=need)
    assert len(got) == len(ref) == 4 + need_s
    for name, g, e, r in zip(["loss", "dx", "dw", "db", "ds"], got, base, ref):
        tight = algo == "fast" and name in ("loss", "dx", "ds")
        assert rel(g, r) <= (1.1 if tight else 2.0) * rel(e, r), (name, rel(g, r), rel(e, r))
