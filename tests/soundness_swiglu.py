"""Soundness cases of the gated-MLP activation (pattern "swiglu"): ``act(gate) * up`` spelled as models
write it (fuses=True), and look-alikes changed in one detail: halves swapped or taken from the wrong
place of a packed gate_up, an activation other than the variant's (a scaled or shifted sigmoid, a wrong
GELU constant, a cube for a square), gpt-oss's clamps moved, broadcast operands, intermediates used
elsewhere, in-place writes, a no_grad region inside the site. fuses=False where no gated activation
computes the value; None where one legitimately may (or the matcher may refuse): parity is what counts.

Shapes: x [2, 5, 32]; gate / up projections wg, wu [48, 32] (gate g, up u: [2, 5, 48]); packed wgu
[96, 32] (gate_up gu: [2, 5, 96]); down projection wd [32, 48]. x is awkward() (rows of very different
scale), so gates run from ~1e-3 to ~20: gpt-oss's clamp at 7 and every activation's tails are hit.
Most cases are written as f(g, u) or f(gu) and wrapped (_sep / _pk) with the projections in front.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from soundness import Case, awkward, randn

I = 48  # intermediate size


def _sep(name, f, seed, fuses):
    """Case of f(g, u), g = x @ wg.T, u = x @ wu.T."""
    def fn(x, wg, wu):
        return f(F.linear(x, wg), F.linear(x, wu))
    fn.__name__ = f.__name__
    return Case(f"swiglu/{name}", fn, lambda: (awkward(2, 5, 32, seed=seed), randn(I, 32, seed=seed + 1) * 0.4,
                                               randn(I, 32, seed=seed + 2) * 0.4), fuses)


def _pk(name, f, seed, fuses):
    """Case of f(gu), gu = x @ wgu.T [2, 5, 96]."""
    def fn(x, wgu):
        return f(F.linear(x, wgu))
    fn.__name__ = f.__name__
    return Case(f"swiglu/{name}", fn, lambda: (awkward(2, 5, 32, seed=seed), randn(2 * I, 32, seed=seed + 1) * 0.4),
                fuses)


def _gpt_oss(g, u, alpha=1.702, limit=7.0, g_min=None, u_min=-7.0, plus=1):
    """HF GptOssExperts._apply_gate; the constants changeable for the mutations."""
    g, u = g.clamp(min=g_min, max=limit), u.clamp(min=u_min, max=limit)
    return (u + plus) * (g * torch.sigmoid(g * alpha))


def _gelu_new(g, k, c, p):
    """HF NewGELUActivation written out, its constants as arguments (for the mutations)."""
    return 0.5 * g * (1.0 + torch.tanh(c * (g + k * torch.pow(g, p))))


# ---- correct spellings: each must fuse ---------------------------------------------------------------

def silu_llama(g, u):  # HF Llama: act_fn(gate_proj(x)) * up_proj(x)
    return F.silu(g) * u


def sigmoid_form(g, u):  # SiLU written out, operands in the other order
    return u * (torch.sigmoid(g) * g)


def silu_definition(g, u):  # x / (1 + exp(-x))
    return g / (1 + torch.exp(-g)) * u


def gelu_tanh_gemma(g, u):
    return F.gelu(g, approximate="tanh") * u


def gelu_erf(g, u):
    return F.gelu(g) * u


def gelu_new_t5(g, u):  # T5 v1.1 gated-gelu: NewGELUActivation's line as HF writes it
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * torch.pow(g, 3.0)))) * u


def reglu(g, u):
    return F.relu(g) * u


def relu2_bitnet(g, u):  # BitNet relu2, as a power
    return F.relu(g) ** 2 * u


def gpt_oss_clamped(gu):  # gate = gate_up[..., ::2], up = [..., 1::2]; alpha 1.702, limit 7
    return _gpt_oss(gu[..., ::2], gu[..., 1::2])


def _at_bounds():
    """gate_up [2, 5, 96] given directly, with gates and ups exactly at -7, 0 and 7."""
    gu = awkward(2, 5, 2 * I, seed=100) * 10
    gu[0, :, :8], gu[0, :, 8:16], gu[1, :, :6] = 7.0, -7.0, 0.0
    return (gu,)


def packed_chunk_phi3(gu):  # Phi-3: gate_up_proj(x).chunk(2, -1)
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def packed_interleaved_silu(gu):
    return F.silu(gu[..., ::2]) * gu[..., 1::2]


def product_used_twice(x, wg, wu, wd):  # the product read by the down projection and returned
    p = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    return F.linear(p, wd), p


def silu_inplace(g, u):  # on a fresh linear output: read out of place
    return F.silu(g, inplace=True) * u


def mixed_bf16_gate(g, u):  # bf16 gate, fp32 up: fp32 out, act(g) rounded to bf16 as eager stores it
    return F.silu(g.bfloat16()) * u


def up_transposed_layout(x, wg, wu):  # up [2, 5, 48] with strides (240, 1, 5): its rows do not merge
    return F.silu(F.linear(x, wg)) * torch.matmul(wu, x.mT).mT


# ---- packed halves: roles swapped or taken elsewhere (fused or not, eager's value) -------------------

def packed_chunk_up_first(gu):  # up is the first half
    u, g = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def packed_interleaved_swapped(gu):  # act on the odd columns, up the even ones
    return F.silu(gu[..., 1::2]) * gu[..., ::2]


def packed_chunk_batch_dim(gu):  # chunk over the batch ([1, 5, 96] halves), not the last dim
    g, u = gu.chunk(2, dim=0)
    return F.silu(g) * u


def packed_split_40_56(gu):  # off-middle split of 96: gate [.., 40], up the first 40 of [.., 56]
    g, u = gu.split([40, 56], dim=-1)
    return F.silu(g) * u[..., :40]


def packed_chunk3_first_last(gu):  # three-way chunk of 96, gate piece 0, up piece 2
    a, _, c = gu.chunk(3, dim=-1)
    return F.silu(a) * c


def packed_source_mutated(gu):  # the halves are views of gate_up: they see gate_up * 2
    g, u = gu[..., :I], gu[..., I:]
    gu.mul_(2)
    return F.silu(g) * u


# ---- activations other than the variant's (no gated activation computes these) ----------------------

def sigmoid_beta2(g, u):  # x * sigmoid(2x), beta != 1 (no clamps: not gpt-oss either)
    return g * torch.sigmoid(2.0 * g) * u


def sigmoid_shifted(g, u):  # sigmoid(g + 1)
    return g * torch.sigmoid(g + 1) * u


def sigmoid_without_gate(g, u):  # GLU: sigmoid(g) * u, the factor g missing
    return torch.sigmoid(g) * u


def silu_plus_up(g, u):
    return F.silu(g) + u


def silu_definition_wrong_sign(g, u):  # x / (1 + exp(x))
    return g / (1 + torch.exp(g)) * u


def silu_definition_add_alpha(g, u):  # x / (exp(-x) + 2): add's alpha=2 in the denominator
    return g / torch.exp(-g).add(1, alpha=2) * u


def gelu_new_wrong_k(g, u):  # 0.0447 for 0.044715
    return _gelu_new(g, 0.0447, math.sqrt(2.0 / math.pi), 3.0) * u


def gelu_new_square(g, u):  # pow(g, 2) for pow(g, 3)
    return _gelu_new(g, 0.044715, math.sqrt(2.0 / math.pi), 2.0) * u


def relu_cubed(g, u):
    return F.relu(g) ** 3 * u


def leaky_relu_gate(g, u):
    return F.leaky_relu(g, 0.01) * u


def mish_gate(g, u):  # softplus-based: g * tanh(softplus(g))
    return g * torch.tanh(F.softplus(g)) * u


def hardswish_gate(g, u):  # g * hardsigmoid(g)
    return g * F.hardsigmoid(g) * u


# ---- operands regrouped or shared (a gated activation may legitimately compute part of it) -----------

def self_gate(g, u):  # silu(g) * g: gate and up one node
    return F.silu(g) * g


def up_squared(g, u):  # (silu(g) * u) * u
    return F.silu(g) * u * u


def scalar_multiplier(g, u):  # silu(g) * u * 0.5 and silu(g) * 0.5 * u
    return F.silu(g) * u * 0.5, F.silu(g) * 0.5 * u


# ---- gpt-oss clamped, one detail changed --------------------------------------------------------------

def gpt_oss_up_plus_2(gu):
    return _gpt_oss(gu[..., ::2], gu[..., 1::2], plus=2)


def gpt_oss_up_plus_alpha2(gu):  # torch.add(up, 1, alpha=2): up + 2
    g, u = gu[..., ::2].clamp(max=7.0), gu[..., 1::2].clamp(-7.0, 7.0)
    return torch.add(u, 1, alpha=2) * (g * torch.sigmoid(g * 1.702))


def gpt_oss_clamps_swapped(gu):  # gate clamped to [-7, 7], up only to max 7
    g, u = gu[..., ::2].clamp(-7.0, 7.0), gu[..., 1::2].clamp(max=7.0)
    return (u + 1) * (g * torch.sigmoid(g * 1.702))


def gpt_oss_gate_min(gu):  # the gate's bound a min (-7), not a max
    g, u = gu[..., ::2].clamp(min=-7.0), gu[..., 1::2].clamp(-7.0, 7.0)
    return (u + 1) * (g * torch.sigmoid(g * 1.702))


def gpt_oss_alpha_1_5(gu):  # another alpha: exact if fused with 1.5
    return _gpt_oss(gu[..., ::2], gu[..., 1::2], alpha=1.5)


# ---- broadcast, reuse, in-place, grad mode -------------------------------------------------------------

def up_vector_broadcast(x, wg, b):  # up a [48] vector broadcast over [2, 5, 48]
    return F.silu(F.linear(x, wg)) * b


def gate_broadcast_over_t(x, wg, wu):  # gate [2, 1, 48] (the first position) times up [2, 5, 48]
    return F.silu(F.linear(x[:, :1], wg)) * F.linear(x, wu)


def act_also_returned(g, u):
    a = F.silu(g)
    return a * u, a


def sigmoid_inplace_squared(g, u):  # g.sigmoid_() then g * s: sigmoid(g) ** 2 * u
    s = g.sigmoid_()
    return g * s * u


def gate_mutated_after_sigmoid(g, u):  # (g + 1) * sigmoid(g before the write) * u
    s = torch.sigmoid(g)
    g.add_(1)
    return g * s * u


def act_under_no_grad(g, u):  # eager: no gradient through silu(g); g's only one is the "+ g"
    with torch.no_grad():
        a = F.silu(g)
    return a * u + g


def _raw(name, fn, seed, fuses, extra=()):
    """Case of fn(x, wg, wu, *extra) itself."""
    return Case(f"swiglu/{name}", fn, lambda: (awkward(2, 5, 32, seed=seed), randn(I, 32, seed=seed + 1) * 0.4,
                                               randn(I, 32, seed=seed + 2) * 0.4, *extra), fuses)


def gate_written_before(g, u):  # the gate's copy written through a view, then the gated product
    h = g * 1.0
    h[..., :8].zero_()
    return F.silu(h) * u


def up_written_between(g, u):  # the up's copy written after act(gate) is read and before the product
    v = u * 1.0
    a = F.silu(g)
    v[..., :8].mul_(3.0)
    return a * v


CASES: list[Case] = [
    _sep("gate_written_before", gate_written_before, 180, True),
    _sep("up_written_between", up_written_between, 190, None),
    _sep("silu", silu_llama, 10, True),
    _sep("sigmoid_form", sigmoid_form, 20, True),
    _sep("silu_definition", silu_definition, 30, True),
    _sep("gelu_tanh", gelu_tanh_gemma, 40, True),
    _sep("gelu_erf", gelu_erf, 50, True),
    _sep("gelu_new_t5", gelu_new_t5, 60, True),
    _sep("relu", reglu, 70, True),
    _sep("relu2_bitnet", relu2_bitnet, 80, True),
    _pk("gpt_oss_clamped", gpt_oss_clamped, 90, True),
    Case("swiglu/gpt_oss_at_clamp_bounds", gpt_oss_clamped, _at_bounds, True),
    _pk("packed_chunk", packed_chunk_phi3, 110, True),
    _pk("packed_interleaved", packed_interleaved_silu, 120, True),
    _raw("product_used_twice", product_used_twice, 140, True, (randn(32, I, seed=143) * 0.2,)),
    _sep("silu_inplace", silu_inplace, 150, True),
    _sep("mixed_bf16_gate", mixed_bf16_gate, 160, True),
    _raw("up_transposed_layout", up_transposed_layout, 170, True),
    _pk("packed_chunk_up_first", packed_chunk_up_first, 180, None),
    _pk("packed_interleaved_swapped", packed_interleaved_swapped, 190, None),
    _pk("packed_chunk_batch_dim", packed_chunk_batch_dim, 210, None),
    _pk("packed_split_40_56", packed_split_40_56, 220, None),
    _pk("packed_chunk3_first_last", packed_chunk3_first_last, 230, None),
    _pk("packed_source_mutated", packed_source_mutated, 240, None),
    _sep("sigmoid_beta2", sigmoid_beta2, 250, False),
    _sep("sigmoid_shifted", sigmoid_shifted, 260, False),
    _sep("sigmoid_without_gate", sigmoid_without_gate, 270, False),
    _sep("silu_plus_up", silu_plus_up, 280, False),
    _sep("silu_definition_wrong_sign", silu_definition_wrong_sign, 290, False),
    _sep("silu_definition_add_alpha", silu_definition_add_alpha, 300, False),
    _sep("gelu_new_wrong_k", gelu_new_wrong_k, 310, False),
    _sep("gelu_new_square", gelu_new_square, 330, False),
    _sep("relu_cubed", relu_cubed, 340, False),
    _sep("leaky_relu", leaky_relu_gate, 350, False),
    _sep("mish_softplus", mish_gate, 360, False),
    _sep("hardswish", hardswish_gate, 370, False),
    _sep("self_gate", self_gate, 390, None),
    _sep("up_squared", up_squared, 400, None),
    _sep("scalar_multiplier", scalar_multiplier, 410, None),
    _pk("gpt_oss_up_plus_2", gpt_oss_up_plus_2, 420, False),
    _pk("gpt_oss_up_plus_alpha2", gpt_oss_up_plus_alpha2, 430, False),
    _pk("gpt_oss_clamps_swapped", gpt_oss_clamps_swapped, 440, False),
    _pk("gpt_oss_gate_min", gpt_oss_gate_min, 450, False),
    _pk("gpt_oss_alpha_1_5", gpt_oss_alpha_1_5, 470, None),
    Case("swiglu/up_vector_broadcast", up_vector_broadcast,
         lambda: (awkward(2, 5, 32, seed=480), randn(I, 32, seed=481) * 0.4, randn(I, seed=482)), False),
    _raw("gate_broadcast_over_t", gate_broadcast_over_t, 490, False),
    _sep("act_also_returned", act_also_returned, 500, None),
    _sep("sigmoid_inplace_squared", sigmoid_inplace_squared, 510, False),
    _sep("gate_mutated_after_sigmoid", gate_mutated_after_sigmoid, 520, False),
    _sep("act_under_no_grad", act_under_no_grad, 530, None),
]
