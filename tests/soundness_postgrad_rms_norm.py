"""Post-grad soundness cases of RMSNorm: the residual-gradient add and dy's sum folded into the
backward (run under Inductor; tests/soundness_postgrad.py gives the intent, shapes and shared helpers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from soundness import Case, awkward, randn
from soundness_postgrad import D, EPS, I, _NW, _SQ, _X, _attn_like, _ins, _mlp, _norm, _s

N = "rms_norm/"


def prenorm_one_matmul(x, w, wo):
    """h = x + o_proj(norm(x)): dx + d_residual folds; dy is a single matmul gradient (no sum)."""
    return x + F.linear(_norm(x, w), wo)


def prenorm_residual_second(x, w, wo):
    """The residual add written the other way round: f(norm(x)) + x (add(d_residual, dx) in backward)."""
    return F.linear(_norm(x, w), wo) + x


def prenorm_qkv(x, w, wq, wk, wv, wo):
    """Attention-like block: norm output feeds q, k, v (dy = three addends) and the residual adds."""
    return x + F.linear(_attn_like(_norm(x, w), wq, wk, wv), wo)


def prenorm_two_branches(x, w, wa, wb):
    """Norm output feeds two matmuls (dy = two addends)."""
    n = _norm(x, w)
    return x + torch.tanh(F.linear(n, wa)) * F.linear(n, wb)


def prenorm_four_matmuls(x, w, wq, wk, wv, wr):
    """Norm output feeds four matmuls (q, k, v and a router / gate): dy has four addends, one more
    than the folded op takes."""
    n = _norm(x, w)
    return x + _attn_like(n, wq, wk, wv) * torch.sigmoid(F.linear(n, wr))


def prenorm_output_also_pointwise(x, w, wo, s):
    """The norm output feeds a matmul and a pointwise scale (s [32]): dy = mm gradient + mul gradient."""
    n = _norm(x, w)
    return x + F.linear(n, wo) + n * s


def prenorm_output_returned(x, w, wq, wk, wv):
    """The norm output is also returned (as a hidden state): its own gradient is a third addend,
    a graph input of the backward."""
    n = _norm(x, w)
    return x + _attn_like(n, wq, wk, wv), n


def prenorm_same_linear_twice(x, w, wo):
    """The same projection of the norm output used twice: its two gradients may be one node (add(a, a))."""
    n = _norm(x, w)
    return x + F.linear(n, wo) * F.linear(n, wo)


def residual_read_elsewhere(x, w, wo, s):
    """x also scaled into a second output: x's gradient sums three terms (dx, d_residual, s * d_out2)."""
    return x + F.linear(_norm(x, w), wo), x * s


def residual_subtracted(x, w, wo):
    """h = x - f(norm(x)): the branch gradient is negated before the matmul backward."""
    return x - F.linear(_norm(x, w), wo)


def residual_branch_minus_x(x, w, wo):
    """h = f(norm(x)) - x: d_residual is -dh, a neg (or a sub with dx) in the backward."""
    return F.linear(_norm(x, w), wo) - x


def residual_alpha(x, w, wo):
    """torch.add(x, f(norm(x)), alpha=0.5)."""
    return torch.add(x, F.linear(_norm(x, w), wo), alpha=0.5)


def residual_scaled_stream(x, w, wo):
    """DeepNet-style scaled residual: h = 2.5 * x + f(norm(x)) (d_residual is 2.5 * dh)."""
    return 2.5 * x + F.linear(_norm(x, w), wo)


def residual_x_times_x(x, w, wo):
    """A nonlinear use of x beside the norm: h = x * x + f(norm(x)) (d_residual reads x)."""
    return x * x + F.linear(_norm(x, w), wo)


def two_norms_one_input(x, w1, w2, wa, wb):
    """GPT-NeoX-like parallel block with two norms of the same x: dx1 + dx2 + d_residual."""
    return x + F.linear(_norm(x, w1), wa) + F.linear(_norm(x, w2), wb)


def parallel_block_one_norm(x, w, wq, wk, wv, wg, wu, wd):
    """GPT-J / PaLM parallel block: one norm feeds attention (q, k, v) and the MLP (gate, up): five
    addends in dy."""
    n = _norm(x, w)
    return x + _attn_like(n, wq, wk, wv) + _mlp(n, wg, wu, wd)


def shared_norm_weight(x, w, wa, wb):
    """Two pre-norm blocks sharing one norm weight (ALBERT-like tying): dw1 + dw2 in the backward."""
    h = x + F.linear(_norm(x, w), wa)
    return h + F.linear(_norm(h, w), wb)


def two_blocks_final_norm(x, w1, w2, wf, wa, wb):
    """Two pre-norm blocks then the final norm: the final norm's dx also feeds the last block's
    matmul backward."""
    h = x + F.linear(_norm(x, w1), wa)
    h = h + F.linear(_norm(h, w2), wb)
    return _norm(h, wf)


def norm_no_weight(x, wo):
    """F.rms_norm without a weight (OLMo-like): no dw, dx + d_residual folds."""
    return x + F.linear(F.rms_norm(x, (D,), None, EPS), wo)


def gemma_offset_norm(x, w, wo):
    """Gemma's (1 + w) norm in a pre-norm block."""
    h = x.float()
    n = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())).type_as(x)
    return x + F.linear(n, wo)


def token_mixing_residual(x, w, wo, m):
    """An MLP-Mixer-like token mix beside the norm: x's gradient from m.T @ d_out arrives as a
    transposed (non-contiguous) tensor, added to the norm's dx."""
    return x + F.linear(_norm(x, w), wo) + (x.transpose(1, 2) @ m).transpose(1, 2)


def transposed_branch_gradient(x, w, wo, m):
    """The norm output feeds a matmul and a token mix through a transpose: one dy addend is not
    contiguous."""
    n = _norm(x, w)
    return x + F.linear(n, wo) + (n.transpose(1, 2) @ m).transpose(1, 2)


def mla_slice_norm(x, w, wo):
    """DeepSeek MLA-like: the norm of a slice of a wider projection (rows of stride 64), residual in
    the slice's space; the slice's gradient is scattered back."""
    kv, pe = x.split([D, D], dim=-1)
    return kv + F.linear(_norm(kv, w), wo), pe * 2


def post_and_pre_norm(x, w1, w2, wo):
    """Gemma2 / OLMo2-like sandwich: h = x + post_norm(o_proj(pre_norm(x)))."""
    return x + _norm(F.linear(_norm(x, w1), wo), w2)


def expanded_input_norm(x0, w, wo):
    """A norm of an input broadcast over the batch ([1, 5, 32] expanded to [2, 5, 32]): dx is
    summed over the batch before it meets the residual gradient."""
    x = x0.expand(2, 5, D)
    return x + F.linear(_norm(x, w), wo)


def frozen_norm_weight(x, w, wq, wk, wv, wo):
    """LoRA-style frozen norm weight (detached): the backward computes no dw; both adds still fold."""
    return x + F.linear(_attn_like(_norm(x, w.detach()), wq, wk, wv), wo)


def wide_rows(x, w, s1, s2):
    """Rows of 8200 elements (the split backward, which sums dy and adds the residual by separate
    adds): x [1, 2, 8200], the norm output feeds two pointwise branches."""
    n = F.rms_norm(x, (x.shape[-1],), w, EPS)
    return x + n * s1 + torch.tanh(n) * s2


def single_row(x, w, wq, wk, wv, wo):
    """One token: x [1, 1, 32]."""
    return x + F.linear(_attn_like(_norm(x, w), wq, wk, wv), wo)


def norm_output_as_up(x, w, wg, wd):
    """The normalised x is itself the gated unit's up (h = silu(gate_proj(n)) * n): dy sums dup
    (written over grad_out) and the gate projection's input gradient."""
    n = _norm(x, w)
    return x + F.linear(F.silu(F.linear(n, wg)) * n, wd)


def prenorm_checkpointed(x, w, wq, wk, wv, wo):
    """The attention-like block under activation checkpointing (norm and projections recomputed)."""
    return checkpoint(prenorm_qkv, x, w, wq, wk, wv, wo, use_reentrant=False)


CASES = [
    Case(N + "prenorm_one_matmul", prenorm_one_matmul, _ins(_X(1), _NW(2), _SQ(3)), True),
    Case(N + "prenorm_residual_second", prenorm_residual_second, _ins(_X(4), _NW(5), _SQ(6)), True),
    Case(N + "prenorm_qkv", prenorm_qkv, _ins(_X(7), _NW(8), _SQ(9), _SQ(10), _SQ(11), _SQ(12)), True),
    Case(N + "prenorm_two_branches", prenorm_two_branches, _ins(_X(13), _NW(14), _SQ(15), _SQ(16)), True),
    Case(N + "prenorm_four_matmuls", prenorm_four_matmuls,
         _ins(_X(17), _NW(18), _SQ(19), _SQ(20), _SQ(21), _SQ(22)), True),
    Case(N + "prenorm_output_also_pointwise", prenorm_output_also_pointwise,
         _ins(_X(23), _NW(24), _SQ(25), _NW(26)), True),
    Case(N + "prenorm_output_returned", prenorm_output_returned, _ins(_X(27), _NW(28), _SQ(29), _SQ(30), _SQ(31)),
         True),
    Case(N + "prenorm_same_linear_twice", prenorm_same_linear_twice, _ins(_X(32), _NW(33), _SQ(34)), True),
    Case(N + "residual_read_elsewhere", residual_read_elsewhere, _ins(_X(35), _NW(36), _SQ(37), _NW(38)), True),
    Case(N + "residual_subtracted", residual_subtracted, _ins(_X(39), _NW(40), _SQ(41)), True),
    Case(N + "residual_branch_minus_x", residual_branch_minus_x, _ins(_X(42), _NW(43), _SQ(44)), True),
    Case(N + "residual_alpha", residual_alpha, _ins(_X(45), _NW(46), _SQ(47)), True),
    Case(N + "residual_scaled_stream", residual_scaled_stream, _ins(_X(48), _NW(49), _SQ(50)), True),
    Case(N + "residual_x_times_x", residual_x_times_x, _ins(_X(51), _NW(52), _SQ(53)), True),
    Case(N + "two_norms_one_input", two_norms_one_input, _ins(_X(54), _NW(55), _NW(56), _SQ(57), _SQ(58)), True),
    Case(N + "parallel_block_one_norm", parallel_block_one_norm,
         _ins(_X(59), _NW(60), _SQ(61), _SQ(62), _SQ(63), _s(64, I, D), _s(65, I, D), _s(66, D, I)), True),
    Case(N + "shared_norm_weight", shared_norm_weight, _ins(_X(67), _NW(68), _SQ(69), _SQ(70)), True),
    Case(N + "two_blocks_final_norm", two_blocks_final_norm,
         _ins(_X(71), _NW(72), _NW(73), _NW(74), _SQ(75), _SQ(76)), True),
    Case(N + "norm_no_weight", norm_no_weight, _ins(_X(77), _SQ(78)), True),
    Case(N + "gemma_offset_norm", gemma_offset_norm, _ins(_X(79), lambda: randn(D, seed=80) * 0.3, _SQ(81)), True),
    Case(N + "token_mixing_residual", token_mixing_residual, _ins(_X(82), _NW(83), _SQ(84), _s(85, 5, 5, scale=0.4)),
         True),
    Case(N + "transposed_branch_gradient", transposed_branch_gradient,
         _ins(_X(86), _NW(87), _SQ(88), _s(89, 5, 5, scale=0.4)), True),
    Case(N + "mla_slice_norm", mla_slice_norm, _ins(lambda: awkward(2, 5, 2 * D, seed=90), _NW(91), _SQ(92)), True),
    Case(N + "post_and_pre_norm", post_and_pre_norm, _ins(_X(93), _NW(94), _NW(95), _SQ(96)), True),
    Case(N + "expanded_input_norm", expanded_input_norm, _ins(lambda: awkward(1, 5, D, seed=97), _NW(98), _SQ(99)),
         True),
    Case(N + "frozen_norm_weight", frozen_norm_weight,
         _ins(_X(106), _NW(107), _SQ(108), _SQ(109), _SQ(260), _SQ(261)), True),
    Case(N + "wide_rows", wide_rows, _ins(lambda: awkward(1, 2, 8200, seed=262), lambda: randn(8200, seed=263) + 1,
                                          lambda: randn(8200, seed=264), lambda: randn(8200, seed=265)), True),
    Case(N + "single_row_prenorm_block", single_row,
         _ins(lambda: awkward(1, 1, D, seed=266), _NW(267), _SQ(268), _SQ(269), _SQ(270), _SQ(271)), True),
    Case(N + "norm_output_as_up", norm_output_as_up,
         _ins(_X(317), _NW(318), _SQ(319), _SQ(320)), True),
    Case(N + "prenorm_checkpointed", prenorm_checkpointed,
         _ins(_X(100), _NW(101), _SQ(102), _SQ(103), _SQ(104), _SQ(105)), True),
]
