"""Post-grad soundness cases of the gated MLP: backwards written over dead buffers (run under Inductor;
tests/soundness_postgrad.py gives the intent, shapes and shared helpers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from soundness import Case, randn
from soundness_postgrad import D, I, _NW, _SQ, _X, _attn_like, _ins, _mlp, _norm, _s

M = "swiglu/"


def llama_mlp(x, wg, wu, wd):
    """HF LlamaMLP: dup over grad_out (gate and up are saved tensors)."""
    return _mlp(x, wg, wu, wd)


def llama_mlp_checkpointed(x, wg, wu, wd):
    """Checkpointed MLP: gate and up recomputed in the backward, dgate over gate and dup over grad_out."""
    return checkpoint(_mlp, x, wg, wu, wd, use_reentrant=False)


def _phi3(x, wgu, wd):
    g, u = F.linear(x, wgu).chunk(2, dim=-1)
    return F.linear(u * F.silu(g), wd)


def phi3_packed_checkpointed(x, wgu, wd):
    """Phi-3 gate_up_proj(x).chunk(2) under checkpointing: d gate_up over the recomputed gate_up."""
    return checkpoint(_phi3, x, wgu, wd, use_reentrant=False)


def _interleaved(x, wgu, wd):
    gu = F.linear(x, wgu)
    return F.linear(F.silu(gu[..., ::2]) * gu[..., 1::2], wd)


def interleaved_packed_checkpointed(x, wgu, wd):
    """gpt-oss-like interleaved gate / up columns of one projection, checkpointed."""
    return checkpoint(_interleaved, x, wgu, wd, use_reentrant=False)


def _gate_up_param_views(x, wgu, wd):
    return F.linear(F.silu(F.linear(x, wgu[:I])) * F.linear(x, wgu[I:]), wd)


def gate_up_param_views_checkpointed(x, wgu, wd):
    """gate and up weights are row halves of one parameter (two matmuls of views), checkpointed."""
    return checkpoint(_gate_up_param_views, x, wgu, wd, use_reentrant=False)


def two_experts_one_down(x, wg1, wu1, wg2, wu2, wd):
    """Two gated MLPs summed before one down projection (a shared expert added in the intermediate
    space): both backwards read the same grad_out buffer, and at most the later may write over it."""
    h = F.silu(F.linear(x, wg1)) * F.linear(x, wu1) + F.silu(F.linear(x, wg2)) * F.linear(x, wu2)
    return F.linear(h, wd)


def two_experts_one_down_checkpointed(x, wg1, wu1, wg2, wu2, wd):
    return checkpoint(two_experts_one_down, x, wg1, wu1, wg2, wu2, wd, use_reentrant=False)


def _gate_read_again(x, wg, wu, wd):
    g, u = F.linear(x, wg), F.linear(x, wu)
    return F.linear(F.silu(g) * u, wd) + (g * g).mean(-1, keepdim=True)


def gate_read_again_checkpointed(x, wg, wu, wd):
    """Checkpointed MLP whose gate is also squared into the output: the backward reads the
    recomputed gate again (2 * g * d), so dgate may go over it only after that read."""
    return checkpoint(_gate_read_again, x, wg, wu, wd, use_reentrant=False)


def _gate_up_read_again(x, wgu, wd):
    gu = F.linear(x, wgu)
    g, u = gu.chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, wd) + gu.pow(2).mean(-1, keepdim=True)


def packed_read_again_checkpointed(x, wgu, wd):
    """Phi-3-like packed MLP whose whole gate_up is also squared into the output, checkpointed: the
    backward reads gate_up for the square's gradient."""
    return checkpoint(_gate_up_read_again, x, wgu, wd, use_reentrant=False)


def up_skip_const(x, wg, wu, wd):
    """A scaled copy of up added in the intermediate space, h = silu(g) * u + 0.1 * u (no
    checkpointing): the backward reads grad_out (dh) for 0.1 * dh before the gated backward and adds
    it to dup after; dup goes over grad_out."""
    g, u = F.linear(x, wg), F.linear(x, wu)
    return F.linear(F.silu(g) * u + 0.1 * u, wd)


def up_skip_learned(x, wg, wu, wd, s):
    """As up_skip_const with a learned per-channel scale s [64]: h = silu(g) * u + u * s."""
    g, u = F.linear(x, wg), F.linear(x, wu)
    return F.linear(F.silu(g) * u + u * s, wd)


def gate_skip_const(x, wg, wu, wd):
    """h = silu(g) * u + 0.1 * g: 0.1 * dh is read before the gated backward (which writes dup over
    dh) and added to dgate after it."""
    g, u = F.linear(x, wg), F.linear(x, wu)
    return F.linear(F.silu(g) * u + 0.1 * g, wd)


def other_projection_skip(x, wg, wu, wz, wd):
    """h = silu(g) * u + 0.1 * z, z another projection of x: 0.1 * dh read before the gated backward,
    by matmuls that also run before it."""
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu) + 0.1 * F.linear(x, wz), wd)


def _gpt_oss_packed(x, wgu, wd):
    gu = F.linear(x, wgu)
    g, u = gu[..., ::2].clamp(max=7.0), gu[..., 1::2].clamp(min=-7.0, max=7.0)
    return F.linear((u + 1) * (g * torch.sigmoid(g * 1.702)), wd)


def gpt_oss_packed_checkpointed(x, wgu, wd):
    """HF GptOssExperts' clamped gate (interleaved columns of gate_up), checkpointed: the clamped
    packed backward writes d gate_up over gate_up. x is scaled by 30 so both clamps bind."""
    return checkpoint(_gpt_oss_packed, x * 30, wgu, wd, use_reentrant=False)


def _gpt_oss_unpacked(x, wg, wu, wd):
    g, u = F.linear(x, wg).clamp(max=7.0), F.linear(x, wu).clamp(min=-7.0, max=7.0)
    return F.linear((u + 1) * (g * torch.sigmoid(g * 1.702)), wd)


def gpt_oss_unpacked_checkpointed(x, wg, wu, wd):
    """gpt-oss's activation on separate gate / up projections, checkpointed (clamped_swiglu_backward_into)."""
    return checkpoint(_gpt_oss_unpacked, x * 30, wg, wu, wd, use_reentrant=False)


def _gemma_mlp(x, wg, wu, wd):
    return F.linear(F.gelu(F.linear(x, wg), approximate="tanh") * F.linear(x, wu), wd)


def gemma_mlp_checkpointed(x, wg, wu, wd):
    """Gemma's gelu_tanh gated MLP, checkpointed."""
    return checkpoint(_gemma_mlp, x, wg, wu, wd, use_reentrant=False)


def gate_detached(x, wg, wu, wd):
    """A stop-gradient gate: the gated backward needs no dgate (dup still over grad_out)."""
    return F.linear(F.silu(F.linear(x, wg).detach()) * F.linear(x, wu), wd)


def up_detached_checkpointed(x, wg, wu, wd):
    """A stop-gradient up under checkpointing: no dup; dgate over the recomputed gate."""
    return checkpoint(lambda a, b, c, d: F.linear(F.silu(F.linear(a, b)) * F.linear(a, c).detach(), d),
                      x, wg, wu, wd, use_reentrant=False)


def _bf16_gate(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg).bfloat16()) * F.linear(x, wu), wd)


def mixed_bf16_gate_checkpointed(x, wg, wu, wd):
    """A bf16 gate with an fp32 up (act(g) rounded to bf16 as eager stores it), checkpointed: dgate
    (bf16) may go over the recomputed bf16 gate, dup (fp32) over grad_out (fp32)."""
    return checkpoint(_bf16_gate, x, wg, wu, wd, use_reentrant=False)


def mlp_output_two_projections(x, wg, wu, wd, wd2):
    """The activation h feeds two down projections: grad_out is their sum (an add output)."""
    h = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    return F.linear(h, wd) + F.linear(h, wd2)


def mlp_grad_out_shared(x, z, wg, wu, wd, wz):
    """The activation is added to another projection before down_proj: one buffer is grad_out of the
    gated backward and the gradient that wz's weight gradient reads."""
    h = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    return F.linear(h + F.linear(z, wz), wd)


def normformer_ffn_norm(x, wg, wu, wn, wd):
    """An RMSNorm on the activation before down_proj (NormFormer's FFN norm): grad_out is the norm's
    dx, a fused op's output."""
    return F.linear(_norm(F.silu(F.linear(x, wg)) * F.linear(x, wu), wn), wd)


def stacked_gates(x, wg, wu, wv, wd):
    """The activation of one gated unit is the gate of a second (dgate of the second is grad_out of
    the first)."""
    h = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    return F.linear(F.silu(h) * F.linear(x, wv), wd)


def stacked_gates_checkpointed(x, wg, wu, wv, wd):
    return checkpoint(stacked_gates, x, wg, wu, wv, wd, use_reentrant=False)


def llama_block(x, w1, wq, wk, wv, wo, w2, wg, wu, wd):
    """A full Llama-like block: attention-like and MLP sub-blocks, each pre-norm with a residual."""
    h = x + F.linear(_attn_like(_norm(x, w1), wq, wk, wv), wo)
    return h + _mlp(_norm(h, w2), wg, wu, wd)


def llama_block_checkpointed(x, w1, wq, wk, wv, wo, w2, wg, wu, wd):
    return checkpoint(llama_block, x, w1, wq, wk, wv, wo, w2, wg, wu, wd, use_reentrant=False)


CASES = [
    Case(M + "llama_mlp", llama_mlp, _ins(_X(110), _s(111, I, D), _s(112, I, D), _s(113, D, I)), True),
    Case(M + "llama_mlp_checkpointed", llama_mlp_checkpointed,
         _ins(_X(114), _s(115, I, D), _s(116, I, D), _s(117, D, I)), True),
    Case(M + "phi3_packed_checkpointed", phi3_packed_checkpointed, _ins(_X(118), _s(119, 2 * I, D), _s(120, D, I)),
         True),
    Case(M + "interleaved_packed_checkpointed", interleaved_packed_checkpointed,
         _ins(_X(121), _s(122, 2 * I, D), _s(123, D, I)), True),
    Case(M + "gate_up_param_views_checkpointed", gate_up_param_views_checkpointed,
         _ins(_X(124), _s(125, 2 * I, D), _s(126, D, I)), True),
    Case(M + "two_experts_one_down", two_experts_one_down,
         _ins(_X(127), _s(128, I, D), _s(129, I, D), _s(130, I, D), _s(131, I, D), _s(132, D, I)), True),
    Case(M + "two_experts_one_down_checkpointed", two_experts_one_down_checkpointed,
         _ins(_X(133), _s(134, I, D), _s(135, I, D), _s(136, I, D), _s(137, I, D), _s(138, D, I)), True),
    Case(M + "gate_read_again_checkpointed", gate_read_again_checkpointed,
         _ins(_X(139), _s(140, I, D), _s(141, I, D), _s(142, D, I)), True),
    Case(M + "packed_read_again_checkpointed", packed_read_again_checkpointed,
         _ins(_X(143), _s(144, 2 * I, D), _s(145, D, I)), True),
    Case(M + "up_skip_const", up_skip_const, _ins(_X(192), _s(193, I, D), _s(194, I, D), _s(195, D, I)), True),
    Case(M + "up_skip_learned", up_skip_learned,
         _ins(_X(196), _s(197, I, D), _s(198, I, D), _s(199, D, I), lambda: randn(I, seed=250)), True),
    Case(M + "gate_skip_const", gate_skip_const, _ins(_X(251), _s(252, I, D), _s(253, I, D), _s(254, D, I)), True),
    Case(M + "other_projection_skip", other_projection_skip,
         _ins(_X(255), _s(256, I, D), _s(257, I, D), _s(258, I, D), _s(259, D, I)), True),
    Case(M + "gpt_oss_packed_checkpointed", gpt_oss_packed_checkpointed,
         _ins(_X(272), _s(273, 2 * I, D, scale=0.05), _s(274, D, I)), True),
    Case(M + "gpt_oss_unpacked_checkpointed", gpt_oss_unpacked_checkpointed,
         _ins(_X(275), _s(276, I, D, scale=0.05), _s(277, I, D, scale=0.05), _s(278, D, I)), True),
    Case(M + "gemma_mlp_checkpointed", gemma_mlp_checkpointed,
         _ins(_X(279), _s(280, I, D), _s(281, I, D), _s(282, D, I)), True),
    Case(M + "gate_detached", gate_detached, _ins(_X(283), _s(284, I, D), _s(285, I, D), _s(286, D, I)), True),
    Case(M + "up_detached_checkpointed", up_detached_checkpointed,
         _ins(_X(287), _s(288, I, D), _s(289, I, D), _s(290, D, I)), True),
    Case(M + "mixed_bf16_gate_checkpointed", mixed_bf16_gate_checkpointed,
         _ins(_X(291), _s(292, I, D), _s(293, I, D), _s(294, D, I)), True),
    Case(M + "mlp_output_two_projections", mlp_output_two_projections,
         _ins(_X(146), _s(147, I, D), _s(148, I, D), _s(149, D, I), _s(150, D, I)), True),
    Case(M + "mlp_grad_out_shared", mlp_grad_out_shared,
         _ins(_X(151), _X(152), _s(153, I, D), _s(154, I, D), _s(155, D, I), _s(156, I, D)), True),
    Case(M + "normformer_ffn_norm", normformer_ffn_norm,
         _ins(_X(157), _s(158, I, D), _s(159, I, D), lambda: randn(I, seed=160) + 1, _s(161, D, I)), True),
    Case(M + "stacked_gates", stacked_gates, _ins(_X(162), _s(163, I, D), _s(164, I, D), _s(165, I, D), _s(166, D, I)),
         True),
    Case(M + "stacked_gates_checkpointed", stacked_gates_checkpointed,
         _ins(_X(167), _s(168, I, D), _s(169, I, D), _s(170, I, D), _s(171, D, I)), True),
    Case(M + "llama_block", llama_block,
         _ins(_X(172), _NW(173), _SQ(174), _SQ(175), _SQ(176), _SQ(177), _NW(178), _s(179, I, D), _s(180, I, D),
              _s(181, D, I)), True),
    Case(M + "llama_block_checkpointed", llama_block_checkpointed,
         _ins(_X(182), _NW(183), _SQ(184), _SQ(185), _SQ(186), _SQ(187), _NW(188), _s(189, I, D), _s(190, I, D),
              _s(191, D, I)), True),
]
