"""Soundness cases of the loss head (pattern "linear_cross_entropy"): ``cross_entropy(linear(x, W), t)``
spelled as models spell it (fuses=True), or changed in one detail the fused op cannot express: the class
dim read elsewhere, rows and classes mixed by a layout op, class weights, soft labels, a per-row scale
or bias, a log_softmax over the wrong dim (fuses=False). None where a fused head could compute the change
(a vocabulary slice, an off-by-one label shift, a softcap whose constants differ, logits read by another
term): parity decides.

Shapes: x [2, 8, 16] or [16, 16] (randn * 0.5, so the losses are not saturated), W [40, 16] (V = 40),
int64 targets in [0, 40) with a few -100 (ignored). Cases about the layout use N == V or T == V, so a
head that reads the wrong axis still runs and gives a wrong number rather than an error.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import Case, awkward, randn

V, H = 40, 16
P = "linear_cross_entropy/"


def _x(*shape, seed):
    return randn(*shape, seed=seed) * 0.5


def _quarters(*shape, seed):  # integers in [-20, 20] / 4
    return torch.randint(-20, 21, shape, generator=torch.Generator().manual_seed(seed)).float() / 4


def _w(seed, v=V):
    return randn(v, H, seed=seed) * 0.5


def _t(*shape, seed, v=V, ignore=True):
    """Class indices in [0, v); every 5th -100 where ignore."""
    t = torch.randint(0, v, shape, generator=torch.Generator().manual_seed(seed))
    if ignore:
        t.view(-1)[::5] = -100
    return t


def _xwt(xs, ts, seed, **kw):  # (x xs, W [40, 16], targets ts)
    return lambda: (_x(*xs, seed=seed), _w(seed + 1), _t(*ts, seed=seed + 2, **kw))


def _in3(seed, **kw):  # x [2, 8, 16], t [16]
    return _xwt((2, 8, H), (16,), seed, **kw)


def _in2(seed, **kw):  # x [16, 16], t [16]
    return _xwt((16, H), (16,), seed, **kw)


def _in_t2d(seed, **kw):  # x [2, 8, 16], t [2, 8]
    return _xwt((2, 8, H), (2, 8), seed, **kw)


def _with(extra, seed, xs=(2, 8, H), ts=(16,)):  # (x, W, extra(seed), t): a bias, a scale or a reference
    return lambda: (_x(*xs, seed=seed), _w(seed + 1), extra(seed + 2), _t(*ts, seed=seed + 3))


def _case(what, fn, inputs, fuses):
    return Case(P + what, fn, inputs, fuses)


# ---- correct spellings: each must fuse ----
def hf_for_causal_lm(x, w, t):  # HF ForCausalLMLoss: logits.float().view(-1, V)
    z = F.linear(x, w).float()
    return F.cross_entropy(z.view(-1, z.shape[-1]), t.view(-1), ignore_index=-100)


def nanogpt_matmul_t(x, w, t):  # x [16, 16] @ W.t(): 2-D hidden states, no cast
    return F.cross_entropy(x @ w.t(), t)


def biased_lm_head(x, w, b, t):  # b [40]
    return F.cross_entropy(F.linear(x, w, b).view(-1, V), t)


def bart_final_logits_bias(x, w, b, t):  # b [1, 40] buffer added on its own
    return F.cross_entropy((F.linear(x, w) + b).view(-1, V), t)


def bias_after_cast(x, w, b, t):  # b [40] added after .float() (a no-op cast in fp32)
    return F.cross_entropy((F.linear(x, w).float() + b).view(-1, V), t)


def gemma2_softcap(x, w, t):  # tanh(z / 30) * 30; x scaled up so the cap bends the logits
    return F.cross_entropy((torch.tanh(F.linear(x * 20, w) / 30.0) * 30.0).view(-1, V), t)


def cohere_scale(x, w, t):
    return F.cross_entropy((F.linear(x, w) * 2.0).flatten(0, 1), t)


def ngpt_vocab_scale(x, w, s, t):  # s [40]: one scale per vocabulary entry
    return F.cross_entropy((F.linear(x, w) * s).view(-1, V), t)


def modded_nanogpt_sigmoid(x, w, t):  # 30 * sigmoid(z / 7.5): a shifted softcap
    return F.cross_entropy((30 * torch.sigmoid(F.linear(x * 10, w).float() / 7.5)).view(-1, V), t)


def class_dim_second(x, w, t2d):  # [2, 40, 8] logits, [2, 8] targets
    return F.cross_entropy(F.linear(x, w).transpose(1, 2), t2d)


def labels_shift_by_hand(x, w, t2d):  # z[:, :-1] predicts t[:, 1:]
    return F.cross_entropy(F.linear(x, w)[:, :-1].reshape(-1, V), t2d[:, 1:].reshape(-1))


def reduction_none_label_smoothing(x, w, t):  # per-token losses [16], ignored rows 0
    return F.cross_entropy(F.linear(x, w).view(-1, V), t, reduction="none", label_smoothing=0.2)


def hf_num_items_in_batch(x, w, t):  # sum / num_items_in_batch, the division outside the site
    return F.cross_entropy(F.linear(x, w).view(-1, V), t, reduction="sum") / (t != -100).sum()


def ignore_index_present_label(x, w, t):  # ignore_index=3 and label 3 occurs (targets have no -100)
    t = torch.where(torch.arange(t.numel(), device=t.device) % 4 == 0, 3, t)
    return F.cross_entropy(F.linear(x, w), t, ignore_index=3)


def none_then_mask_other_than_ignore(x, w, t):  # masked mean over t != 3, ignore_index -100 as usual
    loss = F.cross_entropy(F.linear(x, w).view(-1, V), t, reduction="none")
    mask = (t != 3).float()
    return (loss * mask).sum() / mask.sum()


def fairseq_nll_log_softmax(x, w, t):
    return F.nll_loss(F.log_softmax(F.linear(x, w), dim=-1), t)


def nanochat_padded_vocab(x, w, t):  # W [40, 16] padded past a vocabulary of 39: z[..., :39]
    return F.cross_entropy(F.linear(x, w)[..., :V - 1].reshape(-1, V - 1), t)


def tied_embedding(ids, w, t):  # W is the embedding table and the lm_head; ids [2, 8] in [0, 40)
    h = torch.tanh(F.embedding(ids, w))
    return F.cross_entropy(F.linear(h, w).view(-1, V), t)


def verl_logps_gather(x, w, t2d):  # per-token log-probs [2, 8] (t2d has no -100: gather raises)
    return F.log_softmax(F.linear(x, w), dim=-1).gather(-1, t2d[..., None]).squeeze(-1)


def trl_logps_logsumexp(x, w, t2d):
    z = F.linear(x, w)
    return z.gather(-1, t2d.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)


def rl_temperature_logps(x, w, t2d):  # log_softmax(z.float() / 0.7) as TRL / verl sample
    return F.log_softmax(F.linear(x, w).float() / 0.7, -1).gather(-1, t2d[..., None]).squeeze(-1)


def grpo_ratio_minus_detached(x, w, t2d):  # exp(lp - lp.detach()): the ratio's gradient, value 1
    lp = F.log_softmax(F.linear(x, w), -1).gather(-1, t2d[..., None]).squeeze(-1)
    # advantages in [0.5, 1.5]: a symmetric ramp made the loss 0 up to rounding, no relative error to compare
    return -(torch.exp(lp - lp.detach()) * torch.linspace(0.5, 1.5, lp.numel(), device=lp.device).view_as(lp)).mean()


# ---- layout: the class dim must be the lm_head's output dim ----
def transpose_2d_classes_become_rows(x, w, t):  # x [40, 16]: z.T [40 vocab rows, 40 tokens as classes]
    return F.cross_entropy(F.linear(x, w).transpose(0, 1), t)


def transpose_then_reshape_time_classes(x, w, t):  # x [2, 40, 16]: [2, 40, 40] -> [80, 40] over tokens
    return F.cross_entropy(F.linear(x, w).transpose(1, 2).reshape(-1, 40), t)


def transpose_4d_inner_dims(x, w, t3d):  # x [2, 40, 3, 16] -> [2, 40, 40, 3]: classes are x's dim 1
    return F.cross_entropy(F.linear(x, w).transpose(2, 3), t3d)


def permute_rows_then_reshape(x, w, t):  # [8, 2, 40] -> [16, 40]: rows reordered against t
    return F.cross_entropy(F.linear(x, w).transpose(0, 1).reshape(-1, V), t)


def view_vocab_first_nonsense(x, w, t):  # z [16, 40] viewed [40, 16]; t [40] in [0, 16)
    return F.cross_entropy(F.linear(x, w).view(V, -1), t)


def class_dim_second_slice_classes(x, w, t2d):  # [2, 40, 8][:, :39]: classes sliced, not rows
    return F.cross_entropy(F.linear(x, w).transpose(1, 2)[:, :V - 1], t2d)


def class_dim_second_slice_time(x, w, t2d):  # [2, 40, 8][:, :, :-1]: rows sliced after the transpose
    return F.cross_entropy(F.linear(x, w).transpose(1, 2)[:, :, :-1], t2d[:, :-1])


def matmul_without_transpose(x, w16x40, t):  # x @ W with W [16, 40]: the same logits as linear(x, W.t())
    return F.cross_entropy((x @ w16x40).view(-1, V), t)


def logps_of_transposed_logits(x, w, idx):  # x [40, 16]: log_softmax over the tokens of each vocab row
    return F.log_softmax(F.linear(x, w).transpose(0, 1), -1).gather(-1, idx[:, None]).squeeze(-1)


def cross_entropy_of_3d_logits(x, w, t2d):  # x [2, 40, 16], z [2, 40, 40] unflattened: CE's classes are T
    return F.cross_entropy(F.linear(x, w), t2d)


# ---- the vocabulary columns ----
def vocab_drop_last_negative_end(x, w, t):  # z[..., :-1] (end -1, not V - 1)
    return F.cross_entropy(F.linear(x, w)[..., :-1].reshape(-1, V - 1), t)


def vocab_drop_first(x, w, t):  # z[..., 1:], classes shifted by one
    return F.cross_entropy(F.linear(x, w)[..., 1:].reshape(-1, V - 1), t)


# ---- cross_entropy's arguments ----
def class_weights(x, w, t):  # weight [40] (a constant: nll_loss has no gradient for it); the fused head has none
    return F.cross_entropy(F.linear(x, w).view(-1, V), t, weight=torch.linspace(0.2, 2.0, V, device=x.device))


def soft_labels(x, w, probs):  # float targets [16, 40]
    return F.cross_entropy(F.linear(x, w).view(-1, V), probs)


def logps_log_softmax_over_rows(x, w, t):  # t [16] in [0, 40): the wrong dim then a gather
    return F.log_softmax(F.linear(x, w), dim=0).gather(-1, t[:, None]).squeeze(-1)


def logps_gather_dim0(x, w, idx):  # idx [1, 40] in [0, 16): one token per vocabulary column
    return F.log_softmax(F.linear(x, w), -1).gather(0, idx)


def logps_logsumexp_over_rows(x, w, t):  # [16, 1] - [1, 40]: a [16, 40] table
    z = F.linear(x, w)
    return z.gather(-1, t[:, None]) - z.logsumexp(0, keepdim=True)


def logps_fewer_index_rows(x, w, t):  # x [16, 16], index [8, 1]: gather reads the first 8 rows
    return F.log_softmax(F.linear(x, w), -1).gather(-1, t[:8, None]).squeeze(-1)


# ---- transforms of the logits ----
def softcap_constants_differ(x, w, t):  # tanh(z / 30) * 20
    return F.cross_entropy((torch.tanh(F.linear(x * 20, w) / 30.0) * 20.0).view(-1, V), t)


def per_row_scale(x, w, s, t):  # s [16, 1]: one scale per token, no per-vocabulary one
    return F.cross_entropy(F.linear(x, w) * s, t)


def per_token_bias(x, w, b, t):  # b [16, 40]
    return F.cross_entropy(F.linear(x, w) + b, t)


def stabilised_by_hand(x, w, t):  # z - max(z): the same cross-entropy
    z = F.linear(x, w)
    return F.cross_entropy((z - z.amax(-1, keepdim=True)).view(-1, V), t)


def temperature_tensor(x, w, temp, t):  # temp: a 0-dim tensor
    return F.cross_entropy((F.linear(x, w) / temp).view(-1, V), t)


def through_bf16(x, w, t):  # fp32 logits rounded to bf16 then back: the rounding is part of the result
    return F.cross_entropy(F.linear(x, w).bfloat16().float().view(-1, V), t)


# ---- logits read again (returned logits: tests/test_linear_cross_entropy_graph.py's guard test) ----
def logits_masked_in_place(x, w, t):  # padded vocabulary entries set to -inf in place before the loss
    z = F.linear(x, w)
    z[..., 36:] = float("-inf")
    return F.cross_entropy(z.view(-1, V), t)


def entropy_bonus(x, w, t):  # softmax of the same logits: loss - 0.01 * entropy
    z = F.linear(x, w)
    p = z.softmax(-1)
    return F.cross_entropy(z.view(-1, V), t) + 0.01 * (p * p.clamp_min(1e-9).log()).sum(-1).mean()


def detached_logits_in_kl(x, w, ref, t):  # KL(ref || softmax(z.detach())): a value-only term
    z = F.linear(x, w)
    kl = F.kl_div(F.log_softmax(z.detach(), -1), ref.softmax(-1), reduction="batchmean")
    return F.cross_entropy(z.view(-1, V), t) + kl


# ---- label shift off by one ----
def shift_both_forward(x, w, t2d):  # z[:, 1:] with t[:, 1:]: each row its own token
    return F.cross_entropy(F.linear(x, w)[:, 1:].reshape(-1, V), t2d[:, 1:].reshape(-1))


def shift_reversed(x, w, t2d):  # z[:, 1:] with t[:, :-1]: each row predicts the previous token
    return F.cross_entropy(F.linear(x, w)[:, 1:, :].reshape(-1, V), t2d[:, :-1].reshape(-1))


CASES: list[Case] = [
    _case("hf_for_causal_lm", hf_for_causal_lm, _in3(10), True),
    _case("nanogpt_matmul_t", nanogpt_matmul_t, _in2(20), True),
    _case("biased_lm_head", biased_lm_head, _with(lambda s: randn(V, seed=s), 30), True),
    _case("bart_final_logits_bias", bart_final_logits_bias, _with(lambda s: randn(1, V, seed=s), 40), True),
    _case("bias_after_cast", bias_after_cast, _with(lambda s: randn(V, seed=s), 44), True),
    _case("gemma2_softcap", gemma2_softcap, _in3(50), True),
    _case("cohere_scale", cohere_scale, _in3(60), True),
    _case("ngpt_vocab_scale", ngpt_vocab_scale, _with(lambda s: awkward(V, seed=s).abs() + 0.5, 80), True),
    _case("modded_nanogpt_sigmoid", modded_nanogpt_sigmoid, _in3(90), True),
    _case("class_dim_second", class_dim_second, _in_t2d(100), True),
    _case("labels_shift_by_hand", labels_shift_by_hand, _in_t2d(120), True),
    _case("reduction_none_label_smoothing", reduction_none_label_smoothing, _in2(140), True),
    _case("hf_num_items_in_batch", hf_num_items_in_batch, _in3(150), True),
    _case("ignore_index_present_label", ignore_index_present_label, _in2(160, ignore=False), True),
    _case("none_then_mask_other_than_ignore", none_then_mask_other_than_ignore, _in3(170), True),
    _case("fairseq_nll_log_softmax", fairseq_nll_log_softmax, _in2(180), True),
    _case("nanochat_padded_vocab", nanochat_padded_vocab, _in3(190, v=V - 1), True),
    _case("tied_embedding", tied_embedding, lambda: (_t(2, 8, seed=200, ignore=False), _w(201), _t(16, seed=202)),
          True),
    _case("verl_logps_gather", verl_logps_gather, _in_t2d(210, ignore=False), True),
    _case("trl_logps_logsumexp", trl_logps_logsumexp, _in_t2d(220, ignore=False), True),
    _case("rl_temperature_logps", rl_temperature_logps, _in_t2d(230, ignore=False), True),
    _case("grpo_ratio_minus_detached", grpo_ratio_minus_detached, _in_t2d(240, ignore=False), True),
    # layout: N == V or T == V where the wrong axis would still run
    _case("transpose_2d_classes_become_rows", transpose_2d_classes_become_rows, _xwt((V, H), (V,), 300), False),
    _case("transpose_then_reshape_time_classes", transpose_then_reshape_time_classes,
          _xwt((2, V, H), (2 * V,), 310), False),
    _case("transpose_4d_inner_dims", transpose_4d_inner_dims, _xwt((2, V, 3, H), (2, V, 3), 315), False),
    _case("permute_rows_then_reshape", permute_rows_then_reshape, _in3(320), False),
    _case("view_vocab_first_nonsense", view_vocab_first_nonsense, _xwt((16, H), (V,), 325, v=16), False),
    _case("class_dim_second_slice_classes", class_dim_second_slice_classes, _in_t2d(330, v=V - 1), False),
    _case("class_dim_second_slice_time", class_dim_second_slice_time, _in_t2d(335), None),
    _case("matmul_without_transpose", matmul_without_transpose,
          lambda: (_x(2, 8, H, seed=340), randn(H, V, seed=341) * 0.5, _t(16, seed=342)), None),
    _case("logps_of_transposed_logits", logps_of_transposed_logits, _xwt((V, H), (V,), 345, ignore=False), False),
    _case("cross_entropy_of_3d_logits", cross_entropy_of_3d_logits, _xwt((2, V, H), (2, V), 351), False),
    # vocabulary columns
    _case("vocab_drop_last_negative_end", vocab_drop_last_negative_end, _in3(360, v=V - 1), None),
    _case("vocab_drop_first", vocab_drop_first, _in3(365, v=V - 1), None),
    # cross_entropy's arguments
    _case("class_weights", class_weights, _in3(400), False),
    _case("soft_labels", soft_labels, lambda: (_x(2, 8, H, seed=405), _w(406), randn(16, V, seed=407).softmax(-1)),
          False),
    _case("logps_log_softmax_over_rows", logps_log_softmax_over_rows, _in2(415, ignore=False), False),
    _case("logps_gather_dim0", logps_gather_dim0, _xwt((16, H), (1, V), 420, v=16, ignore=False), False),
    _case("logps_logsumexp_over_rows", logps_logsumexp_over_rows, _in2(425, ignore=False), False),
    _case("logps_fewer_index_rows", logps_fewer_index_rows, _in2(430, ignore=False), None),
    # transforms
    _case("softcap_constants_differ", softcap_constants_differ, _in3(500), None),
    _case("per_row_scale", per_row_scale, _with(lambda s: awkward(16, 1, seed=s).abs() + 0.5, 510, xs=(16, H)), False),
    _case("per_token_bias", per_token_bias, _with(lambda s: randn(16, V, seed=s), 515, xs=(16, H)), False),
    _case("stabilised_by_hand", stabilised_by_hand, _in3(525), None),
    _case("temperature_tensor", temperature_tensor, _with(lambda s: torch.tensor(0.7), 530), None),
    # x, W in quarters of small integers: the logits are exact in fp32 whatever the summation order (an fp32
    # difference of one bit would become a bf16 step after the rounding), and their rounding to bf16 is not
    _case("through_bf16", through_bf16, lambda: (_quarters(2, 8, H, seed=540), _quarters(V, H, seed=541),
                                                 _t(16, seed=542)), False),
    # logits read again
    _case("entropy_bonus", entropy_bonus, _in3(610), None),
    _case("logits_masked_in_place", logits_masked_in_place, _xwt((2, 8, H), (16,), 620, v=36), False),
    _case("detached_logits_in_kl", detached_logits_in_kl, _with(lambda s: randn(2, 8, V, seed=s), 615), None),
    # label shift
    _case("shift_both_forward", shift_both_forward, _in_t2d(700), None),
    _case("shift_reversed", shift_reversed, _in_t2d(710), None),
]
