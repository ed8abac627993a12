"""Soundness cases of the row-loop batching (fxfuse/unstack.py) that lets TRL's per-row log-probs fuse
as one loss head: loops that are one batch (fuse) and loops that only look like one (rows reversed,
stacked along another dim, concatenated, a row repeated, one row's labels for every row, one row
computed otherwise), which must keep eager's value (and the last must not fuse).

Per-token log-probs log_softmax(z_i, -1).gather(-1, t_i) of x [3, 5, 16] (a square [5, 5, 16] where
the loop walks a transpose), W [50, 16], labels [3, 5], weighted by a ramp over their last dim and
summed (a policy-gradient-like loss).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import Case, randn

V, H = 50, 16


def _logp(zr, tr):  # one row: [T, V] logits, [T] labels -> [T]
    return F.log_softmax(zr, -1).gather(-1, tr[:, None]).squeeze(-1)


def trl_rows(z, t):
    return torch.stack([_logp(zr, tr) for zr, tr in zip(z, t)])


def labels_rolled(z, t):  # row i with row i-1's labels: still one batch (of t.roll(1, 0))
    return torch.stack([_logp(zr, tr) for zr, tr in zip(z, t.roll(1, 0))])


def shifted_pairs(z, t):  # rows 0..B-2 with labels 1..B-1: one batch of two slices
    return torch.stack([_logp(zr, tr) for zr, tr in zip(z[:-1], t[1:])])


def reversed_rows(z, t):
    return torch.stack([_logp(z[i], t[i]) for i in reversed(range(z.shape[0]))])


def stacked_along_dim1(z, t):
    return torch.stack([_logp(zr, tr) for zr, tr in zip(z, t)], dim=1)


def concatenated(z, t):
    return torch.cat([_logp(zr, tr) for zr, tr in zip(z, t)])


def row_repeated(z, t):
    return torch.stack([_logp(z[0], t[0]), _logp(z[1], t[1]), _logp(z[1], t[1])])


def row0_labels_everywhere(z, t):
    return torch.stack([_logp(zr, t[0]) for zr in z])


def first_row_over_tokens(z, t):  # row 0's log_softmax over its tokens, not its classes
    return torch.stack([_logp(zr, tr) if i else F.log_softmax(zr, 0).gather(-1, tr[:, None]).squeeze(-1)
                        for i, (zr, tr) in enumerate(zip(z, t))])


def rows_of_a_transpose(z, t):  # [5, 5, V]: the loop walks dim 1
    return torch.stack([_logp(zr, tr) for zr, tr in zip(z.transpose(0, 1), t.transpose(0, 1))])


def _head(logps):
    def head(x, w, t):
        lp = logps(F.linear(x, w), t)
        return -(lp * torch.linspace(0.5, 1.5, lp.shape[-1], device=lp.device)).sum()
    head.__name__ = logps.__name__
    return head


def _inputs(b):
    return lambda: (randn(b, 5, H, seed=1), randn(V, H, seed=2),
                    torch.randint(0, V, (b, 5), generator=torch.Generator().manual_seed(3)))


CASES = [Case(f"linear_cross_entropy/rows_{fn.__name__}", _head(fn), _inputs(5 if fn is rows_of_a_transpose else 3),
              fuses)
         for fns, fuses in (((trl_rows, labels_rolled, shifted_pairs), True), ((first_row_over_tokens,), False),
                            # rows permuted, repeated or sharing labels: a fused head over rearranged rows could
                            # compute them; unstack leaves them as written
                            ((reversed_rows, stacked_along_dim1, concatenated, row_repeated, row0_labels_everywhere,
                              rows_of_a_transpose), None))
         for fn in fns]
