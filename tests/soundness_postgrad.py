"""Soundness cases of fxfuse's Inductor-only backward rewrites (run them with inner="inductor"):

* fxfuse/fold_add.py folds the residual-gradient add after an RMSNorm backward (``dx + d_residual``)
  and the sum of dy's addends (the q / k / v or gate / up input gradients) into
  ``fxfuse::rms_norm_backward_add``;
* fxfuse/reinplace.py replaces gated-MLP backwards by ``*_into`` twins that write dgate over gate
  and dup over grad_out (d gate_up over gate_up for the packed ops) when nothing reads them later;
* the loss head's "fast" algorithm forms its gradients in the forward and the compiled backward
  scales the saved (donated) buffers in place.

Each case is a small block spelled as models write it (pre-norm residual blocks, gated MLPs, loss heads)
or changed in one detail that the passes must respect: a residual with alpha or a scale, the
residual read elsewhere, two norms of one input, a norm weight shared by two layers, a norm output
feeding 1-4 matmuls, a branch gradient that is not contiguous, gate and up views of one tensor,
two MLPs whose grad_out is one buffer, a buffer that an elementwise op of the backward reads
before the gated backward would overwrite it (a "+ 0.1 * u" skip in the intermediate space; a
checkpointed gate squared into the output), a loss scaled by a constant or by a parameter, used
twice, two heads on one hidden state.

Found failing at 815604f (fixed since): swiglu/up_skip_const, up_skip_learned, gate_skip_const,
gate_read_again_checkpointed, packed_read_again_checkpointed (wrong gradients: an elementwise read
of the overwritten buffer that Inductor inlined into a later kernel ran after the *_into write), and
linear_cross_entropy/logits_returned_detached (logits detached in the function came back requiring
grad: a loud error).

Shapes: x [2, 5, 32] (awkward(): rows of very different scale), norm weights [32] (randn + 1),
square projections [32, 32] * 0.2, MLP gate / up [64, 32] * 0.2 and down [32, 64] * 0.2, the loss
head W [40, 32] * 0.3 with targets [10] in [0, 40) (every 5th -100). fp32 throughout, eps 1e-6.
The case's op (the name's prefix) must fuse where fuses=True; the other ops in a case may fuse too.
tests/soundness.py's run(case, inner="inductor") runs one (tests/test_soundness.py: every case of
tests/soundness_postgrad_*.py); /work/s50/postgrad/run_cases.py runs all
of them with Inductor's caches off (a cache hit skips the post-grad pass) and prints the fold /
in-place counters (~6 minutes on two CPU cores).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from soundness import awkward, randn

D, I, V, EPS = 32, 64, 40, 1e-6


def _norm(x, w):
    """HF LlamaRMSNorm (fp32: the casts are no-ops)."""
    h = x.to(torch.float32)
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _x(seed):
    return awkward(2, 5, D, seed=seed)


def _nw(seed):
    return randn(D, seed=seed) + 1


def _sq(seed):
    return randn(D, D, seed=seed) * 0.2


def _t(seed, n=10):
    t = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))
    t[::5] = -100
    return t


def _attn_like(n, wq, wk, wv):
    """A token-local stand-in for attention: three projections of n mixed pointwise (each of q, k, v
    reaches the output, so the norm's dy is the sum of three input gradients)."""
    q, k, v = F.linear(n, wq), F.linear(n, wk), F.linear(n, wv)
    return torch.sigmoid(q) * torch.tanh(k) + v


def _mlp(h, wg, wu, wd):
    return F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


def _ins(*makers):
    return lambda: tuple(m() for m in makers)


def _s(seed, *shape, scale=0.2):
    return lambda: randn(*shape, seed=seed) * scale


_X = lambda s: (lambda: _x(s))  # noqa: E731
_NW = lambda s: (lambda: _nw(s))  # noqa: E731
_SQ = lambda s: (lambda: _sq(s))  # noqa: E731
_T = lambda s: (lambda: _t(s))  # noqa: E731
