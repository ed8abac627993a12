"""The spelling recognisers behind canon.build_view's rules: each says whether an FX node (with its
neighbours) is one of the spellings a rule unifies, and what it reads as. No rule changes the graph.
"""
from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .shapes import _expr

aten = torch.ops.aten

CASTS = {
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
    aten._to_copy.default, aten.type_as.default,
}

def val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def fake_call(fn, n: fx.Node, lists: bool = True):
    """fn on the fake values of n's arguments (raw meta values: SymInt sizes too), in n's fake mode.
    A list argument is a list of its nodes' values where lists, else passed as it is (of nodes: fn
    then raises, as it does where an argument has no value)."""
    get = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
    arg = lambda a: [get(b) for b in a] if lists and isinstance(a, (list, tuple)) else get(a)  # noqa: E731
    with detect_fake_mode([n.meta.get("val")]) or contextlib.nullcontext():
        return fn(*map(arg, n.args), **{k: arg(a) for k, a in n.kwargs.items()})


def _only_divisor(n: fx.Node) -> bool:
    """n's one user is a div with n as its divisor only."""
    if len(n.users) != 1:
        return False
    user = next(iter(n.users))
    return user.target == aten.div.Tensor and user.args[1] is n and user.args[0] is not n


def is_sqrt(n) -> bool:
    """n is sqrt(b): ``torch.sqrt(b)``, or ``b ** 0.5`` (aten's pow computes an exponent of 0.5 as
    sqrt, on CPU and CUDA, so the two are the same values)."""
    return isinstance(n, fx.Node) and (n.target == aten.sqrt.default or (
        n.target == aten.pow.Tensor_Scalar and not isinstance(n.args[1], bool) and n.args[1] == 0.5))


def _is_divisor_sqrt(n) -> bool:
    """n is sqrt(b) used only as the divisor of a div: the pair reads as mul(a, rsqrt(b))."""
    return is_sqrt(n) and _only_divisor(n)


def _is_reciprocal_sqrt(n) -> bool:
    """n is sqrt(b) used only by a reciprocal: the pair reads as rsqrt(b)."""
    return is_sqrt(n) and len(n.users) == 1 and next(iter(n.users)).target == aten.reciprocal.default


def _logistic_exp(n) -> fx.Node | None:
    """The exp node where n is ``1 + exp(-b)`` (either operand order), its exp and neg used only there."""
    if not (isinstance(n, fx.Node) and n.target == aten.add.Tensor and len(n.args) == 2
            and all(k == "alpha" and v == 1 for k, v in n.kwargs.items())):  # 1 + alpha * exp(-b): alpha 1 only
        return None
    e, one = n.args if isinstance(n.args[0], fx.Node) else n.args[::-1]
    if one != 1 or isinstance(one, bool) or not isinstance(e, fx.Node) or e.target != aten.exp.default:
        return None
    neg = e.args[0]
    if not (isinstance(neg, fx.Node) and neg.target == aten.neg.default and len(e.users) == 1 and len(neg.users) == 1):
        return None
    return e


def logistic_denominator(n) -> fx.Node | None:
    """b where n is ``1 + exp(-b)`` (see _logistic_exp), else None."""
    e = _logistic_exp(n)
    return e.args[0].args[0] if e is not None else None


def _is_logistic_divisor(n) -> bool:
    """n is ``1 + exp(-b)`` used only as the divisor of a div: the pair reads as mul(a, sigmoid(b))."""
    return _logistic_exp(n) is not None and _only_divisor(n)


SPLITS = {aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default}


def _piece_range(n) -> tuple[fx.Node, int, int, int, int] | None:
    """(x, dim, start, end, size of dim) when n is a contiguous piece of x along one dim: a getitem
    of a chunk / split / split_with_sizes whose users are all getitems, or a narrow; static sizes
    only (a symbolic one would be guarded by the arithmetic)."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    if n.target == aten.narrow.default:
        x, dim, start, length = n.args
        parent = None
    elif n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].target in SPLITS:
        parent, i = n.args
        if any(u.target is not operator.getitem for u in parent.users):
            return None
        x, arg = parent.args[0], parent.args[1]
        dim = parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0)
    else:
        return None
    v = val(x)
    if v is None or not isinstance(dim, int) or v.dim() == 0:
        return None
    dim = dim % v.dim()
    size = static_int(v.shape[dim])
    if size is None:
        return None
    if parent is None:
        if not (isinstance(start, int) and isinstance(length, int)):
            return None
        start = start % size if start < 0 else start
        return x, dim, start, start + length, size
    if parent.target == aten.split_with_sizes.default:
        sizes = list(arg)
    else:
        if not isinstance(arg, int) or arg <= 0:
            return None
        step = -(-size // arg) if parent.target == aten.chunk.default else arg
        sizes = [min(step, size - k) for k in range(0, size, step)]
    if not all(isinstance(z, int) for z in sizes) or i >= len(sizes):
        return None
    start = sum(sizes[:i])
    return x, dim, start, start + sizes[i], size


def _scaled(n: fx.Node, ops, k) -> fx.Node | None:
    """t where n is one of ops applied to t and the literal number k (either order for mul), keeping
    t's dtype; else None."""
    if n.op != "call_function" or n.target not in ops or len(n.args) != 2:
        return None
    a, b = n.args
    if n.target == aten.mul.Tensor and not isinstance(a, fx.Node):
        a, b = b, a
    if not isinstance(a, fx.Node) or isinstance(b, bool) or not isinstance(b, (int, float)) or b != k:
        return None
    src, out = val(a), val(n)
    return a if src is not None and out is not None and src.dtype == out.dtype else None


def _negated(n: fx.Node) -> fx.Node | None:
    """t where n is mul(t, -1): neg(t), exactly."""
    return _scaled(n, (aten.mul.Tensor,), -1)


def _unscaled(n: fx.Node) -> fx.Node | None:
    """t where n is mul(t, 1), mul(1, t) or div(t, 1): the identity."""
    return _scaled(n, (aten.mul.Tensor, aten.div.Tensor), 1)


def static_int(s) -> int | None:
    """s as a Python int if it is one, else None. Never guards on a symbolic size (int() would
    specialise it and make Dynamo recompile for every sequence length)."""
    return s if isinstance(s, int) else None


def _summed_numel(sum_node: fx.Node) -> int | None:
    x = val(sum_node.args[0])
    if x is None:
        return None
    dims = sum_node.args[1] if len(sum_node.args) > 1 else None
    if not dims:
        return None
    sizes = [static_int(x.shape[d]) for d in dims]
    return None if None in sizes else math.prod(sizes)


ROW_MERGES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints}


def _merges_rows(n: fx.Node) -> bool:
    """n reshapes [..., V] to [N, V]: leading dims merged in order, the last dim kept."""
    src, out = val(n.args[0]), val(n)
    if src is None or out is None or out.dim() != 2 or src.dim() < 2:
        return False
    if n.target == aten.flatten.using_ints:
        start = n.args[1] if len(n.args) > 1 else 0
        end = n.args[2] if len(n.args) > 2 else -1
        return start in (0, -src.dim()) and end in (src.dim() - 2, -2)
    return _expr(src.shape[-1]) == _expr(out.shape[-1])  # no guard on symbolic sizes


def _to_f32_same_device(n: fx.Node) -> bool:
    src, out = val(n.args[0]), val(n)
    return src is not None and out is not None and out.dtype == torch.float32 and src.device == out.device


RETURN_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor,
                aten.detach.default)


def uncast(n):
    """n with the casts on its way stripped: the node they cast."""
    while isinstance(n, fx.Node) and n.target in CASTS:
        n = n.args[0]
    return n


def returned_only(users) -> bool:
    """Each of users returns its input from the graph, directly or through views (a slice, say)."""
    return all(u.op == "output" or (u.target in RETURN_VIEWS and returned_only(u.users)) for u in users)


def _one_unreturned_user(n: fx.Node) -> bool:
    """n's users are one link of the chain plus any that only return n from the graph."""
    return sum(not returned_only([u]) for u in n.users) == 1


def _logits_chain(n) -> list[fx.Node]:
    """The links directly before a cross_entropy input, each with one user (the next link), nearest the
    loss first: casts to fp32 and [N, V] row merges (either may also be returned: Mamba returns
    ``lm_head(h).float()`` as its logits, and the loss casts them again; a hand-written head returns the
    ``view(-1, V)`` it hands the loss), ``.contiguous()`` and row slices
    (``logits[..., :-1, :]``, see is_row_slice)."""
    chain = []
    while isinstance(n, fx.Node) and n.op == "call_function" and (
            (n.target in CASTS and _to_f32_same_device(n) and _one_unreturned_user(n))
            or (n.target in ROW_MERGES and _merges_rows(n) and _one_unreturned_user(n))
            or (n.target == aten.contiguous.default and len(n.users) == 1) or is_row_slice(n)):
        chain.append(n)
        n = n.args[0]
    return chain


def is_row_slice(n: fx.Node) -> bool:
    """n slices its input over a dim other than the last (the classes), and is read once: GPT-2's
    ``lm_logits[..., :-1, :]`` shift. On the logits it commutes with the lm_head (and with the pointwise
    ops after it): the loss head applies it to the hidden states instead."""
    if n.op != "call_function" or n.target != aten.slice.Tensor or len(n.users) != 1:
        return False
    v, dim = val(n.args[0]), n.args[1] if len(n.args) > 1 else 0
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and dim % v.dim() != v.dim() - 1


def _is_vocab_prefix(n: fx.Node) -> bool:
    """n is ``z[..., :V]`` of an lm_head output z (a linear with no other user), V < z's last dim:
    the lm_head's weight padded past the vocabulary (nanochat pads it to a multiple of 64)."""
    args = list(n.args) + [None] * (5 - len(n.args))
    z, dim, start, end, step = args[:5]
    v = val(z)
    if v is None or not isinstance(z, fx.Node) or z.target != aten.linear.default or len(z.users) != 1:
        return False
    size = static_int(v.shape[-1])
    return (dim in (-1, v.dim() - 1) and start in (None, 0) and step in (None, 1) and size is not None
            and isinstance(end, int) and not isinstance(end, bool) and 0 < end < size)


def _logits_slices(n, hops: int = 8) -> list[fx.Node]:
    """The slices on the logits' way into cross_entropy past the links of _logits_chain, n its input:
    ``z[..., :V]`` (see _is_vocab_prefix) and row slices, through ops of one tensor operand and one user
    each (a scale, a softcap, casts) or a product with a tensor (a learned logit scale: either factor may
    be the logits). The vocabulary prefix reads as z: the loss head lowers with the weight's first V
    rows; a row slice reads as its input: the loss head slices the hidden states."""
    if hops == 0 or not (isinstance(n, fx.Node) and n.op == "call_function" and len(n.users) == 1):
        return []
    if n.target == aten.slice.Tensor:
        if _is_vocab_prefix(n):
            return [n]
        return [n, *_logits_slices(n.args[0], hops - 1)] if is_row_slice(n) else []
    inputs = n.all_input_nodes
    if len(inputs) == 1 or (len(inputs) == 2 and n.target == aten.mul.Tensor):
        return next((s for s in (_logits_slices(a, hops - 1) for a in inputs) if s), [])
    return []
