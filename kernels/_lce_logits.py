"""The loss head's logit transform and its gradient, shared by the lean (linear_cross_entropy.py)
and fast (linear_cross_entropy_fast.py) algorithms: bias, logit scale, Gemma 2's softcap, each
rounded where eager stores it when asked (eager_rounding), and the row losses' reduction in eager's
order. The module docs of linear_cross_entropy.py give the math; PyTorch twins at the bottom.
"""
import torch
import triton
import triton.language as tl

from ._round import round_ref, round_to


@triton.jit
def _tanh(u):
    # tanh from exp: saturates to +-1 without overflow (exp -> inf gives 1 - 0).
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _logits(zr, bias_ptr, cols, mask, scale, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
            ROUND: tl.constexpr, ROUND_OPS: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """(z, t): fp32 logits of one tile from the raw matmul tile zr (fp32), and tanh(z / c) (the
    softcap's tanh, for its backward; z itself without a softcap). Where eager stores a low-precision
    tensor the result is rounded (_round.py codes): ROUND the lm_head's output, ROUND_OPS each later
    op's (the scale, z / c, tanh, * c): ROUND when the graph casts to fp32 after them, 0 before."""
    if HAS_BIAS:
        zr += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    z = round_to(round_to(zr, ROUND, RNE_BY_BITS) * scale, ROUND_OPS, RNE_BY_BITS)
    t = z
    if SOFTCAP:
        t = round_to(_tanh(round_to(z / softcap, ROUND_OPS, RNE_BY_BITS)), ROUND_OPS, RNE_BY_BITS)
        z = round_to(t * softcap, ROUND_OPS, RNE_BY_BITS)
    return z, t


@triton.jit
def _dlogits(dz, t, scale, softcap, SOFTCAP: tl.constexpr, ROUND: tl.constexpr, ROUND_OPS: tl.constexpr,
             RNE_BY_BITS: tl.constexpr):
    """Grad of the raw matmul tile from dz, the fp32 grad of the fp32 logits: the chain rule of
    _logits in eager's order: the .float() cast's grad rounded first, then * c, tanh', / c, * s
    (ROUND_OPS != 0); or the fp32 chain, rounded where it reaches the lm_head (ROUND_OPS == 0)."""
    dz = round_to(dz, ROUND_OPS, RNE_BY_BITS)
    if SOFTCAP:
        dz = round_to(dz * softcap, ROUND_OPS, RNE_BY_BITS)
        dz = round_to(dz * (1.0 - t * t), ROUND_OPS, RNE_BY_BITS)
        dz = round_to(dz / softcap, ROUND_OPS, RNE_BY_BITS)
    dz = dz * scale
    if ROUND_OPS == 0:
        dz = round_to(dz, ROUND, RNE_BY_BITS)
    return dz


def _reduce_like_eager(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """sum(rows) or sum(rows) / count(target != ignore_index), summed by F.nll_loss as eager's
    F.cross_entropy sums its rows: rows.sum()'s order follows the CPU's vector width (AVX2 and
    AVX-512 machines round differently), nll_loss's cascade does not. Ignored rows are 0 in rows
    and skipped here; an all-ignored "mean" batch is 0 / 0 = nan, as eager."""
    pick = 1 if ignore_index == 0 else 0  # a column index that is not ignore_index
    picks = torch.where(target == ignore_index, ignore_index, pick)
    return torch.nn.functional.nll_loss((-rows)[:, None].expand(rows.shape[0], pick + 1), picks,
                                        ignore_index=ignore_index, reduction=reduction)


def _logits_reference(z, bias, v0, softcap, scale, low=None, round_ops=True):
    """PyTorch twin of _logits: (z, t), the lm_head's output rounded to low when low is not None,
    and each later op's result too with round_ops."""
    rnd = lambda y: round_ref(y, low, low is not None)  # noqa: E731
    rnd_op = rnd if round_ops else (lambda y: y)
    if bias is not None:
        z = z + bias[v0:v0 + z.shape[1]].float()
    z = rnd_op(rnd(z) * scale)
    if softcap <= 0:
        return z, z
    t = rnd_op(torch.tanh(rnd_op(z / softcap)))
    return rnd_op(t * softcap), t


def _dlogits_reference(dz, t, scale, softcap, low=None, round_ops=True):
    """PyTorch twin of _dlogits."""
    rnd = lambda y: round_ref(y, low, low is not None)  # noqa: E731
    rnd_op = rnd if round_ops else (lambda y: y)
    dz = rnd_op(dz)
    if softcap > 0:
        dz = rnd_op(rnd_op(rnd_op(dz * softcap) * (1.0 - t * t)) / softcap)
    return dz * scale if round_ops else rnd(dz * scale)
