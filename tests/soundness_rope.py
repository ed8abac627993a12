"""RoPE soundness cases: q and k of one attention layer rotated by shared cos / sin, spelled as the
families patterns/rope.py supports (HF rotate_half [B, H, T, D] and [B, T, H, D], NanoChat's flipped
cat(x2, -x1), the interleaved Cohere / GLM stack, the halves written out (gpt-oss chunk, nanochat),
DeepSeek's even / odd pairs, Meta's view_as_complex * freqs_cis, gpt-fast's real pairs, partial
rotary with a pass-through cat), or changed in one detail.

Shapes: q [2, 4, 6, 16] (B, Hq, T, D), k [2, 2, 6, 16] (GQA), or [B, T, H, D]. cos / sin come from
real angles (position * inv_freq) built inside each fn from integer positions: a table that is an
input would require grad in the harness, and the fused op gives cos / sin no gradient (check()
refuses those, so such cases never reach the matcher). Meta's freqs_cis is complex: an input.

fxfuse::rope computes out = x * A + rotate(x) * B (and its exact transpose) for any per-channel
tables A, B broadcast against x, so a change in the tables only (cos / sin swapped, halves of cos
that differ, repeat vs repeat_interleave, one table broadcast over heads instead of positions) is
no longer a rotation but still what the fused op computes: fuses=None there. Changes on the x side
(which channel pairs with which, the signs, the split, the gradient path) leave no (A, B) that
computes the result: fuses=False.
"""
from __future__ import annotations

import torch

from soundness import Case, awkward, randn

B, HQ, HK, T, D = 2, 4, 2, 6, 16
POS = torch.arange(T) + torch.tensor([[0], [3]])  # [B, T] int64 positions (a packed batch: offsets differ)


def inv_freq(d=D, base=10000.0, device=None):  # [d/2]
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)


def angles(pos, d=D):  # pos [..., T] int -> [..., T, d/2], on pos's device
    return pos[..., None].float() * inv_freq(d, device=pos.device)


def hf_tables(pos, d=D):  # HF: emb = cat(freqs, freqs) -> cos, sin [..., T, d]
    emb = torch.cat((angles(pos, d), angles(pos, d)), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):  # HF: cat(-x2, x1)
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def hf(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def qk(apply, unsqueeze=1, tables=hf_tables):
    """fn(q, k, pos): both rotated by apply with one (cos, sin) pair, unsqueezed at the heads dim."""
    def fn(q, k, pos):
        cos, sin = tables(pos)
        cos, sin = cos.unsqueeze(unsqueeze), sin.unsqueeze(unsqueeze)
        return apply(q, cos, sin), apply(k, cos, sin)
    fn.__name__ = apply.__name__
    return fn


def bhtd(seed, d=D, dtype=torch.float32):  # q [B, Hq, T, d], k [B, Hk, T, d], positions [B, T]
    return awkward(B, HQ, T, d, seed=seed, dtype=dtype), awkward(B, HK, T, d, seed=seed + 1, dtype=dtype), POS


def bthd(seed):  # q [B, T, Hq, D], k [B, T, Hk, D], positions
    return awkward(B, T, HQ, D, seed=seed), awkward(B, T, HK, D, seed=seed + 1), POS


# ---- correct spellings -------------------------------------------------------------------------------

def nanochat_flipped(x, cos, sin):  # cat(x2, -x1): the rotation by -angle
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat((x2, -x1), dim=-1) * sin


def interleaved_tables(pos):  # Cohere / GLM: each angle repeated per pair, [B, T, D]
    a = angles(pos).repeat_interleave(2, dim=-1)
    return a.cos(), a.sin()


def cohere_interleaved(x, cos, sin):  # stack(-x[1::2], x[::2]).flatten(-2)
    return x * cos + torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2) * sin


def half_tables(pos):  # one value per pair: [B, T, D/2]
    return angles(pos).cos(), angles(pos).sin()


def gpt_oss_halves(x, c, s):  # halves by torch.chunk, c / s [B, 1, T, D/2]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def nanochat_halves(x, c, s):  # [B, T, H, D], c / s [B, T, 1, D/2]: the rotation by -angle
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * c + x2 * s, x1 * (-s) + x2 * c], 3)


def deepseek_even_odd(x, c, s):  # pairs (x[2i], x[2i+1]) in, halves layout out
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def meta_complex(change=None):
    """Meta / torchtitan: q, k [B, T, H, D], freqs_cis complex [T, D/2] viewed [1, T, 1, D/2]; change:
    "conj" (xc * conj(f): the rotation by -angle), "flip" (view_as_real(...).flip(-1): (im, re) per
    pair), "across_halves" (pairs (x[i], x[i + D/2]) by reshape(.., 2, D/2).transpose)."""
    def fn(q, k, freqs_cis):
        f = freqs_cis.view(1, T, 1, D // 2)
        f = f.conj() if change == "conj" else f

        def rot(x):
            pairs = x.float().reshape(*x.shape[:-1], -1, 2)
            if change == "across_halves":
                pairs = x.float().reshape(*x.shape[:-1], 2, -1).transpose(-1, -2).contiguous()
            out = torch.view_as_real(torch.view_as_complex(pairs) * f)
            return (out.flip(-1) if change == "flip" else out).flatten(3).type_as(x)
        return rot(q), rot(k)
    return fn


def freqs_cis(scale=1.0):  # complex [T, D/2] of unit modulus (times scale)
    return torch.polar(torch.full((T, D // 2), scale), angles(torch.arange(T)))


def gptfast_pairs(sign=-1):
    """gpt-fast: q, k [B, T, H, D], freqs [B, T, 1, D/2, 2] (cos, sin), the complex product in real
    arithmetic: re = x0 c - x1 s; sign=+1 writes re = x0 c + x1 s (no rotation)."""
    def fn(q, k, pos):
        a = angles(pos)
        freqs = torch.stack((a.cos(), a.sin()), dim=-1).unsqueeze(2)

        def rot(x):
            xs = x.float().reshape(*x.shape[:-1], -1, 2)
            re, im = xs[..., 0] * freqs[..., 0], xs[..., 1] * freqs[..., 1]
            out = torch.stack([re - im if sign < 0 else re + im,
                               xs[..., 1] * freqs[..., 0] + xs[..., 0] * freqs[..., 1]], -1)
            return out.flatten(3).type_as(x)
        return rot(q), rot(k)
    return fn


# GPT-NeoX / Phi partial rotary: the first r channels rotated by r-channel tables, the rest passed through.
# Literal sizes, not closure ints: under dynamic=True Dynamo makes a closure int a symbol, and symbolic
# slice bounds never match a spelling (shapes.py), so the case would test nothing there.
def neox_8_of_16(x, cos, sin):
    return torch.cat((hf(x[..., :8], cos, sin), x[..., 8:]), dim=-1)


def rotary_12_of_16(x, cos, sin):  # r not a power of two
    return torch.cat((hf(x[..., :12], cos, sin), x[..., 12:]), dim=-1)


def rotary_6_of_10(x, cos, sin):  # D = 10, halves of 3
    return torch.cat((hf(x[..., :6], cos, sin), x[..., 6:]), dim=-1)


def kv_cache_offset(q, k):  # [T_max, D] tables sliced at a position offset: cos[2:2 + T] (no unsqueeze)
    cos, sin = hf_tables(torch.arange(16, device=q.device))
    t = q.shape[2]
    cos, sin = cos[2:2 + t], sin[2:2 + t]
    return hf(q, cos, sin), hf(k, cos, sin)


def k_own_positions(q, k, pos):  # k's tables from other positions: k must get its own rotation, not q's
    cq, sq = (t.unsqueeze(1) for t in hf_tables(pos))
    ck, sk = (t.unsqueeze(1) for t in hf_tables(pos + 5))
    return hf(q, cq, sq), hf(k, ck, sk)


def k_shorter_table_slice(q, k):  # q T=6, k T=4 (a shorter k): cos[:T] sliced per tensor
    cos, sin = hf_tables(torch.arange(8, device=q.device))
    return hf(q, cos[:q.shape[2]], sin[:q.shape[2]]), hf(k, cos[:k.shape[2]], sin[:k.shape[2]])


def q_only(q, k, pos):  # k returned as is: a lone rotation
    cos, sin = (t.unsqueeze(1) for t in hf_tables(pos))
    return hf(q, cos, sin), k


def bf16_rotation_no_grad(q, k, pos):
    """bf16 q, k, fp32 tables: eager's result is fp32 (promotion). q, k detached: eager rounds each
    term's gradient to bf16 and sums in bf16, the fused op rounds once (1.7e-3 from fp64 against
    eager's 2.3e-3), so their bf16 gradients differ by ~3e-3 and no fp32 tolerance compares them."""
    cos, sin = (t.unsqueeze(1) for t in hf_tables(pos))
    return hf(q.detach(), cos, sin), hf(k.detach(), cos, sin)


def mixed_dtype(q, k, pos):  # q fp32, k bf16, tables bf16: eager gives q' fp32, k' bf16
    cos, sin = (t.unsqueeze(1).bfloat16() for t in hf_tables(pos))
    return hf(q, cos, sin), hf(k, cos, sin)


# ---- x-side changes: no per-channel (A, B) computes them ---------------------------------------------

ROTATED_COPY = {  # change -> the copy multiplied by sin, in place of rotate_half(x) = cat(-x[8:], x[:8])
    "cat(x2,x1)": lambda x: torch.cat((x[..., 8:], x[..., :8]), dim=-1),  # no negation
    "cat(-x1,x2)": lambda x: torch.cat((-x[..., :8], x[..., 8:]), dim=-1),  # halves swapped
    "cat(-x2,-x1)": lambda x: torch.cat((-x[..., 8:], -x[..., :8]), dim=-1),
    "split_off_middle": lambda x: torch.cat((-x[..., 6:], x[..., :6]), dim=-1),  # x[..., :6], x[..., 6:] on D=16
    "split_on_positions": lambda x: torch.cat((-x[:, :, 3:], x[:, :, :3]), dim=2),  # halves of T, not D
    "of_detached_x": lambda x: rotate_half(x.detach()),  # no gradient through the rotated copy
    # interleaved with the signs on the wrong side: stack(x[::2], -x[1::2])
    "interleaved_signs_reversed": lambda x: torch.stack((x[..., ::2], -x[..., 1::2]), dim=-1).flatten(-2),
}


def rotated_copy_changed(change):
    def apply(x, cos, sin):
        return x * cos + ROTATED_COPY[change](x) * sin
    apply.__name__ = f"rotated_copy_{change}"
    return apply


def odd_rotary_dim(q, k, pos):  # r = 7 of 16: halves of 3 and 4, cat(-x[3:7], x[:3]) is not a pairing
    cos, sin = (t.unsqueeze(1) for t in hf_tables(pos, 8))
    cos, sin = cos[..., :7], sin[..., :7]
    return tuple(torch.cat((hf(x[..., :7], cos, sin), x[..., 7:]), dim=-1) for x in (q, k))


def halves_changed(change):
    """The halves rotation cat(x1 c - x2 s, x2 c + x1 s), c / s [.., D/2], with one change."""
    def apply(x, c, s):
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        y = {"tables_differ_per_half": lambda: (x1 * c - x2 * s, x2 * (c * c) + x1 * (s * 0.5)),  # c2 != c1
             "outputs_swapped": lambda: (x2 * c + x1 * s, x1 * c - x2 * s)}[change]()  # cat(y2, y1)
        return torch.cat(y, dim=-1)
    apply.__name__ = f"halves_{change}"
    return apply


def deepseek_odd_even_swapped(x, c, s):  # x1 = x[1::2], x2 = x[0::2]
    x1, x2 = x[..., 1::2], x[..., 0::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


# ---- table-side changes and extra terms: what the fused op computes, or not fused -------------------

def cos_sin_swapped(x, cos, sin):
    return x * sin + rotate_half(x) * cos


def cos_halves_differ(pos):  # cat(c1, c2), c1 != c2 (and sin likewise): no pair shares one angle
    a = angles(pos)
    return torch.cat((a.cos(), (2 * a).cos()), -1), torch.cat((a.sin(), (0.5 * a).sin()), -1)


def repeat_not_interleave(pos):  # interleaved rotation, tables in the halves layout (repeat)
    a = angles(pos).repeat(1, 1, 2)
    return a.cos(), a.sin()


def product_scaled(x, cos, sin):  # (x * cos) * 2
    return x * cos * 2 + rotate_half(x) * sin


def minus_rotated(x, cos, sin):  # x cos - rot(x) sin: the rotation by -angle
    return x * cos - rotate_half(x) * sin


def pass_through_first(x, cos, sin):  # cat(pass, rot): the rotated slice still binds as the input
    return torch.cat((x[..., 8:], hf(x[..., :8], cos, sin)), dim=-1)


def rotated_slice_4_to_12(x, cos, sin):  # the rotated slice not at channel 0
    return torch.cat((x[..., :4], hf(x[..., 4:12], cos, sin), x[..., 12:]), dim=-1)


def with_bias(q, k, pos, bias):  # bias [D], a parameter
    cos, sin = (t.unsqueeze(1) for t in hf_tables(pos))
    return hf(q, cos, sin) + bias, hf(k, cos, sin) + bias


def rotated_half_also_returned(q, k, pos):  # an intermediate of the rotation used elsewhere
    cos, sin = (t.unsqueeze(1) for t in hf_tables(pos))
    rq = rotate_half(q)
    return q * cos + rq * sin, hf(k, cos, sin), rq


def tables_over_heads(q, k, pos):  # MHA q, k [2, 4, 4, 16], tables [B, T=4, D] unsqueezed at 2 on [B, H, T, D]
    cos, sin = (t.unsqueeze(2) for t in hf_tables(pos[:, :4]))  # [B, 4, 1, D]: varies over heads, not positions
    return hf(q, cos, sin), hf(k, cos, sin)


def one_angle_per_position(q, k, pos):  # cos / sin [B, 1, T, 1]: every pair by the same angle
    a = pos[:, None, :, None].float() * 0.3
    return hf(q, a.cos(), a.sin()), hf(k, a.cos(), a.sin())


def sin_broadcast_over_batch(q, k, pos):  # cos [B, 1, T, D], sin [1, 1, T, D] (batch 0's): shapes differ
    cos, sin = (t.unsqueeze(1) for t in hf_tables(pos))
    return hf(q, cos, sin[:1]), hf(k, cos, sin[:1])


def k_written_between(q, k, pos):
    """k's input written in place (through a view) after q's rotation, before k's: the call that
    rotates both must not read k where q's rotation was."""
    cos, sin = (t.unsqueeze(1) for t in hf_tables(pos))
    kk = k * 2.0
    q2 = hf(q, cos, sin)
    kk[..., :2].zero_()
    return q2, hf(kk, cos, sin)


def c(name, fn, inputs, fuses):
    return Case(f"rope/{name}", fn, inputs, fuses)


def tables_of(r):  # HF tables of r channels
    return lambda pos: hf_tables(pos, r)


CASES: list[Case] = [
    # correct spellings of each family
    c("hf_rotate_half", qk(hf), lambda: bhtd(1), True),
    c("hf_rotate_half_bthd", qk(hf, unsqueeze=2), lambda: bthd(3), True),
    c("nanochat_rotate_half_flipped", qk(nanochat_flipped), lambda: bhtd(5), True),
    c("cohere_interleaved", qk(cohere_interleaved, tables=interleaved_tables), lambda: bhtd(7), True),
    c("gpt_oss_halves_chunk", qk(gpt_oss_halves, tables=half_tables), lambda: bhtd(9), True),
    c("nanochat_halves_bthd", qk(nanochat_halves, unsqueeze=2, tables=half_tables), lambda: bthd(11), True),
    c("deepseek_even_odd", qk(deepseek_even_odd, tables=half_tables), lambda: bhtd(13), True),
    c("meta_complex_freqs_cis", meta_complex(), lambda: (*bthd(15)[:2], freqs_cis()), True),
    c("gptfast_real_pairs", gptfast_pairs(), lambda: bthd(17), True),
    c("partial_rotary_neox_8_of_16", qk(neox_8_of_16, tables=tables_of(8)), lambda: bhtd(19), True),
    c("partial_rotary_12_of_16", qk(rotary_12_of_16, tables=tables_of(12)), lambda: bhtd(21), True),
    c("partial_rotary_6_of_10", qk(rotary_6_of_10, tables=tables_of(6)), lambda: bhtd(23, d=10), True),
    c("kv_cache_offset_tables", kv_cache_offset, lambda: bhtd(25)[:2], True),
    c("k_written_between", k_written_between, lambda: bhtd(29), True),
    c("k_own_positions", k_own_positions, lambda: bhtd(27), True),
    c("k_shorter_table_slice", k_shorter_table_slice,
      lambda: (awkward(B, HQ, T, D, seed=29), awkward(B, HK, 4, D, seed=30)), True),
    c("q_only", q_only, lambda: bhtd(31), True),
    c("bf16_qk_fp32_tables", bf16_rotation_no_grad, lambda: bhtd(33, dtype=torch.bfloat16), True),
    # fails: group() pairs q (fp32 out) with k (bf16 out) into one call of the first's dtype
    c("mixed_dtype_q_fp32_k_bf16", mixed_dtype,
      lambda: (awkward(B, HQ, T, D, seed=35), awkward(B, HK, T, D, seed=36, dtype=torch.bfloat16), POS), None),
    # x-side changes: must not fuse
    *[c(f"rotate_half_{ch}", qk(rotated_copy_changed(ch)), lambda s=s: bhtd(s), False) for ch, s in (
        ("cat(x2,x1)", 37), ("cat(-x1,x2)", 39), ("cat(-x2,-x1)", 41), ("split_off_middle", 45),
        ("split_on_positions", 47), ("of_detached_x", 49))],
    c("odd_rotary_dim_7", odd_rotary_dim, lambda: bhtd(51), False),
    c("interleaved_signs_reversed", qk(rotated_copy_changed("interleaved_signs_reversed"),
                                       tables=interleaved_tables), lambda: bhtd(53), False),
    *[c(f"halves_{h}", qk(halves_changed(h), tables=half_tables), lambda s=s: bhtd(s), False)
      for h, s in (("tables_differ_per_half", 55), ("outputs_swapped", 59))],
    c("deepseek_odd_even_swapped", qk(deepseek_odd_even_swapped, tables=half_tables), lambda: bhtd(61), False),
    c("complex_real_imag_swapped", meta_complex("flip"), lambda: (*bthd(63)[:2], freqs_cis()), False),
    c("complex_pairs_across_halves", meta_complex("across_halves"), lambda: (*bthd(65)[:2], freqs_cis()), False),
    c("gptfast_sum_sign_swapped", gptfast_pairs(+1), lambda: bthd(67), False),
    # table-side changes and extra terms: the fused op's general (A, B) may compute them; parity decides
    c("cos_sin_swapped", qk(cos_sin_swapped), lambda: bhtd(69), None),
    c("cos_halves_differ", qk(hf, tables=cos_halves_differ), lambda: bhtd(75), None),
    c("interleaved_tables_repeat", qk(cohere_interleaved, tables=repeat_not_interleave), lambda: bhtd(77), None),
    c("product_scaled", qk(product_scaled), lambda: bhtd(81), None),
    c("minus_rotated", qk(minus_rotated), lambda: bhtd(83), None),
    c("with_bias", with_bias, lambda: (*bhtd(87), randn(D, seed=88)), None),
    c("partial_pass_through_first", qk(pass_through_first, tables=tables_of(8)), lambda: bhtd(89), None),
    c("partial_rotated_slice_4_to_12", qk(rotated_slice_4_to_12, tables=tables_of(8)), lambda: bhtd(91), None),
    c("rotated_half_also_returned", rotated_half_also_returned, lambda: bhtd(93), None),
    c("tables_over_heads", tables_over_heads,
      lambda: (awkward(B, HQ, 4, D, seed=95), awkward(B, HQ, 4, D, seed=96), POS), None),
    # fail (ValueError at run time): check() compares neither cos's last dim with D nor cos's shape with sin's
    c("one_angle_per_position", one_angle_per_position, lambda: bhtd(97), None),
    c("sin_broadcast_over_batch", sin_broadcast_over_batch, lambda: bhtd(99), None),
    c("complex_conj_freqs", meta_complex("conj"), lambda: (*bthd(101)[:2], freqs_cis()), True),
    c("complex_scaled_freqs", meta_complex(), lambda: (*bthd(103)[:2], freqs_cis(2.0)), None),
]
