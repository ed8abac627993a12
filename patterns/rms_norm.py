"""RMSNorm: ``y = x / sqrt(mean(x^2, -1) + eps) * w`` in the spellings real models use.

Each function below is copied from how a model family writes it; the canonical view (fxfuse/canon.py)
already unifies ``x * x`` / ``pow(2)``, ``mean`` / ``sum / N`` / ``sum * (1 / N)``, ``* rsqrt`` / ``/ sqrt`` /
``** -0.5`` / ``/ ** 0.5``, and drops casts that do not change dtype, so an fp32 model matches the same
functions. Per-head q/k norms on [B, T, H, D] are the same functions (the reduction is over the last
dim only).
An L2 norm with eps under the root, ``x * rsqrt(sum(x^2) + eps)``, is the same op with eps / D and a
constant 1 / sqrt(D) weight (the ``l2norm_*`` variants): it counts as an RMSNorm site.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.canon import CASTS, val
from fxfuse.canon_rules import is_sqrt, uncast
from fxfuse.shapes import RESHAPES
from fxfuse.pattern import Pattern, Variant

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def rmsnorm_llama(x, w, eps):
    """HF Llama, Mistral, Qwen2, Phi-3, ...: normalise in fp32, cast back, then weight."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(x.dtype)


def rmsnorm_gemma(x, w, eps, offset):
    """HF Gemma / Gemma 2 / Gemma 3: weight stored as w - 1, multiplied as (1 + w) in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = h * (offset + w.float())
    return h.type_as(x)


def rmsnorm_weight_fp32(x, w, eps):
    """GPT-OSS, T5: the weight multiply happens in fp32, the cast comes last."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h).to(x.dtype)


def rmsnorm_plain(x, w, eps):
    """Hand-written models (nanoGPT-style, gpt-fast in fp32): no casts at all."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rmsnorm_torch(x, w, eps):
    """torch.nn.RMSNorm / F.rms_norm (aten.rms_norm; eps=None means the fp32 machine epsilon)."""
    return F.rms_norm(x, x.shape[-1:], w, eps)


def rmsnorm_no_weight(x, eps):
    """elementwise_affine=False norms (OLMo-style, some q/k norms)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


def rmsnorm_torch_no_weight(x, eps):
    """torch.nn.RMSNorm(elementwise_affine=False)."""
    return F.rms_norm(x, x.shape[-1:], None, eps)


def l2norm_fla(x, eps):
    """Linear attention's q / k norm (Qwen3-Next, Qwen3.5, OLMo-hybrid, Kimi Linear, Lara, after the FLA
    library): the inverse root of the sum of squares, eps under the root, in the input dtype. It is an
    RMSNorm with eps / D, scaled by 1 / sqrt(D): lowered to one fused call with that constant weight."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_ngpt(x, eps):
    """nGPT-style hidden-state norm (Dory's L2Norm): the same in fp32, cast back."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).sum(-1, keepdim=True) + eps)).type_as(x)


def check(m) -> str | None:
    x, w = val(m.inputs["x"]), val(m.inputs.get("w"))
    out = val(m.anchor)
    if x is None or out is None:
        return "no shape/dtype information on the input"
    for name, t in (("input", x), ("weight", w), ("output", out)):
        if t is not None and t.dtype not in SUPPORTED:
            return f"{name} dtype {t.dtype} not supported (float32, bfloat16, float16)"
    if x.device.type not in ("cuda", "cpu"):
        return f"device {x.device} not supported"
    if w is not None and (w.dim() != 1 or w.shape[0] != x.shape[-1]):
        return f"weight shape {list(w.shape)} is not [{x.shape[-1]}] (the normalised dim)"
    low = {val(n).dtype for n in m.region if n.target in CASTS and val(n).dtype != torch.float32}
    if low - {x.dtype}:
        return f"casts to {sorted(map(str, low))}, not to the input dtype {x.dtype}"
    eps = m.scalars.get("eps")
    if eps is not None and not isinstance(eps, (int, float)):
        return f"eps {eps!r} is not a constant number"
    if _centred_input(m.inputs["x"]):
        return ("the RMS part of a LayerNorm written out (its input is x - mean(x), I-BERT's IntLayerNorm): "
                "fused alone it would write x - mean(x) to memory and split the LayerNorm that Inductor "
                "fuses whole; fxfuse fuses RMSNorm, not LayerNorm")
    if m.consts.get("l2") and not isinstance(x.shape[-1], int):
        return f"an L2 norm over a symbolic dim ({x.shape[-1]}): its 1 / sqrt(D) weight needs D's value"
    return None


def lower(m, graph: fx.Graph, opts) -> fx.Node:
    import fxfuse.kernels.rms_norm  # noqa: F401  registers torch.ops.fxfuse.rms_norm

    x = m.inputs["x"]
    eps = m.scalars.get("eps")
    if eps is None:  # aten.rms_norm's default: machine epsilon of the fp32 compute type
        eps = torch.finfo(torch.float32 if val(x).dtype != torch.float64 else torch.float64).eps
    w = m.inputs.get("w")
    if m.consts.get("l2"):  # x * rsqrt(sum(x^2) + eps) = x * rsqrt(mean(x^2) + eps / D) * D ** -0.5
        d = val(x).shape[-1]
        eps = eps / d
        w = graph.call_function(torch.ops.aten.full.default, ([d], d ** -0.5), {
            "dtype": torch.float32, "device": val(x).device, "pin_memory": False})
    args = (x, w, float(eps), float(m.scalars.get("offset", 0.0)),
            m.consts["cast_before_weight"], val(m.anchor).dtype, opts.eager_rounding)
    return graph.call_function(torch.ops.fxfuse.rms_norm.default, args)


def _centred(rsqrt: fx.Node, hops: int = 5) -> bool:
    """A subtraction or var/std a few ops upstream of the rsqrt: a LayerNorm (Cohere writes its own),
    not an RMSNorm candidate."""
    aten = torch.ops.aten
    centring = {aten.sub.Tensor, aten.var.correction, aten.var.dim, aten.var_mean.correction, aten.var_mean.dim,
                aten.std.correction, aten.std.dim}
    frontier = [rsqrt]
    for _ in range(hops):
        frontier = [a for n in frontier for a in n.all_input_nodes]
        if any(a.target in centring for a in frontier):
            return True
    return False


def _centred_input(x) -> bool:
    """x is ``a - a.mean(-1, keepdim=True)`` (through casts): the centred input of a LayerNorm."""
    aten = torch.ops.aten
    x = uncast(x)
    if not (isinstance(x, fx.Node) and x.target == aten.sub.Tensor and isinstance(x.args[1], fx.Node)):
        return False
    a, mean = x.args[0], uncast(x.args[1])
    if not (mean.target == aten.mean.dim and len(mean.args) > 1 and mean.args[0] is a):
        return False
    dims = mean.args[1]
    last = {-1, val(a).dim() - 1} if isinstance(a, fx.Node) and val(a) is not None else {-1}
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in last


def _inverse_root(n: fx.Node) -> bool:
    """rsqrt, or a sqrt that is divided by or inverted (``x / sqrt(v)``, ``1 / sqrt(v)``)."""
    aten = torch.ops.aten
    if n.target == aten.rsqrt.default:
        return True
    return is_sqrt(n) and any(
        u.target == aten.reciprocal.default or (u.target == aten.div.Tensor and u.args[1] is n) for u in n.users)


def _miss_reason(n: fx.Node) -> str | None:
    """A near miss that is no RMSNorm: the inverse root of a sum of squares with no eps under it, a
    norm that divides its own source with eps outside the root or as a floor (F.normalize), or an
    inverse RMS that scales another tensor."""
    aten = torch.ops.aten
    chain = _divided_root(n)
    if chain and any(c.target == aten.clamp_min.default for c in chain):
        return ("an L2 normalisation, F.normalize's x / max(||x||, eps) (x-transformers' RMSNorm scales it "
                "by sqrt(D)): eps floors the norm instead of sitting under the root, so it equals an RMSNorm "
                "only where ||x|| >= eps (a zero row gives 0, not NaN); no fused kernel computes that floor")
    if chain and any(c.target == aten.add.Tensor for c in chain):
        return ("eps added to the root, not under it: x / (rms(x) + eps) (the RMSNorm paper's reference code) "
                "is another function than x * rsqrt(mean(x^2) + eps), the one the fused kernel computes")
    if n.target == aten.linalg_vector_norm.default:
        return _L2_REASON
    v = n.args[0] if n.target != aten.rms_norm.default else None
    if (isinstance(v, fx.Node) and v.target in (aten.clamp.default, aten.clamp_min.default)
            and len(v.args) > 1 and v.args[1] is not None  # a floor: clamp(max=...) alone is no eps
            and isinstance(v.args[0], fx.Node) and v.args[0].target == aten.mean.dim):
        return ("eps as a floor under the root, sqrt(clamp(mean(x^2), min=eps)) (Gemma 3n's AltUp magnitude "
                "matching): another function than rsqrt(mean(x^2) + eps) wherever mean(x^2) < eps, the one the "
                "fused kernel computes")
    eps_under_root = isinstance(v, fx.Node) and v.target == aten.add.Tensor
    if eps_under_root:
        v = next((a for a in v.args if isinstance(a, fx.Node)), None)
    if isinstance(v, fx.Node) and v.target == aten.sum.dim_IntList:
        return _L2_OTHER_REASON if eps_under_root else _L2_REASON
    if isinstance(v, fx.Node) and v.target == aten.mean.dim and not _scales_its_source(n, v.args[0]):
        return ("the inverse RMS of x is not multiplied into x (it scales another tensor: DeepSeek-V4's "
                "hyper-connection mixes, say), so no normalized x is written to fuse away")
    if isinstance(v, fx.Node) and v.target == aten.mean.dim and not _keepdim(v):
        return ("the mean of x^2 is taken without keepdim and its dim put back later (unsqueeze, [..., None]), "
                "but a value in between is also read elsewhere in the shape without the dim, so it cannot be "
                "read as the keepdim form the fused kernel computes")
    return None


def _keepdim(mean: fx.Node) -> bool:
    return bool(mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))


_L2_REASON = ("an L2 norm (the root of the sum of squares) with no eps under the root (x / ||x||, "
              "linalg.vector_norm): the L2 variants fuse x * rsqrt(sum(x^2) + eps) only")
_L2_OTHER_REASON = ("an L2 norm with eps under the root, written in a way no l2norm variant covers (the sum "
                    "over another dim than the last, or of another tensor's squares than the one it scales)")


def _divided_root(n: fx.Node, hops: int = 4) -> list[fx.Node] | None:
    """[n, ..., divisor] when n is the root of x's squares (``linalg_vector_norm(x)``, ``x.norm()``, or
    ``sqrt(mean(x^2))`` / ``sqrt(sum(x^2))`` with nothing added under it) and a few literal-operand ops
    after it (``* D ** -0.5``, ``+ eps``, ``clamp_min(eps)``, an expand or cast) the result divides x;
    else None."""
    aten = torch.ops.aten
    if n.target == aten.linalg_vector_norm.default:
        order = n.args[1] if len(n.args) > 1 else n.kwargs.get("ord", 2)
        src = uncast(n.args[0]) if order == 2 else None
    elif is_sqrt(n) and isinstance(n.args[0], fx.Node) and n.args[0].target in (aten.mean.dim, aten.sum.dim_IntList):
        square = n.args[0].args[0]
        src = uncast(square.args[0]) if isinstance(square, fx.Node) and (
            square.target == aten.square.default or (square.target == aten.pow.Tensor_Scalar and square.args[1] == 2)
            or (square.target == aten.mul.Tensor and square.args[0] is square.args[1])) else None
    else:
        return None
    if src is None:
        return None
    steps = {aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.clamp_min.default, aten.expand.default,
             aten.expand_as.default, *CASTS}
    chain = [n]
    for _ in range(hops):
        cur = chain[-1]
        for u in cur.users:
            if u.target == aten.div.Tensor and u.args[1] is cur and uncast(u.args[0]) is src:
                return chain
        nxt = [u for u in cur.users if u.target in steps and u.args[0] is cur
               and all(not isinstance(a, fx.Node) or u.target == aten.expand_as.default for a in u.args[1:])]
        if len(nxt) != 1:
            return None
        chain.append(nxt[0])
    return None


def _scales_its_source(root: fx.Node, square: fx.Node) -> bool:
    """Some product (or quotient, for a root) takes root (a cast, reciprocal or unsqueeze / reshape of it)
    and the tensor whose square was averaged (or a cast of it)."""
    aten = torch.ops.aten
    squares = (aten.square.default, aten.pow.Tensor_Scalar)
    if not (isinstance(square, fx.Node) and (
            square.target in squares or (square.target == aten.mul.Tensor and square.args[0] is square.args[1]))):
        return True  # not a square we can follow: no claim
    src = uncast(square.args[0])
    roots, users = {root}, list(root.users)
    while users:
        u = users.pop()
        if u.target in CASTS or u.target in (aten.reciprocal.default, aten.unsqueeze.default, *RESHAPES):
            roots.add(u)
            users += list(u.users)
        elif u.target == aten.mul.Tensor and any(uncast(a) is src for a in u.args if a not in roots):
            return True
        elif u.target == aten.div.Tensor and u.args[1] in roots and uncast(u.args[0]) is src:
            return True
    return False


_bf, _f32 = torch.bfloat16, torch.float32
PATTERN = Pattern(
    name="rms_norm",
    variants=(
        Variant(rmsnorm_llama, {"cast_before_weight": True}),
        Variant(rmsnorm_gemma, {"cast_before_weight": False}),
        Variant(rmsnorm_weight_fp32, {"cast_before_weight": False}),
        Variant(rmsnorm_plain, {"cast_before_weight": False}),
        Variant(rmsnorm_torch, {"cast_before_weight": False}),
        Variant(rmsnorm_no_weight, {"cast_before_weight": True}),
        Variant(rmsnorm_torch_no_weight, {"cast_before_weight": False}),
        Variant(l2norm_fla, {"cast_before_weight": False, "l2": True}),
        Variant(l2norm_ngpt, {"cast_before_weight": False, "l2": True}),
    ),
    shapes={"x": (2, 3, 22), "w": (22,)},
    dtypes=({"x": _bf, "w": _bf}, {"x": _f32, "w": _f32}, {"x": _bf, "w": _f32}),
    check=check,
    lower=lower,
    recompute=True,
    is_candidate=lambda n: n.target == torch.ops.aten.rms_norm.default or (
        (_inverse_root(n) or _divided_root(n) is not None) and not _centred(n)),
    miss_reason=_miss_reason,
)
