"""Soundness cases (tests/soundness.py) about the layouts, aliases, gradient sets and special values
that reach the loss head: strided, offset, transposed and stride-0 (expanded) inputs and weights, one
tensor in two roles, outputs returned twice or as views, gradients asked of only some inputs,
rows of zeros / inf / nan, degenerate sizes. Each fn is spelled as models write the op; the layout
or alias is built inside fn (run() makes every floating input a leaf with a gradient). fp32 only.

Shapes: hidden H = 32, vocabulary V = 100, 16 tokens; labels strided, shifted, with each
ignore_index value, every row ignored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import Case, awkward, randn


V, H = 100, 32
P = "linear_cross_entropy/"


def _t(*shape, seed, v=V, ignore=True, ignore_index=-100):
    t = torch.randint(0, v, shape, generator=torch.Generator().manual_seed(seed))
    if ignore:
        t.view(-1)[::5] = ignore_index
    return t


def _lce_in(seed, xs=(2, 8, H), ts=(16,), ws=(V, H), **kw):
    return lambda: (randn(*xs, seed=seed) * 0.5, randn(*ws, seed=seed + 1) * 0.5, _t(*ts, seed=seed + 2, **kw))


def _hf_loss(x, w, t, **kw):
    z = F.linear(x, w).float()
    return F.cross_entropy(z.view(-1, z.shape[-1]), t.view(-1), **kw)


def lce_labels_strided(x, w, tt):
    """labels tt[::2] of a [32] tensor (a stride-2 view)."""
    return _hf_loss(x, w, tt[::2])


def lce_labels_expanded(x, w, t):
    """One label for every row: t[3:4].expand(16) (stride 0)."""
    return _hf_loss(x, w, t[3:4].expand(16))


def lce_labels_transposed(x, w, t2d):
    """labels [8, 2] (time-major) read as t2d.t() [2, 8], matching x [2, 8, 32], flattened by reshape."""
    z = F.linear(x, w).float()
    return F.cross_entropy(z.view(-1, V), t2d.t().reshape(-1))


def lce_labels_pad_shift(x, w, t2d):
    """HF's shift in the loss (transformers >= 4.46): F.pad(labels, (0, 1), value=-100)[..., 1:]."""
    shift = F.pad(t2d, (0, 1), value=-100)[..., 1:].contiguous()
    return _hf_loss(x, w, shift)


def lce_labels_roll_shift(x, w, t2d):
    """labels rolled by one along T and the wrapped last column set to -100 with torch.where."""
    t = torch.roll(t2d, -1, dims=1)
    last = torch.arange(t.shape[1], device=t.device) == t.shape[1] - 1
    return _hf_loss(x, w, torch.where(last, -100, t))


def lce_ignore_minus_one(x, w, t):
    """nanochat's ignore_index=-1, with -1 labels present."""
    return _hf_loss(x, w, t, ignore_index=-1)


def lce_ignore_zero(x, w, t):
    """ignore_index=0 (a pad id of 0), with label 0 present."""
    return _hf_loss(x, w, t, ignore_index=0)


def lce_ignore_last_class(x, w, t):
    """ignore_index=V-1 (a pad token at the end of the vocabulary), with label V-1 present."""
    return _hf_loss(x, w, t, ignore_index=V - 1)


def lce_ignore_out_of_range(x, w, t):
    """ignore_index=V (no class), with label V present: eager ignores those rows."""
    return _hf_loss(x, w, t, ignore_index=V)


def lce_all_ignored_mean(x, w, t):
    """Every label -100, reduction mean: eager's loss is 0 / 0 = nan, its gradients 0."""
    return _hf_loss(x, w, torch.full_like(t, -100))


def lce_all_ignored_sum(x, w, t):
    return _hf_loss(x, w, torch.full_like(t, -100), reduction="sum")


def lce_all_ignored_none(x, w, t):
    return _hf_loss(x, w, torch.full_like(t, -100), reduction="none")


def lce_all_ignored_smoothing(x, w, t):
    return _hf_loss(x, w, torch.full_like(t, -100), label_smoothing=0.1)


def lce_all_ignored_num_items(x, w, t):
    """HF's sum / num_items_in_batch with every label ignored: 0 / 0."""
    t = torch.full_like(t, -100)
    return _hf_loss(x, w, t, reduction="sum") / (t != -100).sum()


def lce_hidden_transposed(x, w, t):
    """x [8, 2, 32] (time-major) transposed to [2, 8, 32] before the head."""
    return _hf_loss(x.transpose(0, 1), w, t)


def lce_hidden_strided(x, w, t):
    """x [2, 8, 64]: the head reads x[..., ::2] (stride 2)."""
    return _hf_loss(x[..., ::2], w, t)


def lce_hidden_expanded(x, w, t):
    """x [2, 1, 32] expanded to [2, 8, 32] (stride 0 over T)."""
    return _hf_loss(x.expand(2, 8, H), w, t)


def lce_weight_row_slice(x, w, t):
    """W [108, 32] (a padded vocabulary): the head uses W[:100] (the weight sliced, not the logits)."""
    return _hf_loss(x, w[:V], t)


def lce_weight_strided_columns(x, w, t):
    """W [100, 64] read as W[:, 1::2] (column stride 2, offset 1); x [2, 8, 32]."""
    return _hf_loss(x, w[:, 1::2], t)


def lce_weight_linear_of_transposed(x, w, t):
    """W stored [32, 100] (H, V) and passed as F.linear(x, W.t())."""
    return _hf_loss(x, w.t(), t)


def lce_weight_overlapping_rows(x, w, t):
    """W = w_flat.unfold(0, 32, 1): [100, 32] with strides (1, 1), row v = w_flat[v:v + 32] (rows overlap in
    memory; the gradient of each element of w_flat sums over the rows that read it). (A stride-0 expand of
    one row makes every logit equal and both gradients 0 up to rounding: no relative error to compare.)"""
    return _hf_loss(x, w.unfold(0, H, 1), t)


def lce_bias_strided(x, w, b, t):
    """An lm_head bias read as bb[::2] of a [200] tensor."""
    z = F.linear(x, w, b[::2]).float()
    return F.cross_entropy(z.view(-1, V), t)


def lce_bart_bias_strided(x, w, b, t):
    """BART's final_logits_bias [1, 100] read as bb[:, ::2] of a [1, 200] buffer, added after the head."""
    return F.cross_entropy((F.linear(x, w) + b[:, ::2]).view(-1, V), t)


def lce_vocab_scale_strided(x, w, s, t):
    """nGPT's per-vocabulary scale s_z read as ss[1::2] of a [200] tensor."""
    return F.cross_entropy((F.linear(x, w) * s[1::2]).view(-1, V), t)


def lce_frozen_head(x, w, t):
    """The lm_head frozen (w.detach()): only dx."""
    return _hf_loss(x, w.detach(), t)


def lce_frozen_hidden(x, w, t):
    """Only the head learns (x.detach()): only dW."""
    return _hf_loss(x.detach(), w, t)


def lce_frozen(x, w, t):
    return _hf_loss(x.detach(), w.detach(), t)


def lce_hidden_also_returned(x, w, t):
    """The loss and the hidden states (HF's output_hidden_states)."""
    return _hf_loss(x, w, t), x


def lce_loss_returned_twice(x, w, t):
    loss = _hf_loss(x, w, t)
    return loss, loss


def lce_nan_row(x, w, t):
    """One hidden row nan (row 1 of 16, a labelled row): the loss is nan, and so are dW and that row's dx."""
    bump = torch.zeros_like(x)
    bump[0, 1, 3] = float("nan")
    return _hf_loss(x + bump, w, t)


def lce_nan_row_ignored(x, w, t):
    """The nan row's label is ignore_index (row 0: t[0] = -100): eager's loss is finite."""
    bump = torch.zeros_like(x)
    bump[0, 0, 3] = float("nan")
    return _hf_loss(x + bump, w, t)


def lce_nan_row_ignored_none(x, w, t):
    """As lce_nan_row_ignored with reduction='none', summed by hand."""
    bump = torch.zeros_like(x)
    bump[0, 0, 3] = float("nan")
    return _hf_loss(x + bump, w, t, reduction="none")


def lce_single_row(x, w, t):
    """One token: x [1, 32], t [1]."""
    return _hf_loss(x, w, t)


def lce_single_class(x, w, t):
    """V = 1: every log-prob is 0 (t all 0)."""
    return _hf_loss(x, w, t)


def lce_empty_batch(x, w, t):
    """x [0, 32], t [0]: mean over no rows (nan); eager's dW is 0."""
    return _hf_loss(x, w, t)


def lce_empty_batch_sum(x, w, t):
    """x [0, 32], t [0], reduction='sum': loss 0, dW 0."""
    return _hf_loss(x, w, t, reduction="sum")


def lce_ignore_zero_smoothing_sum(x, w, t):
    """ignore_index=0 (label 0 present) with label_smoothing=0.1 and reduction='sum'."""
    return _hf_loss(x, w, t, ignore_index=0, label_smoothing=0.1, reduction="sum")


def _lce(fn, inputs, fuses):
    return Case(P + fn.__name__.removeprefix("lce_"), fn, inputs, fuses)


LCE_CASES = [
    _lce(lce_labels_strided, _lce_in(4000, ts=(32,)), True),
    _lce(lce_labels_expanded, _lce_in(4010, ignore=False), True),
    _lce(lce_labels_transposed, _lce_in(4020, ts=(8, 2)), True),
    _lce(lce_labels_pad_shift, _lce_in(4030, ts=(2, 8)), True),
    _lce(lce_labels_roll_shift, _lce_in(4040, ts=(2, 8)), True),
    _lce(lce_ignore_minus_one, _lce_in(4060, ignore_index=-1), True),
    _lce(lce_ignore_zero, _lce_in(4070, ignore_index=0), True),
    _lce(lce_ignore_last_class, _lce_in(4080, ignore_index=V - 1), True),
    _lce(lce_ignore_out_of_range, _lce_in(4090, ignore_index=V), True),
    _lce(lce_all_ignored_mean, _lce_in(4100), True),
    _lce(lce_all_ignored_sum, _lce_in(4110), True),
    _lce(lce_all_ignored_none, _lce_in(4120), True),
    _lce(lce_all_ignored_smoothing, _lce_in(4130), True),
    _lce(lce_all_ignored_num_items, _lce_in(4140), True),
    _lce(lce_hidden_transposed, _lce_in(4150, xs=(8, 2, H)), True),
    _lce(lce_hidden_strided, _lce_in(4160, xs=(2, 8, 2 * H)), True),
    _lce(lce_hidden_expanded, _lce_in(4170, xs=(2, 1, H)), True),
    _lce(lce_weight_row_slice, _lce_in(4180, ws=(V + 8, H)), True),
    _lce(lce_weight_strided_columns, _lce_in(4190, ws=(V, 2 * H)), True),
    _lce(lce_weight_linear_of_transposed, _lce_in(4200, ws=(H, V)), None),
    _lce(lce_weight_overlapping_rows, _lce_in(4210, ws=(V + H - 1,)), True),
    _lce(lce_bias_strided, lambda: (randn(2, 8, H, seed=4220) * 0.5, randn(V, H, seed=4221) * 0.5,
                                    randn(2 * V, seed=4222), _t(16, seed=4223)), True),
    _lce(lce_bart_bias_strided, lambda: (randn(2, 8, H, seed=4224) * 0.5, randn(V, H, seed=4225) * 0.5,
                                         randn(1, 2 * V, seed=4226), _t(16, seed=4227)), True),
    _lce(lce_vocab_scale_strided, lambda: (randn(2, 8, H, seed=4228) * 0.5, randn(V, H, seed=4229) * 0.5,
                                           awkward(2 * V, seed=4230).abs() + 0.5, _t(16, seed=4231)), True),
    _lce(lce_frozen_head, _lce_in(4230), True),
    _lce(lce_frozen_hidden, _lce_in(4240), True),
    _lce(lce_frozen, _lce_in(4250), True),
    _lce(lce_hidden_also_returned, _lce_in(4260), True),
    _lce(lce_loss_returned_twice, _lce_in(4270), True),
    _lce(lce_nan_row, _lce_in(4280), True),
    _lce(lce_nan_row_ignored, _lce_in(4290), True),
    _lce(lce_nan_row_ignored_none, _lce_in(4300), True),
    _lce(lce_single_row, _lce_in(4310, xs=(1, H), ts=(1,), ignore=False), True),
    _lce(lce_single_class, _lce_in(4320, ws=(1, H), v=1, ignore=False), None),
    _lce(lce_empty_batch, _lce_in(4330, xs=(0, H), ts=(0,)), None),
    _lce(lce_empty_batch_sum, _lce_in(4340, xs=(0, H), ts=(0,)), None),
    _lce(lce_ignore_zero_smoothing_sum, _lce_in(4350, ignore_index=0), True),
]

CASES: list[Case] = LCE_CASES
