"""CPU tests of fxfuse.rope: the Triton kernels run under the interpreter (TRITON_INTERPRET=1)."""
import os
import sys

import pytest
import torch

import fxfuse.kernels.rope as rope_kernels
from fxfuse.kernels.rope import rope_reference

pytestmark = pytest.mark.interpreter  # the Triton kernels under the interpreter on CPU (tests/conftest.py)

rope = torch.ops.fxfuse.rope

# (q layout, cos kind, B, Hq, Hk, T, D, rotary_dim, interleaved)
CASES = [
    ("bhtd", "b1tr", 1, 1, 1, 1, 8, 8, False),  # one row
    ("bthd_view", "b1tr", 2, 4, 2, 7, 16, 16, False),  # q = proj.view(B,T,H,D).transpose(1,2), GQA
    ("bthd", "1t1r", 2, 4, 1, 9, 24, 12, True),  # MQA, partial, interleaved, D not a power of 2
    ("bhtd", "tr", 1, 3, 3, 199, 10, 6, False),  # 199 positions, r/2 = 3
    ("bthd", "tr", 1, 2, 1, 13, 80, 32, False),  # Phi-2 style partial rotary
    ("bhtd", "expand", 2, 2, 2, 5, 64, 64, True),  # cos expanded over B (stride 0, size > 1)
    ("bhtd", "full", 1, 2, 2, 3, 8, 8, False),  # cos not broadcast at all
]


def _qk(layout, b, hq, hk, t, d, dtype, seed=0):
    """q, k in the layout; 'bthd_view' gives q [B, H, T, D] as a transposed (non-contiguous) view."""
    g = torch.Generator().manual_seed(seed)
    if layout == "bthd_view":
        q = torch.randn(b, t, hq * d, generator=g).view(b, t, hq, d).transpose(1, 2)
        k = torch.randn(b, t, hk * d, generator=g).view(b, t, hk, d).transpose(1, 2)
    elif layout == "bthd":
        q, k = torch.randn(b, t, hq, d, generator=g), torch.randn(b, t, hk, d, generator=g)
    else:
        q, k = torch.randn(b, hq, t, d, generator=g), torch.randn(b, hk, t, d, generator=g)
    return q.to(dtype), k.to(dtype)


def _cos_sin(kind, layout, b, hq, t, r, dtype, seed=1):
    """Arbitrary per-channel cos/sin (the op must not assume equal halves) in the kind's shape."""
    g = torch.Generator().manual_seed(seed)
    heads_dim = 2 if layout == "bthd" else 1
    if kind == "full":
        shape = [b, t, hq, r] if layout == "bthd" else [b, hq, t, r]
    else:
        shape = [b, t, t, r]
        shape[heads_dim] = 1
        shape[3 - heads_dim] = t
        if kind in ("1t1r", "tr", "expand"):
            shape[0] = 1
    cos, sin = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    if kind == "tr":  # a [T, r] table expanded to rank 4 by the caller
        cos, sin = (x.reshape(t, r).unsqueeze(0).unsqueeze(heads_dim) for x in (cos, sin))
    if kind == "expand":
        cos, sin = (x.expand(b, *x.shape[1:]) for x in (cos, sin))
    return cos, sin


def _eager(x, cos, sin, interleaved, r):
    """The per-channel formula in x's own dtype (what an eager model computes in bf16)."""
    xr = x[..., :r]
    if interleaved:
        partner = xr.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        sign = torch.tensor([-1.0, 1.0]).repeat(r // 2)
    else:
        partner = xr.roll(r // 2, dims=-1)
        sign = torch.tensor([-1.0, 1.0]).repeat_interleave(r // 2)
    return torch.cat((xr * cos + sign.to(x.dtype) * partner * sin, x[..., r:]), dim=-1)


def _err(a, ref):
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _fwd_bwd(fn, q, k, cos, sin, gq, gk):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = fn(q, k, cos, sin)
    dq, dk = torch.autograd.grad((qo, ko), (q, k), (gq, gk))
    return qo, ko, dq, dk


def _grads_like(q, k, seed=2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(q.shape, generator=g).to(q.dtype), torch.randn(k.shape, generator=g).to(k.dtype))


# block_c, positions per program: None = the interpreter's choice (one program for most cases), 1 =
# the GPU's (not on 199 positions: ~20 s of CI), 4 = several programs, a ragged last one at 199
REF_CASES = [(bc, c) for bc in (None, 4) for c in CASES] + [(1, c) for c in CASES if c[5] < 199]


@pytest.mark.parametrize("block_c,case", REF_CASES, ids=[
    f"c{bc}-{c[0]}-{c[1]}-T{c[5]}-D{c[6]}-r{c[7]}-i{int(c[8])}" for bc, c in REF_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(monkeypatch, case, dtype, block_c):
    monkeypatch.setattr(rope_kernels, "_BLOCK_C_OVERRIDE", block_c)
    layout, kind, b, hq, hk, t, d, r, inter = case
    q, k = _qk(layout, b, hq, hk, t, d, dtype)
    cos, sin = _cos_sin(kind, layout, b, hq, t, r, dtype)
    gq, gk = _grads_like(q, k)
    out = _fwd_bwd(lambda *a: rope(*a, inter, r), q, k, cos, sin, gq, gk)
    assert out[0].shape == q.shape and out[1].shape == k.shape and out[0].dtype == dtype
    # eager's q * cos + rotate_half(q) * sin keeps a transposed q's layout (empty_like's strides);
    # the op's outputs do too, and its gradients keep the incoming gradients' layout
    assert out[0].stride() == torch.empty_like(q).stride() and out[1].stride() == torch.empty_like(k).stride()
    assert out[2].stride() == gq.stride() and out[3].stride() == gk.stride()
    if dtype == torch.float32:
        ref = _fwd_bwd(lambda *a: rope_reference(*a, inter, r), q, k, cos, sin, gq, gk)
        for a, e in zip(out, ref):
            assert _err(a, e) < 1e-6
        return
    ref = _fwd_bwd(lambda *a: rope_reference(*a, inter, r),
                   *(x.double() for x in (q, k, cos, sin, gq, gk)))
    eager = _fwd_bwd(lambda q_, k_, c, s: (_eager(q_, c, s, inter, r), _eager(k_, c, s, inter, r)),
                     q, k, cos, sin, gq, gk)
    for a, e, f in zip(out, eager, ref):
        assert _err(a, f) <= 2 * _err(e, f)


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _hf(q, k, cos, sin):
    """transformers' apply_rotary_pos_emb (q, k [B, H, T, D]; cos, sin [B, T, D], unsqueeze_dim=1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _hf_tables(b, t, d, dtype, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    pos = torch.arange(t, dtype=torch.float64) + torch.arange(b, dtype=torch.float64)[:, None] * 3
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)  # [B, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_hf_rotate_half(dtype):
    b, hq, hk, t, d = 2, 4, 2, 11, 32
    q, k = _qk("bthd_view", b, hq, hk, t, d, dtype)
    cos, sin = _hf_tables(b, t, d, dtype)
    gq, gk = _grads_like(q, k)
    out = _fwd_bwd(lambda q_, k_, c, s: rope(q_, k_, c.unsqueeze(1), s.unsqueeze(1), False, d),
                   q, k, cos, sin, gq, gk)
    hf = _fwd_bwd(_hf, q, k, cos, sin, gq, gk)
    if dtype == torch.float32:
        for a, e in zip(out, hf):
            assert _err(a, e) < 1e-6
        return
    ref = _fwd_bwd(_hf, *(x.double() for x in (q, k, cos, sin, gq, gk)))
    for a, e, f in zip(out, hf, ref):
        assert _err(a, f) <= 2 * _err(e, f)


def _meta(q, k, freqs_cis):
    """Llama's apply_rotary_emb (q, k [B, T, H, D]; freqs_cis complex [T, D/2])."""
    fc = freqs_cis[None, :, None, :]
    wide = fc.real.dtype  # fp32 as in Llama; fp64 for the reference
    qc = torch.view_as_complex(q.to(wide).reshape(*q.shape[:-1], -1, 2))
    kc = torch.view_as_complex(k.to(wide).reshape(*k.shape[:-1], -1, 2))
    return (torch.view_as_real(qc * fc).flatten(3).type_as(q),
            torch.view_as_real(kc * fc).flatten(3).type_as(k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_meta_complex(dtype):
    b, hq, hk, t, d = 2, 4, 1, 9, 16
    q, k = _qk("bthd", b, hq, hk, t, d, dtype)
    angles = torch.outer(torch.arange(t).float(), 1.0 / 500000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    cos = angles.cos().repeat_interleave(2, -1)[None, :, None, :]  # fp32 [1, T, 1, D]
    sin = angles.sin().repeat_interleave(2, -1)[None, :, None, :]
    gq, gk = _grads_like(q, k)
    out = _fwd_bwd(lambda q_, k_, c, s: rope(q_, k_, c, s, True, d), q, k, cos, sin, gq, gk)
    meta = _fwd_bwd(lambda q_, k_, c, s: _meta(q_, k_, freqs_cis), q, k, cos, sin, gq, gk)
    if dtype == torch.float32:
        for a, e in zip(out, meta):
            assert _err(a, e) < 1e-6
        return
    ref = _fwd_bwd(lambda q_, k_, c, s: _meta(q_, k_, freqs_cis.to(torch.complex128)),
                   *(x.double() for x in (q, k, cos, sin, gq, gk)))
    for a, e, f in zip(out, meta, ref):
        assert _err(a, f) <= 2 * _err(e, f)


@pytest.mark.parametrize("frozen", ["q", "k"])
def test_frozen_input_gets_no_grad(frozen):
    q, k = _qk("bhtd", 1, 2, 1, 5, 16, torch.float32)
    cos, sin = _cos_sin("b1tr", "bhtd", 1, 2, 5, 16, torch.float32)
    q.requires_grad_(frozen != "q")
    k.requires_grad_(frozen != "k")
    qo, ko = rope(q, k, cos, sin, False, 16)
    (qo.square().sum() + ko.square().sum()).backward()
    rq, rk = (x.detach().requires_grad_() for x in (q, k))
    eq, ek = rope_reference(rq, rk, cos, sin, False, 16)
    (eq.square().sum() + ek.square().sum()).backward()
    live, dead, ref = (k, q, rk) if frozen == "q" else (q, k, rq)
    assert dead.grad is None
    assert _err(live.grad, ref.grad) < 1e-6


def test_unused_output_grad():
    q, k = (x.requires_grad_() for x in _qk("bthd", 1, 2, 2, 4, 8, torch.float32))
    cos, sin = _cos_sin("1t1r", "bthd", 1, 2, 4, 8, torch.float32)
    qo, _ = rope(q, k, cos, sin, True, 8)
    qo.square().sum().backward()
    rq = q.detach().requires_grad_()
    rope_reference(rq, k.detach(), cos, sin, True, 8)[0].square().sum().backward()
    assert _err(q.grad, rq.grad) < 1e-6
    assert k.grad is None or k.grad.abs().max() == 0


def test_cos_requiring_grad_refuses_backward():
    q, k = (x.requires_grad_() for x in _qk("bhtd", 1, 1, 1, 3, 8, torch.float32))
    cos, sin = _cos_sin("b1tr", "bhtd", 1, 1, 3, 8, torch.float32)
    qo, ko = rope(q, k, cos.requires_grad_(), sin, False, 8)
    with pytest.raises(RuntimeError, match="cos/sin"):
        (qo.sum() + ko.sum()).backward()


@pytest.mark.parametrize("bad", ["odd_rot", "rot_gt_d", "cos_width", "cos_heads_vs_gqa"])
def test_rejects_bad_shapes(bad):
    q, k = _qk("bhtd", 1, 4, 2, 3, 8, torch.float32)
    cos, sin = _cos_sin("b1tr", "bhtd", 1, 4, 3, 8, torch.float32)
    r = 8
    if bad == "odd_rot":
        r, cos, sin = 7, cos[..., :7], sin[..., :7]
    elif bad == "rot_gt_d":
        r, cos, sin = 10, torch.cat((cos, cos[..., :2]), -1), torch.cat((sin, sin[..., :2]), -1)
    elif bad == "cos_width":
        r = 6
    else:
        cos, sin = (x.expand(1, 4, 3, 8) for x in (cos, sin))
    with pytest.raises(ValueError):
        rope(q, k, cos, sin, False, r)


def test_reference_path_matches_triton_path(monkeypatch):
    q, k = _qk("bthd_view", 2, 2, 1, 5, 12, torch.float32)
    cos, sin = _cos_sin("b1tr", "bthd_view", 2, 2, 5, 8, torch.float32)
    gq, gk = _grads_like(q, k)
    tri = _fwd_bwd(lambda *a: rope(*a, False, 8), q, k, cos, sin, gq, gk)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # use_triton(cpu) -> False: the PyTorch fallback
    ref = _fwd_bwd(lambda *a: rope(*a, False, 8), q, k, cos, sin, gq, gk)
    for a, e in zip(tri, ref):
        assert a.stride() == e.stride() and _err(a, e) < 1e-6
    assert not tri[0].is_contiguous()  # q's transposed layout, on both paths


def test_empty():
    q, k = _qk("bhtd", 2, 2, 1, 0, 8, torch.float32)
    cos, sin = _cos_sin("b1tr", "bhtd", 2, 2, 0, 8, torch.float32)
    qo, ko = rope(q, k, cos, sin, False, 8)
    assert qo.shape == q.shape and ko.shape == k.shape


def test_opcheck():
    q, k = (x.requires_grad_() for x in _qk("bthd_view", 1, 2, 1, 3, 12, torch.float32))
    cos, sin = _cos_sin("b1tr", "bthd_view", 1, 2, 3, 8, torch.float32)
    torch.library.opcheck(torch.ops.fxfuse.rope.default, (q, k, cos, sin, False, 8))
    torch.library.opcheck(torch.ops.fxfuse.rope.default, (q, k, cos, sin, True, 8))
    gq, gk = _grads_like(q, k)
    torch.library.opcheck(torch.ops.fxfuse.rope_bwd.default, (gq, gk, cos, sin, False, 8))
    torch.library.opcheck(torch.ops.fxfuse.rope_bwd.default, (None, gk, cos, sin, True, 8))


def test_compile_dynamic_two_sizes():
    def fn(q, k, cos, sin):
        qo, ko = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, False, cos.shape[-1])
        return qo * 2, ko

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for t in (5, 9):
        q, k = _qk("bthd", 2, 4, 2, t, 16, torch.float32, seed=t)
        cos, sin = _cos_sin("b1tr", "bhtd", 2, 4, t, 16, torch.float32, seed=t)
        gq, gk = _grads_like(q.transpose(1, 2), k.transpose(1, 2), seed=t)
        out = _fwd_bwd(compiled, q, k, cos, sin, gq, gk)

        def ref_fn(q_, k_, c, s):
            qo, ko = rope_reference(q_.transpose(1, 2), k_.transpose(1, 2), c, s, False, 16)
            return qo * 2, ko

        ref = _fwd_bwd(ref_fn, q, k, cos, sin, gq, gk)
        for a, e in zip(out, ref):
            assert a.shape == e.shape and _err(a, e) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_round_products_equals_hf_eager(monkeypatch, dtype, on_triton):
    """round_products=True (numerics="eager"): each product rounded before the sum, as HF's three
    bf16 ops store them, so q', k' and both gradients equal eager's bit for bit; one rounding differs."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    b, hq, hk, t, d = 2, 4, 2, 11, 32
    q, k = _qk("bthd_view", b, hq, hk, t, d, dtype)
    cos, sin = _hf_tables(b, t, d, dtype)
    gq, gk = _grads_like(q, k)
    hf = _fwd_bwd(_hf, q, k, cos, sin, gq, gk)
    for rnd in (True, False):
        out = _fwd_bwd(lambda q_, k_, c, s: rope(q_, k_, c.unsqueeze(1), s.unsqueeze(1), False, d, rnd),
                       q, k, cos, sin, gq, gk)
        assert all(torch.equal(a, e) for a, e in zip(out, hf)) == rnd


@pytest.mark.parametrize("inter", [False, True])
def test_bf16_rounds_once(inter):
    """bf16 q, k with fp32 cos/sin: fp32 math and one rounding, so bitwise equal to the reference."""
    q, k = _qk("bthd", 2, 3, 1, 6, 24, torch.bfloat16)
    cos, sin = _cos_sin("1t1r", "bthd", 2, 3, 6, 16, torch.float32)
    gq, gk = _grads_like(q, k)
    out = _fwd_bwd(lambda *a: rope(*a, inter, 16), q, k, cos, sin, gq, gk)
    ref = _fwd_bwd(lambda *a: rope_reference(*a, inter, 16), q, k, cos, sin, gq, gk)
    for a, e in zip(out, ref):
        assert a.dtype == torch.bfloat16 and torch.equal(a, e)


def test_bench_byte_count():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from bench_rope import rope_bytes

    qk = (32 + 8) * 4 * 4096 * 128 * 2  # q and k, bf16
    cos_sin = 2 * 4 * 4096 * 128 * 2  # cos and sin [4, 1, 4096, 128], bf16
    assert rope_bytes(4, 32, 8, 4096, 128, 4, 2, 2) == 4 * qk + 2 * cos_sin
