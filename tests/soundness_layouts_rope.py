"""Soundness cases (tests/soundness.py) about the layouts, aliases, gradient sets and special values
that reach RoPE: strided, offset, transposed and stride-0 (expanded) inputs and weights, one
tensor in two roles, outputs returned twice or as views, gradients asked of only some inputs,
rows of zeros / inf / nan, degenerate sizes. Each fn is spelled as models write the op; the layout
or alias is built inside fn (run() makes every floating input a leaf with a gradient). fp32 only.

Shapes: q [2, 4, 6, 16], k [2, 2, 6, 16] (B, H, T, D), positions [2, 6].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import Case, awkward, randn


B, HQ, HK, T, RD = 2, 4, 2, 6, 16
POS = torch.arange(T) + torch.tensor([[0], [3]])  # [B, T] positions


def _inv_freq(d=RD, device=None):
    return 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)


def _tables(pos, d=RD, inv=None):  # HF cos, sin [..., T, d]
    a = pos[..., None].float() * (_inv_freq(d, pos.device) if inv is None else inv)
    emb = torch.cat((a, a), dim=-1)
    return emb.cos(), emb.sin()


def _rot(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _hf(x, cos, sin):
    return x * cos + _rot(x) * sin


def rope_same_tensor_as_q_and_k(q, k, pos):
    """q passed as both q and k (a self-similarity probe, or k = q by a config): two equal rotations."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q, cos, sin), _hf(q, cos, sin), k


def rope_k_view_of_q(q, k, pos):
    """k = q[:, :2] (the first two heads of q, overlapping storage): both rotated."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q, cos, sin), _hf(q[:, :2], cos, sin), k


def rope_qkv_packed_split(x, wqkv, pos):
    """x [2, 6, 32], qkv = x @ Wqkv.T [2, 6, 64] split into q [2, 6, 2, 16], k, v [2, 6, 1, 16], q and k
    transposed to [B, H, T, D] (views with row stride 64) and rotated."""
    q, k, v = F.linear(x, wqkv).split([32, 16, 16], dim=-1)
    q, k = q.view(B, T, 2, RD).transpose(1, 2), k.view(B, T, 1, RD).transpose(1, 2)
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q, cos, sin), _hf(k, cos, sin), v


def rope_both_heads_inner(q, k, pos):
    """q [2, 6, 4, 16], k [2, 6, 2, 16] given as [B, T, H, D] and transposed to [B, H, T, D] views (HF's
    .view(...).transpose(1, 2)), rotated, transposed back and merged as attention's output would be."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    qr, kr = _hf(q.transpose(1, 2), cos, sin), _hf(k.transpose(1, 2), cos, sin)
    return qr.transpose(1, 2).reshape(B, T, -1), kr.transpose(1, 2).reshape(B, T, -1)



def rope_q_heads_inner_k_contiguous(q, k, pos):
    """q [2, 6, 4, 16] transposed to a [B, H, T, D] view, k a contiguous [2, 2, 6, 16]: the pair's layouts differ."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q.transpose(1, 2), cos, sin), _hf(k, cos, sin)


def rope_heads_inner_view_back(q, k, pos):
    """[B, T, H, D] inputs transposed to [B, H, T, D], rotated, transposed back and .view()-ed [B, T, H*D]:
    valid on eager's layout (the rotation keeps the transposed memory order)."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    qr, kr = _hf(q.transpose(1, 2), cos, sin), _hf(k.transpose(1, 2), cos, sin)
    return qr.transpose(1, 2).view(B, T, -1), kr.transpose(1, 2).view(B, T, -1)


def rope_strided_channels(q, k, pos):
    """q [2, 4, 6, 32], k [2, 2, 6, 32]: the rotation of their even channels [..., ::2] (16, stride 2)."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q[..., ::2], cos, sin), _hf(k[..., ::2], cos, sin)


def rope_narrow_offset(q, k, pos):
    """q, k [.., 32]: channels 3..18 (storage offset 3, channel stride 1, row stride 32)."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q[..., 3:3 + RD], cos, sin), _hf(k[..., 3:3 + RD], cos, sin)


def rope_expanded_q(q, k, pos):
    """q [2, 1, 6, 16] expanded to 4 heads (stride 0 over heads), k [2, 2, 6, 16]."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q.expand(B, HQ, T, RD), cos, sin), _hf(k, cos, sin)


def rope_k_detached(q, k, pos):
    """k frozen (a cached or teacher k): only q's gradient."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q, cos, sin), _hf(k.detach(), cos, sin)


def rope_q_detached(q, k, pos):
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q.detach(), cos, sin), _hf(k, cos, sin)


def rope_frozen(q, k, pos):
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q.detach(), cos, sin), _hf(k.detach(), cos, sin)


def rope_inv_freq_param_detached(q, k, pos, inv):
    """inv_freq [8] a module parameter (a learned-then-frozen frequency set), detached before the table."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos, inv=inv.detach()))
    return _hf(q, cos, sin), _hf(k, cos, sin)


def rope_inv_freq_learned(q, k, pos, inv):
    """inv_freq learned (not detached): cos / sin require grad, which the fused op cannot give."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos, inv=inv))
    return _hf(q, cos, sin), _hf(k, cos, sin)


def rope_table_transposed_storage(q, k):
    """The cache stored [D, T_max] and read through .t(): cos / sin [T, D] with strides (1, T_max)."""
    cos, sin = _tables(torch.arange(16, device=q.device))
    cos, sin = cos.t().contiguous().t()[2:2 + T], sin.t().contiguous().t()[2:2 + T]
    return _hf(q, cos, sin), _hf(k, cos, sin)


def rope_table_every_other_position(q, k):
    """cos / sin of positions 0, 2, 4, ... (a strided slice of a [2T, D] cache: row stride 2D)."""
    cos, sin = _tables(torch.arange(2 * T, device=q.device))
    return _hf(q, cos[::2], sin[::2]), _hf(k, cos[::2], sin[::2])


def rope_table_expanded_over_heads(q, k, pos):
    """MHA (k has 4 heads too): cos / sin expanded to [B, 4, T, D] (stride 0 over heads) before the product."""
    cos, sin = (t.unsqueeze(1).expand(B, HQ, T, RD) for t in _tables(pos))
    return _hf(q, cos, sin), _hf(k, cos, sin)


def rope_rotated_twice(q, k, pos):
    """q rotated, then its rotation rotated again by the same tables (k once): the second rotation's input is
    the first's output, so the two cannot be one call."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(_hf(q, cos, sin), cos, sin), _hf(k, cos, sin)


def rope_k_from_rotated_q(q, k, pos):
    """k computed from rotated q (k = 0.5 * q_rot[:, :2] + k), then rotated by the same tables."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    qr = _hf(q, cos, sin)
    return qr, _hf(0.5 * qr[:, :2] + k, cos, sin)


def rope_k_first(q, k, pos):
    """k (2 heads) rotated before q (4 heads) in program order: the pair's first tensor has fewer heads."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    kr = _hf(k, cos, sin)
    qr = _hf(q, cos, sin)
    return qr, kr


def rope_output_returned_twice_and_view(q, k, pos):
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    qr, kr = _hf(q, cos, sin), _hf(k, cos, sin)
    return qr, kr, qr, kr[:, :1]


def rope_decode_t1(q, k):
    """T = 1 (decode) at position 5 of a cache: q [2, 4, 1, 16], k [2, 2, 1, 16], cos [1, 16]."""
    cos, sin = _tables(torch.arange(8, device=q.device))
    return _hf(q, cos[5:6], sin[5:6]), _hf(k, cos[5:6], sin[5:6])


def rope_3d_no_batch(q, k):
    """Unbatched q [4, 6, 16], k [2, 6, 16] (H, T, D), cos [6, 16]."""
    cos, sin = _tables(torch.arange(T, device=q.device))
    return _hf(q, cos, sin), _hf(k, cos, sin)


def rope_d2(q, k, pos):
    """D = 2: one channel pair per head."""
    cos, sin = (t.unsqueeze(1) for t in _tables(pos, 2))
    return _hf(q, cos, sin), _hf(k, cos, sin)


def rope_inf_in_q(q, k, pos):
    """One +inf in q at position 0 (sin = 0 there: its partner becomes inf * 0 = nan in eager)."""
    bump = torch.zeros_like(q)
    bump[0, 1, 0, 3] = float("inf")
    cos, sin = (t.unsqueeze(1) for t in _tables(pos))
    return _hf(q + bump, cos, sin), _hf(k, cos, sin)


def _qk(seed, dq=RD, hq=HQ, hk=HK, t=T, bthd=False, extra=()):
    shape = (lambda h: (B, t, h, dq)) if bthd else (lambda h: (B, h, t, dq))
    return lambda: (awkward(*shape(hq), seed=seed), awkward(*shape(hk), seed=seed + 1), POS[:, :t], *extra)


def _rope(fn, inputs, fuses):
    return Case(f"rope/{fn.__name__.removeprefix('rope_')}", fn, inputs, fuses)


ROPE_CASES = [
    _rope(rope_same_tensor_as_q_and_k, _qk(2000), True),
    _rope(rope_k_view_of_q, _qk(2010), True),
    _rope(rope_qkv_packed_split, lambda: (awkward(B, T, 32, seed=2020), randn(64, 32, seed=2021) * 32 ** -0.5, POS),
          True),
    _rope(rope_both_heads_inner, _qk(2030, bthd=True), True),
    _rope(rope_q_heads_inner_k_contiguous, lambda: (awkward(B, T, HQ, RD, seed=2040), awkward(B, HK, T, RD, seed=2041),
                                                    POS), True),
    _rope(rope_heads_inner_view_back, _qk(2050, bthd=True), True),
    _rope(rope_strided_channels, _qk(2060, dq=32), True),
    _rope(rope_narrow_offset, _qk(2070, dq=32), True),
    _rope(rope_expanded_q, _qk(2080, hq=1), True),
    _rope(rope_k_detached, _qk(2090), True),
    _rope(rope_q_detached, _qk(2100), True),
    _rope(rope_frozen, _qk(2110), True),
    _rope(rope_inv_freq_param_detached, _qk(2120, extra=(_inv_freq(),)), True),
    _rope(rope_inv_freq_learned, _qk(2130, extra=(_inv_freq(),)), False),
    _rope(rope_table_transposed_storage, lambda: _qk(2140)()[:2], True),
    _rope(rope_table_every_other_position, lambda: _qk(2150)()[:2], True),
    _rope(rope_table_expanded_over_heads, _qk(2160, hk=HQ), True),
    _rope(rope_rotated_twice, _qk(2170), True),
    _rope(rope_k_from_rotated_q, _qk(2180), True),
    _rope(rope_k_first, _qk(2190), True),
    _rope(rope_output_returned_twice_and_view, _qk(2200), True),
    _rope(rope_decode_t1, lambda: _qk(2210, t=1)()[:2], True),
    _rope(rope_3d_no_batch, lambda: tuple(t[0] for t in _qk(2220)()[:2]), True),
    _rope(rope_d2, _qk(2230, dq=2), True),
    _rope(rope_inf_in_q, _qk(2240), True),
]

CASES: list[Case] = ROPE_CASES
