"""Gated-MLP activation: ``act(gate) * up`` with act silu / gelu / gelu-tanh / relu / relu^2, and
gpt-oss's clamped SwiGLU and Inkling 2's softcapped one (their own ops, ``fxfuse::clamped_swiglu``,
``fxfuse::softcapped_swiglu``).

The fused op covers the activation and the product, not the matmuls: gate and up may come from two
linears, from one fused linear split by ``chunk`` / ``split`` / slicing (Phi-3's gate_up_proj, in
either order: ``*`` is commutative in the canonical view), or from anything else of the same shape.
One site is one gated-MLP activation.
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.canon_rules import CASTS, logistic_denominator, val
from fxfuse.pattern import Pattern, Variant

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def swiglu_silu(gate, up):
    """HF Llama / Mistral / Qwen2 / Phi-3 / Mixtral experts: ``act_fn(gate_proj(x)) * up_proj(x)``."""
    return F.silu(gate) * up


def swiglu_sigmoid(gate, up):
    """SiLU spelled out, as hand-written models do: ``x * sigmoid(x)``."""
    return gate * torch.sigmoid(gate) * up


def geglu_tanh(gate, up):
    """Gemma / Gemma 2 (``gelu_pytorch_tanh``): GeGLU with the tanh approximation."""
    return F.gelu(gate, approximate="tanh") * up


def geglu_gelu_new_t5(gate, up):
    """T5 v1.1 / mT5 / UMT5 / Pix2Struct "gated-gelu" (HF ``gelu_new``, NewGELUActivation): the tanh
    GELU written out, ``act(wi_0(x)) * wi_1(x)``; the same function as ``gelu(approximate="tanh")``."""
    act = 0.5 * gate * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (gate + 0.044715 * torch.pow(gate, 3.0))))
    return act * up


def geglu(gate, up):
    """GeGLU with the exact (erf) GELU."""
    return F.gelu(gate) * up


def reglu(gate, up):
    """ReGLU (GLU-variants paper): ``relu(gate) * up``."""
    return F.relu(gate) * up


def reglu_squared_bitnet(gate, up):
    """BitNet b1.58 (HF ``relu2``, ReLUSquaredActivation): ``torch.square(relu(gate)) * up``; ``pow(2)``
    and ``r * r`` are the same canonical node."""
    return torch.square(F.relu(gate)) * up


def swiglu_clamped_gpt_oss(gate, up, alpha, limit, low):
    """gpt-oss (HF GptOssExperts._apply_gate, on ``gate_up[..., ::2]`` / ``[..., 1::2]``): clamped
    gate and up, ``(up + 1) * gate * sigmoid(gate * alpha)``. The model writes ``min=-limit``; a
    captured literal cannot be negated, so ``low`` is its own parameter and check() asks low == -limit."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=low, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def swiglu_softcapped_inkling2(gate, up, gate_cap, up_cap):
    """Inkling 2 (HF Inkling2SoftcappedSwiGLU, its experts on ``gate_up.chunk(2, -1)``): the sigmoid
    sees the raw gate, softcaps bound the linear gate factor and up; fp32 math, cast back."""
    dtype = gate.dtype
    gate, up = gate.float(), up.float()
    return (torch.tanh(gate / gate_cap) * gate_cap * torch.sigmoid(gate) * (torch.tanh(up / up_cap) * up_cap)).to(dtype)


def check(m) -> str | None:
    if "gate_cap" in m.scalars:
        reason = _check_softcapped(m)
        if reason:
            return reason
    if "limit" in m.scalars:
        reason = _check_clamped(m.scalars)
        if reason:
            return reason
    g, u, out = val(m.inputs["gate"]), val(m.inputs["up"]), val(m.anchor)
    if g is None or u is None or out is None:
        return "no shape/dtype information on the inputs"
    if g.shape != u.shape:
        return f"gate {list(g.shape)} and up {list(u.shape)} differ in shape (broadcast product, not a gated MLP)"
    if g.dtype not in SUPPORTED or u.dtype not in SUPPORTED:
        return f"dtypes gate {g.dtype}, up {u.dtype} not supported (float32, bfloat16, float16)"
    plain = "limit" not in m.scalars and "gate_cap" not in m.scalars
    if out.dtype != torch.promote_types(g.dtype, u.dtype) and not (plain and _fp32_out(m)):
        return (f"mixed dtypes gate {g.dtype}, up {u.dtype}, out {out.dtype} (not their promoted dtype, nor an fp32 "
                "act(gate) times up)")
    if g.dtype != u.dtype and not plain:
        return f"mixed dtypes gate {g.dtype}, up {u.dtype}: the clamped / softcapped ops take one dtype"
    if g.device.type not in ("cuda", "cpu"):
        return f"device {g.device} not supported"
    return None


def _check_clamped(scalars: dict) -> str | None:
    alpha, limit, low = (scalars[k] for k in ("alpha", "limit", "low"))
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit, low)):
        return f"clamp bounds / alpha computed in the graph (alpha={alpha}, limit={limit}, low={low}), not literals"
    if not limit >= 0 or low != -limit:
        return f"up clamped to [{low}, {limit}], gate to max {limit}: the fused op needs up in [-limit, limit], limit >= 0"
    return None


def _check_softcapped(m) -> str | None:
    caps = (m.scalars["gate_cap"], m.scalars["up_cap"])
    if not all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 for c in caps):
        return f"softcaps {caps} are not positive literal numbers"
    g = val(m.inputs["gate"])
    upcast = any(n.target in CASTS and val(n) is not None and val(n).dtype == torch.float32 for n in m.region)
    if g is not None and g.dtype != torch.float32 and not upcast:
        return (f"softcapped SwiGLU computed in {g.dtype}: the fused kernel computes in fp32, as Inkling's "
                ".float() does, and would not round as this graph does")
    return None


def lower(m, graph: fx.Graph, opts) -> fx.Node:
    import fxfuse.kernels.softcapped_swiglu  # noqa: F401  registers fxfuse::softcapped_swiglu
    import fxfuse.kernels.swiglu_packed  # noqa: F401  registers every gated-MLP op (imports the other two)

    ops = torch.ops.fxfuse
    packed = _packed(m)
    if "gate_cap" in m.scalars:  # one rounding at the store: nothing for numerics="eager" to reproduce
        caps = (float(m.scalars["gate_cap"]), float(m.scalars["up_cap"]))
        if packed:
            return graph.call_function(ops.softcapped_swiglu_packed.default, (packed[0], *caps, *packed[1:]))
        return graph.call_function(ops.softcapped_swiglu.default, (m.inputs["gate"], m.inputs["up"], *caps))
    clamped = "limit" in m.scalars
    act = (float(m.scalars["alpha"]), float(m.scalars["limit"])) if clamped else (m.consts["act"],)
    # round act(gate) where eager stores it in gate's dtype; an act(gate) in fp32 (CUDA autocast's pow
    # in T5's GELU) is kept so
    rounding = opts.eager_rounding and not _act_in_fp32(m)
    if packed:  # (gate_up, interleaved, up_first)
        op = ops.clamped_swiglu_packed if clamped else ops.swiglu_packed
        return graph.call_function(op.default, (packed[0], *act, *packed[1:], rounding))
    op = ops.clamped_swiglu if clamped else ops.swiglu
    extra = (torch.float32,) if _fp32_out(m) else ()
    return graph.call_function(op.default, (m.inputs["gate"], m.inputs["up"], *act, rounding, *extra))


def _act_node(m) -> fx.Node | None:
    """The product's operand that is act(gate) (the one that is not up), or None."""
    args = [a for a in m.anchor.args if isinstance(a, fx.Node)]
    up = m.inputs["up"]
    if m.anchor.target != torch.ops.aten.mul.Tensor or len(args) != 2 or up not in args or args[0] is args[1]:
        return None
    return args[1] if args[0] is up else args[0]


def _act_in_fp32(m) -> bool:
    """act(gate) computed in fp32 from a low-precision gate: under CUDA autocast, where ``pow`` (T5's
    written-out GELU) and ``exp`` (SiLU from its definition) run in fp32 and the ops after them promote."""
    act, g = _act_node(m), val(m.inputs["gate"])
    a = val(act) if act is not None else None
    return a is not None and g is not None and a.dtype == torch.float32 and g.dtype != torch.float32


def _fp32_out(m) -> bool:
    """An fp32 product of an fp32 act(gate) and up where gate's and up's promoted dtype is not fp32 (both
    low-precision, of one dtype class): fxfuse::swiglu with out_dtype=float32."""
    g, u, out = val(m.inputs["gate"]), val(m.inputs["up"]), val(m.anchor)
    return (_act_in_fp32(m) and out.dtype == torch.float32
            and torch.promote_types(g.dtype, u.dtype) != torch.float32)


def packed_source(gate: fx.Node, up: fx.Node) -> tuple[fx.Node, bool, bool] | None:
    """(gate_up, interleaved, up_first) when gate and up are the two halves of one tensor's last dim,
    as fxfuse::swiglu_packed takes them: ``chunk(2, -1)`` / a two-way ``split`` (getitem 0 and 1),
    ``[..., :I]`` / ``[..., I:]``, or ``[..., ::2]`` / ``[..., 1::2]``; else None. The pattern's
    check has already asked for equal shapes, so two such halves cover gate_up exactly."""
    halves = [_half_of(n) for n in (gate, up)]
    if None in halves or halves[0][0] is not halves[1][0] or halves[0][1] != halves[1][1]:
        return None
    (src, interleaved, first), (_, _, second) = halves
    if {first, second} != {0, 1}:
        return None
    return src, interleaved, first == 1


def _half_of(n: fx.Node) -> tuple[fx.Node, bool, int] | None:
    """(gate_up, interleaved, which half 0/1) when n is one half of gate_up's last dim, else None."""
    aten = torch.ops.aten
    if n.target is operator.getitem:
        parent, index = n.args
        if not (isinstance(parent, fx.Node) and parent.target in (aten.chunk.default, aten.split.Tensor,
                                                                  aten.split_with_sizes.default)):
            return None
        parts, src = parent.meta.get("val"), parent.args[0]
        dim = parent.args[2] if len(parent.args) > 2 else parent.kwargs.get("dim", 0)
        if not (isinstance(parts, (list, tuple)) and len(parts) == 2 and _is_last_dim(src, dim)):
            return None
        return src, False, index
    if n.target != aten.slice.Tensor:
        return None
    src, dim, start, end, step = (list(n.args) + [0, None, None, 1][len(n.args) - 1:])[:5]
    start = 0 if start is None else start
    size, width = _last_size(src), _last_size(n)
    if not (_is_last_dim(src, dim) and all(isinstance(v, int) for v in (start, step, size, width))):
        return None
    if end is None or (isinstance(end, int) and end >= size):  # to the end of the dim
        if step == 2 and start in (0, 1):
            return src, True, start
        if step == 1 and start == width and 2 * width == size:
            return src, False, 1
    if step == 1 and start == 0 and end == width and 2 * width == size:
        return src, False, 0
    return None


def _last_size(n) -> int | None:
    v = val(n)
    return v.shape[-1] if isinstance(n, fx.Node) and v is not None and v.dim() > 0 else None


def _is_last_dim(src, dim) -> bool:
    v = val(src) if isinstance(src, fx.Node) else None
    return v is not None and isinstance(dim, int) and dim in (-1, v.dim() - 1)


def _packed(m) -> tuple[fx.Node, bool, bool] | None:
    """packed_source of the match's gate and up, where the packed ops take them (not for an fp32 out
    from low-precision halves: only fxfuse::swiglu takes out_dtype)."""
    if _fp32_out(m):
        return None
    return packed_source(m.inputs["gate"], m.inputs["up"])


def _unscattered_grads(m) -> list:
    """With gate and up packed in one tensor, the packed op's backward writes d gate_up itself: the
    separate dgate and dup that autograd scattered into it are not written."""
    if _packed(m) is None:
        return []
    from fxfuse.rewrite import bytes_of, example_shape

    g = val(m.inputs["gate"])
    desc = f"{str(g.dtype).removeprefix('torch.')}{example_shape(g)}"
    return [(f"grad of {k} (backward, before its scatter into gate_up's):{desc}", bytes_of(g)) for k in ("gate", "up")]


def _is_candidate(n: fx.Node) -> bool:
    """silu / gelu feeding a product, or sigmoid(x) (or sigmoid(alpha * x)) multiplied by its own x
    (SiLU spelled out; gpt-oss's GLU), or x / (1 + exp(-x)) feeding a product; a sigmoid gate on
    something else (Qwen2-MoE's shared-expert gate) is not a gated MLP."""
    muls = [u for u in n.users if u.target == torch.ops.aten.mul.Tensor]
    if n.target in (torch.ops.aten.silu.default, torch.ops.aten.gelu.default):
        return bool(muls)
    if n.target == torch.ops.aten.relu.default:
        return _relu_gate(n)
    if n.target == torch.ops.aten.div.Tensor:  # x / (1 + exp(-x)), SiLU from its definition, times up
        return logistic_denominator(n.args[1]) is n.args[0] and any(
            u.target == torch.ops.aten.mul.Tensor for u in n.users)
    return n.target == torch.ops.aten.sigmoid.default and (
        any(n.args[0] in u.args and _times_another(u) for u in muls) or _scaled_self_gate(n)
        or _transformed_self_gate(n) or _reassociated(n))


def _reassociated(n: fx.Node) -> bool:
    """sigmoid(x) times another tensor first, that product then times x: ``x * (sigmoid(x) * up)``."""
    x, mul = n.args[0], torch.ops.aten.mul.Tensor
    return any(u.target == mul and x not in u.args and any(v.target == mul and x in v.args for v in u.users)
               for u in n.users)


def _times_another(prod: fx.Node) -> bool:
    """prod (an activation written out: x * sigmoid(x)) is multiplied by another tensor, an up
    projection; alone it is a plain activation (CLIP's quick_gelu, x * sigmoid(1.702 x)), no gated MLP."""
    return any(u.target == torch.ops.aten.mul.Tensor and any(isinstance(a, fx.Node) and a is not prod for a in u.args)
               for u in prod.users)


def _relu_gate(n: fx.Node) -> bool:
    """relu(gate) * up (ReGLU) or relu(gate)^2 * up (BitNet's relu2): a product of relu(x), or of its
    square (square, pow 2 or x * x), with another tensor."""
    aten = torch.ops.aten
    outs = [n] + [u for u in n.users if u.target == aten.square.default
                  or (u.target == aten.pow.Tensor_Scalar and u.args[1] == 2)
                  or (u.target == aten.mul.Tensor and u.args[0] is n and u.args[1] is n)]
    return any(v.target == aten.mul.Tensor and v.args[0] is not v.args[1] and not (o is n and v in outs)
               for o in outs for v in o.users)


def _scaled_self_gate(n: fx.Node) -> bool:
    """sigmoid(alpha * x) multiplied by x: gpt-oss's ``gate * sigmoid(gate * alpha)``."""
    arg = n.args[0]
    if not (isinstance(arg, fx.Node) and arg.target == torch.ops.aten.mul.Tensor):
        return False
    xs = [a for a in arg.args if isinstance(a, fx.Node)]
    return len(xs) == 1 and any(xs[0] in u.args and _times_another(u) for u in n.users
                                if u.target == torch.ops.aten.mul.Tensor)


def _transformed_self_gate(n: fx.Node, hops: int = 3) -> bool:
    """sigmoid(x) multiplied by a function of x a few elementwise ops away (Inkling's softcapped SwiGLU:
    ``c * tanh(gate / c) * sigmoid(gate)``), not by x itself."""
    x = n.args[0]
    for u in n.users:
        if u.target != torch.ops.aten.mul.Tensor or x in u.args:
            continue
        frontier = [a for a in u.args if isinstance(a, fx.Node) and a is not n]
        for _ in range(hops):
            frontier = [a for f in frontier if f.op == "call_function" for a in f.all_input_nodes]
            if x in frontier:
                return True
    return False


def _miss_reason(n: fx.Node) -> str | None:
    if n.target == torch.ops.aten.sigmoid.default and _reassociated(n):
        return ("SiLU's product reassociated, gate * (sigmoid(gate) * up): the fused op computes "
                "(gate * sigmoid(gate)) * up, which rounds otherwise; write F.silu(gate) * up")
    if n.target == torch.ops.aten.sigmoid.default and _scaled_self_gate(n):
        return ("gate * sigmoid(alpha * gate) not in gpt-oss's clamped form (gate.clamp(max=limit), "
                "up.clamp(-limit, limit), (up + 1) * glu), the only spelling the fused kernel computes")
    if n.target == torch.ops.aten.sigmoid.default and _transformed_self_gate(n):
        return ("sigmoid(gate) times a function of gate other than gate itself, not in Inkling 2's softcapped "
                "form (c * tanh(gate / c) * sigmoid(gate) * k * tanh(up / k)), the one such gate a fused kernel "
                "computes")
    return None


_bf, _f32 = torch.bfloat16, torch.float32
PATTERN = Pattern(
    name="swiglu",
    variants=(
        Variant(swiglu_silu, {"act": "silu"}),
        Variant(swiglu_sigmoid, {"act": "silu"}),
        Variant(geglu_tanh, {"act": "gelu_tanh"}),
        Variant(geglu_gelu_new_t5, {"act": "gelu_tanh"}),
        Variant(geglu, {"act": "gelu"}),
        Variant(reglu, {"act": "relu"}),
        Variant(reglu_squared_bitnet, {"act": "relu2"}),
        Variant(swiglu_clamped_gpt_oss, {"act": "clamped_swiglu"}),
        Variant(swiglu_softcapped_inkling2, {"act": "softcapped_swiglu"}),
    ),
    shapes={"gate": (2, 3, 22), "up": (2, 3, 22)},
    dtypes=({"gate": _bf, "up": _bf}, {"gate": _f32, "up": _f32}),
    check=check,
    lower=lower,
    recompute=True,
    hidden_saved=_unscattered_grads,
    is_candidate=_is_candidate,
    miss_reason=_miss_reason,
)
