"""Gated-MLP activation: ``act(gate) * up`` with act silu / gelu / gelu-tanh / relu / relu^2, and
gpt-oss's clamped SwiGLU (its own op, ``fxfuse::clamped_swiglu``).

The fused op covers the activation and the product, not the matmuls: gate and up may come from two
linears, from one fused linear split by ``chunk`` / ``split`` / slicing (Phi-3's gate_up_proj, in
either order: ``*`` is commutative in the canonical view), or from anything else of the same shape.
One site is one gated-MLP activation.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.canon import val
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


def check(m) -> str | None:
    if "limit" in m.scalars:
        reason = _check_clamped(m.scalars)
        if reason:
            return reason
    g, u, out = val(m.inputs["gate"]), val(m.inputs["up"]), val(m.anchor)
    if g is None or u is None or out is None:
        return "no shape/dtype information on the inputs"
    if g.shape != u.shape:
        return f"gate {list(g.shape)} and up {list(u.shape)} differ in shape (broadcast product, not a gated MLP)"
    if g.dtype != u.dtype or out.dtype != g.dtype:
        return f"mixed dtypes gate {g.dtype}, up {u.dtype}, out {out.dtype}"
    if g.dtype not in SUPPORTED:
        return f"dtype {g.dtype} not supported (float32, bfloat16, float16)"
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


def lower(m, graph: fx.Graph, opts) -> fx.Node:
    if "limit" in m.scalars:
        import fxfuse.kernels.clamped_swiglu  # noqa: F401  registers torch.ops.fxfuse.clamped_swiglu

        s = m.scalars
        return graph.call_function(torch.ops.fxfuse.clamped_swiglu.default,
                                   (m.inputs["gate"], m.inputs["up"], float(s["alpha"]), float(s["limit"]),
                                    opts.eager_rounding))
    import fxfuse.kernels.swiglu  # noqa: F401  registers torch.ops.fxfuse.swiglu

    return graph.call_function(torch.ops.fxfuse.swiglu.default,
                               (m.inputs["gate"], m.inputs["up"], m.consts["act"], opts.eager_rounding))


def _is_candidate(n: fx.Node) -> bool:
    """silu / gelu feeding a product, or sigmoid(x) (or sigmoid(alpha * x)) multiplied by its own x
    (SiLU spelled out; gpt-oss's GLU); a sigmoid gate on something else (Qwen2-MoE's shared-expert
    gate) is not a gated MLP."""
    muls = [u for u in n.users if u.target == torch.ops.aten.mul.Tensor]
    if n.target in (torch.ops.aten.silu.default, torch.ops.aten.gelu.default):
        return bool(muls)
    if n.target == torch.ops.aten.relu.default:
        return _relu_gate(n)
    return n.target == torch.ops.aten.sigmoid.default and (
        any(n.args[0] in u.args for u in muls) or _scaled_self_gate(n))


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
    return len(xs) == 1 and any(xs[0] in u.args for u in n.users if u.target == torch.ops.aten.mul.Tensor)


def _miss_reason(n: fx.Node) -> str | None:
    if n.target == torch.ops.aten.sigmoid.default and _scaled_self_gate(n):
        return ("gate * sigmoid(alpha * gate) not in gpt-oss's clamped form (gate.clamp(max=limit), "
                "up.clamp(-limit, limit), (up + 1) * glu), the only spelling the fused kernel computes")
    return None


_bf, _f32 = torch.bfloat16, torch.float32
PATTERN = Pattern(
    name="swiglu",
    variants=(
        Variant(swiglu_silu, {"act": "silu"}),
        Variant(swiglu_sigmoid, {"act": "silu"}),
        Variant(geglu_tanh, {"act": "gelu_tanh"}),
        Variant(geglu, {"act": "gelu"}),
        Variant(reglu, {"act": "relu"}),
        Variant(reglu_squared_bitnet, {"act": "relu2"}),
        Variant(swiglu_clamped_gpt_oss, {"act": "clamped_swiglu"}),
    ),
    shapes={"gate": (2, 3, 22), "up": (2, 3, 22)},
    dtypes=({"gate": _bf, "up": _bf}, {"gate": _f32, "up": _f32}),
    check=check,
    lower=lower,
    recompute=True,
    is_candidate=_is_candidate,
    miss_reason=_miss_reason,
)
