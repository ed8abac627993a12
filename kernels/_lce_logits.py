"""The loss head's logit transform and its gradient, shared by the lean (linear_cross_entropy.py)
and fast (linear_cross_entropy_fast.py) algorithms: bias, logit scale, Gemma 2's softcap, each
rounded where eager stores it when asked (eager_rounding), a per-vocabulary scale, and the row
losses' reduction in eager's order; the unfused definition the matcher replaces. The module docs of
linear_cross_entropy.py give the math; PyTorch twins at the bottom.
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
def _logits(zr, bias_ptr, vs_ptr, cols, mask, scale, softcap, HAS_BIAS: tl.constexpr, HAS_VSCALE: tl.constexpr,
            SOFTCAP: tl.constexpr, ROUND: tl.constexpr, ROUND_OPS: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """(z, t): fp32 logits of one tile from the raw matmul tile zr (fp32), and tanh(z / c) (the
    softcap's tanh, for its backward; z itself without a softcap). Where eager stores a low-precision
    tensor the result is rounded (_round.py codes): ROUND the lm_head's output, ROUND_OPS each later
    op's (the scale, z / c, tanh, * c): ROUND when the graph casts to fp32 after them, 0 before.
    HAS_VSCALE: times a per-vocabulary fp32 scale vs[col] too (never with roundings: the op refuses)."""
    if HAS_BIAS:
        zr += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    z = round_to(round_to(zr, ROUND, RNE_BY_BITS) * scale, ROUND_OPS, RNE_BY_BITS)
    if HAS_VSCALE:
        z = z * tl.load(vs_ptr + cols, mask=mask, other=0.0)
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


@triton.jit
def _dlogits_vscaled(dz, t, zr, vs_ptr, cols, mask, scale, softcap, SOFTCAP: tl.constexpr, ROUND_OUT: tl.constexpr,
                     RNE_BY_BITS: tl.constexpr):
    """(dzr, dvs): with a per-vocabulary scale, u = zr * scale * vs[col] (zr with the bias), the grad
    of the raw tile dzr = du * scale * vs and each element's term of the scale's grad, du * zr * scale
    (a column sum over the tokens gives d vs; fp32 throughout, where folding vs into W would round
    W * vs and leave d vs a cancelling sum over H of the folded weight's rounded grad). dzr is rounded
    to nearest even in the ROUND_OUT dtype it is stored in (the interpreter's own cast truncates)."""
    du = _dlogits(dz, t, 1.0, softcap, SOFTCAP, 0, 0, False)
    dzr = round_to(du * (scale * tl.load(vs_ptr + cols, mask=mask, other=0.0)), ROUND_OUT, RNE_BY_BITS)
    return dzr, du * zr * scale


def _vocab_scale(vocab_scale: torch.Tensor | None, weight: torch.Tensor, eager_rounding: bool):
    """The per-vocabulary logit scale as a contiguous fp32 [V], checked (None: no scale)."""
    if vocab_scale is None:
        return None
    if vocab_scale.shape != (weight.shape[0],) or vocab_scale.dtype != torch.float32:
        raise ValueError(f"linear_cross_entropy: vocab_scale must be float32 [{weight.shape[0]}] (one per "
                         f"weight row), got {vocab_scale.dtype} {list(vocab_scale.shape)}")
    if eager_rounding:
        raise ValueError("linear_cross_entropy: eager_rounding has no eager order to follow with a vocab_scale "
                         "(the scale multiplies in fp32)")
    return vocab_scale.contiguous()


def _reduce_like_eager(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """sum(rows) or sum(rows) / count(target != ignore_index), summed by F.nll_loss as eager's
    F.cross_entropy sums its rows: rows.sum()'s order follows the CPU's vector width (AVX2 and
    AVX-512 machines round differently), nll_loss's cascade does not. Ignored rows are 0 in rows
    and skipped here; an all-ignored "mean" batch is 0 / 0 = nan, as eager."""
    pick = 1 if ignore_index == 0 else 0  # a column index that is not ignore_index
    picks = torch.where(target == ignore_index, ignore_index, pick)
    return torch.nn.functional.nll_loss((-rows)[:, None].expand(rows.shape[0], pick + 1), picks,
                                        ignore_index=ignore_index, reduction=reduction)


def _bad_targets(target: torch.Tensor, ignore_index: int, vocab: int) -> torch.Tensor:
    """[N] bool: targets neither ignore_index nor a class in [0, vocab). Eager's cross_entropy raises on
    them (an index error on the CPU, a device assert on CUDA); a check here would need a host sync, so
    the ops make such rows' losses and the gradients nan instead of a silently wrong loss (the kernels
    clamp the target they read, which keeps their loads in bounds)."""
    return (target != ignore_index) & ((target < 0) | (target >= vocab))


def linear_cross_entropy_eager(x, weight, bias, target, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, softcap=0.0, logit_scale=1.0, fp32_transform=False):
    """The unfused definition (materialises [N, V]): what the matcher replaces. fp32_transform: the
    .float() comes before the scale / softcap instead of after."""
    z = torch.nn.functional.linear(x, weight, bias)
    if fp32_transform:
        z = z.float()
    if logit_scale != 1.0:  # as models write it: no scale at all when there is none
        z = z * logit_scale
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    return torch.nn.functional.cross_entropy(z.float(), target, ignore_index=ignore_index,
                                             reduction=reduction, label_smoothing=label_smoothing)


def _logits_reference(z, bias, v0, softcap, scale, low=None, round_ops=True, vs=None):
    """PyTorch twin of _logits: (z, t), the lm_head's output rounded to low when low is not None,
    and each later op's result too with round_ops; vs: the fp32 [V] per-vocabulary scale."""
    rnd = lambda y: round_ref(y, low, low is not None)  # noqa: E731
    rnd_op = rnd if round_ops else (lambda y: y)
    if bias is not None:
        z = z + bias[v0:v0 + z.shape[1]].float()
    z = rnd_op(rnd(z) * scale)
    if vs is not None:
        z = z * vs[v0:v0 + z.shape[1]]
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


def _dlogits_vscaled_reference(dz, t, zr, vs, v0, scale, softcap, terms=True):
    """PyTorch twin of _dlogits_vscaled on a [R, C] chunk from column v0: (dzr, dvs terms); the
    terms are None when not asked for (a frozen scale: no [R, C] product to discard)."""
    du = _dlogits_reference(dz, t, 1.0, softcap)
    vs = vs[v0:v0 + zr.shape[1]]
    return du * (scale * vs), du * zr * scale if terms else None
