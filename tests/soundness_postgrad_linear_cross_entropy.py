"""Post-grad soundness cases of the loss head: the fast head's saved gradients scaled in the backward
(run under Inductor; tests/soundness_postgrad.py gives the intent, shapes and shared helpers)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from soundness import Case, awkward, randn
from soundness_postgrad import D, V, _NW, _SQ, _T, _X, _ins, _norm, _s

L = "linear_cross_entropy/"


def _ce(h, w, t):
    return F.cross_entropy(F.linear(h, w).view(-1, V), t)


def loss_times_constant(x, w, t):
    """HF's loss * 0.5 (a gradient-accumulation divisor): the saved gradients scaled by 0.5 * g."""
    return _ce(x, w, t) * 0.5


def loss_times_parameter(x, w, s, t):
    """A learned loss weight (s: 0-dim parameter): the scale reads s and s's gradient reads the loss."""
    return _ce(x, w, t) * s


def loss_plus_loss_squared(x, w, t):
    """The loss used twice: loss + loss ** 2 (the upstream gradient is 1 + 2 * loss)."""
    loss = _ce(x, w, t)
    return loss + loss ** 2


def loss_and_perplexity(x, w, t):
    """loss and exp(loss) both returned: two uses of the one loss, each with its own gradient."""
    loss = _ce(x, w, t)
    return loss, loss.exp()


def two_targets_one_head(x, w, t1, t2):
    """One logits tensor, two cross-entropies (two label sets)."""
    z = F.linear(x, w).view(-1, V)
    return F.cross_entropy(z, t1) + 0.3 * F.cross_entropy(z, t2)


def two_heads_one_hidden(x, w1, w2, t1, t2):
    """Multi-token prediction: two heads on one hidden state; x's gradient sums the two saved dx."""
    return _ce(x, w1, t1) + 0.5 * _ce(x, w2, t2)


def one_head_two_hiddens(x1, x2, w, t1, t2):
    """One head on two hidden states (two fused calls): W's gradient sums the two saved dW."""
    return _ce(x1, w, t1) + _ce(x2, w, t2)


def tied_embedding_head(ids, w, t):
    """The head weight is the embedding table: dW = scaled saved dW + the embedding's gradient."""
    return _ce(F.embedding(ids, w) * 2.0, w, t)


def hidden_also_regularised(x, w, t):
    """The head's input also feeds an L2 term: x's gradient adds the saved dx to 2e-2 * x / n."""
    return _ce(x, w, t) + 1e-2 * x.pow(2).mean()


def logits_returned_detached(x, w, t):
    """The logits [2, 5, 40] also returned, detached inside the compiled function (for metrics or a
    sampler). (Returning the flattened z.view(-1, V) instead leaves the head unfused under every inner
    compiler: a matcher limit, not a post-grad one.)"""
    z = F.linear(x, w)
    return F.cross_entropy(z.view(-1, V), t), z.detach()


def frozen_head(x, w, t):
    """A frozen (detached) head: dx only."""
    return _ce(x, w.detach(), t)


def sum_reduction(x, w, t):
    return F.cross_entropy(F.linear(x, w).view(-1, V), t, reduction="sum")


def biased_head_scaled(x, w, b, t):
    """A biased lm_head (b [40]) and the loss halved: db from the saved fp32 sum, scaled."""
    return F.cross_entropy(F.linear(x, w, b).view(-1, V), t) * 0.5


def softcap_label_smoothing(x, w, t):
    """Gemma2's softcap with label smoothing 0.1."""
    z = torch.tanh(F.linear(x * 5, w) / 30.0) * 30.0
    return F.cross_entropy(z.view(-1, V), t, label_smoothing=0.1)


def vocab_scale_head(x, w, s, t):
    """nGPT / Dory's per-vocabulary logit scale s [40]: its gradient from the fast head's column sweep."""
    return F.cross_entropy((F.linear(x, w) * s).view(-1, V), t)


def transposed_hidden(x, w, t):
    """Hidden states in [T, B, H] (Megatron's layout) transposed to [B, T, H] before the head: a
    non-contiguous x, whose saved dx has x's contiguous layout."""
    return F.cross_entropy(F.linear(x.transpose(0, 1), w).reshape(-1, V), t)


def checkpointed_head(x, w, t):
    """The loss head under activation checkpointing (the fast op runs again in the backward)."""
    return checkpoint(_ce, x, w, t, use_reentrant=False)


def final_norm_head(x, w1, wa, wf, w, t):
    """A pre-norm block, the final norm and the head: the head's saved dx is the final norm's dy."""
    h = x + F.linear(_norm(x, w1), wa)
    return _ce(_norm(h, wf), w, t)


def final_norm_head_hidden_returned(x, w1, wa, wf, w, t):
    """The final norm's output is also returned (HF's last hidden state): its dy sums the head's
    scaled saved dx and the hidden state's own gradient."""
    h = x + F.linear(_norm(x, w1), wa)
    n = _norm(h, wf)
    return _ce(n, w, t), n


CASES = [
    Case(L + "loss_times_constant", loss_times_constant, _ins(_X(200), _s(201, V, D, scale=0.3), _T(202)), True),
    Case(L + "loss_times_parameter", loss_times_parameter,
         _ins(_X(203), _s(204, V, D, scale=0.3), lambda: torch.tensor(1.7), _T(205)), True),
    Case(L + "loss_plus_loss_squared", loss_plus_loss_squared, _ins(_X(206), _s(207, V, D, scale=0.3), _T(208)), True),
    Case(L + "loss_and_perplexity", loss_and_perplexity, _ins(_X(209), _s(210, V, D, scale=0.3), _T(211)), True),
    Case(L + "two_targets_one_head", two_targets_one_head,
         _ins(_X(212), _s(213, V, D, scale=0.3), _T(214), _T(215)), None),
    Case(L + "two_heads_one_hidden", two_heads_one_hidden,
         _ins(_X(216), _s(217, V, D, scale=0.3), _s(218, V, D, scale=0.3), _T(219), _T(220)), True),
    Case(L + "one_head_two_hiddens", one_head_two_hiddens,
         _ins(_X(221), _X(222), _s(223, V, D, scale=0.3), _T(224), _T(225)), True),
    Case(L + "tied_embedding_head", tied_embedding_head,
         _ins(lambda: torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(226)),
              _s(227, V, D, scale=0.3), _T(228)), True),
    Case(L + "hidden_also_regularised", hidden_also_regularised, _ins(_X(229), _s(230, V, D, scale=0.3), _T(231)),
         True),
    Case(L + "logits_returned_detached", logits_returned_detached, _ins(_X(232), _s(233, V, D, scale=0.3), _T(234)),
         True),
    Case(L + "frozen_head_scaled_backward", frozen_head, _ins(_X(235), _s(236, V, D, scale=0.3), _T(237)), True),
    Case(L + "sum_reduction", sum_reduction, _ins(_X(238), _s(239, V, D, scale=0.3), _T(240)), True),
    Case(L + "biased_head_scaled", biased_head_scaled,
         _ins(_X(300), _s(301, V, D, scale=0.3), lambda: randn(V, seed=302), _T(303)), True),
    Case(L + "softcap_label_smoothing", softcap_label_smoothing, _ins(_X(304), _s(305, V, D, scale=0.3), _T(306)),
         True),
    Case(L + "vocab_scale_head", vocab_scale_head,
         _ins(_X(307), _s(308, V, D, scale=0.3), lambda: awkward(V, seed=309).abs() + 0.5, _T(310)), True),
    Case(L + "transposed_hidden", transposed_hidden,
         _ins(lambda: awkward(5, 2, D, seed=311), _s(312, V, D, scale=0.3), _T(313)), True),
    Case(L + "checkpointed_head", checkpointed_head, _ins(_X(314), _s(315, V, D, scale=0.3), _T(316)), True),
    Case(L + "final_norm_head_hidden_returned", final_norm_head_hidden_returned,
         _ins(_X(321), _NW(322), _SQ(323), _NW(324), _s(325, V, D, scale=0.3), _T(326)), True),
    Case(L + "final_norm_head", final_norm_head,
         _ins(_X(241), _NW(242), _SQ(243), _NW(244), _s(245, V, D, scale=0.3), _T(246)), True),
]
