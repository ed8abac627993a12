"""lm_head + cross-entropy: ``cross_entropy(view(float(softcap(x @ W.T + b) * s)), target)``.

The fused op never materialises the [N, V] logits, their fp32 copy or their gradient. Spellings:
HF ``ForCausalLMLoss`` (``logits.float()``, ``view(-1, V)``), Gemma 2's softcap
``tanh(z / c) * c``, a logit scale (Cohere ``* s``, Granite ``/ s``), each with or without a bias,
each before the ``.float()`` (HF) or after it (nanochat's fp32 softcap), modded-nanogpt's fp32
``30 * sigmoid(z / k)`` (a shifted softcap), a learned logit scale tensor (Dory's, nGPT's per-vocabulary
``s_z``, or one number: the op's ``vocab_scale``, multiplied in fp32, its gradient summed by the
kernels), and class dim second (``[B, V, T]`` with ``[B, T]``
targets). The canonical view (fxfuse/canon.py) makes the rest the same graphs: ``x @ W.t()``
reads as ``F.linear`` (normalize.canonical_linear), and the casts to fp32 and [N, V] row merges on
the logits' way into cross_entropy disappear, so
torchtitan's ``flatten(0, 1).float()``, nanoGPT's uncast ``view(-1, V)`` and 2-D hidden states all
match ``lce_hf`` (check then requires cross_entropy's input to be [N, V]).
reduction ("none" too: per-token losses, as litgpt's chunked loss and masked or weighted SFT losses
take them), ignore_index and label_smoothing are captured (HF's ``sum / num_items_in_batch`` keeps
its division outside the site). Label pad-and-shift stays outside: the target is whatever the graph
hands cross_entropy.

Logits a model returns (HF does) are an escaping value: they stay computed by the same ops from
detached x and W, so the user gets exact values while no gradient, fp32 copy or logits-sized
backward tangent exists for them. No gradient flows through them: a backward that reaches them
raises (fxfuse/skipped.py guards those outputs); a loss that must backpropagate through returned
logits needs ``patterns`` without ``linear_cross_entropy``.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxfuse.canon import val
from fxfuse.canon_rules import CASTS, is_row_slice, returned_only, uncast
from fxfuse.pattern import Pattern, Variant

from ._lce_sites import is_candidate, miss_reason

aten = torch.ops.aten
SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # aten's reduction enum


def _ce(logits, target, ignore_index, label_smoothing):
    """F.cross_entropy; its reduction (aten's enum, literal 3 of aten.cross_entropy_loss) is a free
    literal of the pattern, captured as "reduction"."""
    return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)


def lce_hf(x, w, target, ignore_index=-100, label_smoothing=0.0):
    """HF ForCausalLMLoss: lm_head, logits.float(), view(-1, V)."""
    logits = F.linear(x, w).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_hf_softcap(x, w, target, softcap=30.0, ignore_index=-100, label_smoothing=0.0):
    """Gemma 2: final_logit_softcapping before the loss."""
    logits = torch.tanh(F.linear(x, w) / softcap) * softcap
    logits = logits.float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_hf_scaled(x, w, target, logit_scale=1.0, ignore_index=-100, label_smoothing=0.0):
    """Cohere: logits * logit_scale before the loss."""
    logits = (F.linear(x, w) * logit_scale).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_hf_divided(x, w, target, logits_scaling=1.0, ignore_index=-100, label_smoothing=0.0):
    """Granite: logits / logits_scaling before the loss."""
    logits = (F.linear(x, w) / logits_scaling).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_hf_bias(x, w, b, target, ignore_index=-100, label_smoothing=0.0):
    """An lm_head with a bias."""
    logits = F.linear(x, w, b).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_logits_bias_bart(x, w, b, target, ignore_index=-100, label_smoothing=0.0):
    """BART and its kin (mBART, Marian, Pegasus, Blenderbot, PLBart, MVP, LED): an unbiased lm_head, then
    ``+ final_logits_bias`` (a [1, V] buffer) added on its own; check asks one bias per vocabulary entry."""
    logits = F.linear(x, w) + b
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_softcap(x, w, b, target, softcap=30.0, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head (GPT-J, Phi-2, CodeGen) before Gemma 2's softcap."""
    logits = torch.tanh(F.linear(x, w, b) / softcap) * softcap
    return _ce(logits.float().view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_scaled(x, w, b, target, logit_scale=1.0, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head before Cohere's logit scale."""
    logits = (F.linear(x, w, b) * logit_scale).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_divided(x, w, b, target, logits_scaling=1.0, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head before Granite's logits / logits_scaling."""
    logits = (F.linear(x, w, b) / logits_scaling).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_softcap_nanochat(x, w, target, softcap=15.0, ignore_index=-1, label_smoothing=0.0):
    """nanochat: logits.float() ("switch to fp32 for logit softcap and loss computation"), then
    softcap * tanh(logits / softcap); its logits[..., :vocab_size] of a padded lm_head reads as the
    lm_head (canon_rules._vocab_slice)."""
    logits = F.linear(x, w).float()
    logits = softcap * torch.tanh(logits / softcap)
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_fp32_scaled(x, w, target, logit_scale=1.0, ignore_index=-100, label_smoothing=0.0):
    """A logit scale applied after the .float() (in fp32)."""
    logits = F.linear(x, w).float() * logit_scale
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_fp32_divided(x, w, target, logits_scaling=1.0, ignore_index=-100, label_smoothing=0.0):
    """A logit divisor applied after the .float() (in fp32)."""
    logits = F.linear(x, w).float() / logits_scaling
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_fp32_softcap(x, w, b, target, softcap=30.0, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head, .float(), then the softcap in fp32."""
    logits = softcap * torch.tanh(F.linear(x, w, b).float() / softcap)
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_fp32_scaled(x, w, b, target, logit_scale=1.0, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head, .float(), then a logit scale in fp32."""
    logits = F.linear(x, w, b).float() * logit_scale
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_fp32_divided(x, w, b, target, logits_scaling=1.0, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head, .float(), then a logit divisor in fp32."""
    logits = F.linear(x, w, b).float() / logits_scaling
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_vocab_scaled(x, w, target, s, ignore_index=-100, label_smoothing=0.0):
    """A learned logit scale tensor (a [V] vector, nGPT's s_z, or a scalar) before the .float()."""
    logits = (F.linear(x, w) * s).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_fp32_vocab_scaled_dory(x, w, target, s, ignore_index=-100, label_smoothing=0.0):
    """Dory's lm_head: logits.float() times its learned per-vocabulary scale (s.float() * factor)."""
    logits = F.linear(x, w).float() * s
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_vocab_scaled(x, w, b, target, s, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head before a learned logit scale tensor."""
    logits = (F.linear(x, w, b) * s).float()
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_bias_fp32_vocab_scaled(x, w, b, target, s, ignore_index=-100, label_smoothing=0.0):
    """A biased lm_head, .float(), then a learned logit scale tensor in fp32."""
    logits = F.linear(x, w, b).float() * s
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_sigmoid_modded_nanogpt(x, w, target, sigmoid_cap=30.0, sigmoid_temperature=1.0, ignore_index=-100,
                               label_smoothing=0.0):
    """modded-nanogpt: lm_head(x).float(), then 30 * sigmoid(logits / (7.5 * sqrt(H))): a tanh softcap
    of cap / 2 shifted up by cap / 2 (cap * sigmoid(u) = cap / 2 * (1 + tanh(u / 2))), and
    cross-entropy does not see a shift of every logit."""
    logits = sigmoid_cap * torch.sigmoid(F.linear(x, w).float() / sigmoid_temperature)
    return _ce(logits.view(-1, logits.shape[-1]), target, ignore_index, label_smoothing)


def lce_class_dim_second(x, w, target2d, ignore_index=-100, label_smoothing=0.0):
    """cross_entropy on [B, V, T] logits with [B, T] targets."""
    return _ce(F.linear(x, w).float().transpose(1, 2), target2d, ignore_index, label_smoothing)


def _x(m) -> fx.Node:
    return m.inputs["x"]


def _target(m) -> fx.Node:
    return m.inputs.get("target", m.inputs.get("target2d"))


def check(m) -> str | None:
    x, w, t = val(_x(m)), val(m.inputs["w"]), val(_target(m))
    b = val(m.inputs.get("b"))
    if x is None or w is None or t is None:
        return "no shape/dtype information on the inputs"
    dtypes = f"x {x.dtype}, W {w.dtype}{f', b {b.dtype}' if b is not None else ''}"
    if any(t.dtype not in SUPPORTED for t in (x, w, b) if t is not None):
        return f"dtypes {dtypes} not supported (one of float32, bfloat16, float16)"
    # under autocast the lm_head casts its fp32 operands to the low dtype it computes in; else all agree
    low = val(_logits_node(m)).dtype
    in_linear = [x, w] + ([b] if b is not None and m.variant.fn is not lce_logits_bias_bart else [])
    if any(t.dtype not in (low, torch.float32) for t in in_linear):
        return f"mixed dtypes {dtypes} for an lm_head computing in {low}"
    if x.device.type not in ("cuda", "cpu"):
        return f"device {x.device} not supported"
    if t.dtype != torch.int64:
        return f"targets are {t.dtype}, not class indices (int64)"
    if m.scalars.get("reduction") not in REDUCTIONS:
        return f"reduction enum {m.scalars.get('reduction')!r} not known"
    if w.dim() != 2:
        return f"weight {list(w.shape)} is not [V, H]"
    if b is not None and (b.numel() != w.shape[0] or any(d != 1 for d in b.shape[:-1])):
        return (f"bias of shape {list(b.shape)} is not one number per vocabulary entry "
                f"([{w.shape[0]}] or [1, {w.shape[0]}])")
    if m.variant.fn is lce_logits_bias_bart:
        low, added = val(_logits_node(m)).dtype, val(_bias_add(m)).dtype
        if added != low:
            return (f"the bias add promotes the {low} logits to {added} (a {b.dtype} bias under autocast): the "
                    "fused op would add it in the lm_head's dtype")
    scale = val(m.inputs.get("s"))
    if scale is not None:
        if scale.dtype not in SUPPORTED:
            return f"logit scale dtype {scale.dtype} not supported (float32, bfloat16, float16)"
        vocab = _vocab_rows(m)
        if tuple(scale.shape) not in ((), (1,), (vocab,)):
            return (f"logit scale of shape {list(scale.shape)} is neither per vocabulary entry ([{vocab}]) "
                    "nor one number")
    if not all(_slices_lm_head_rows(m, sl) for sl in _row_slices(m)):
        return ("the logits are sliced over rows after a reshape or transpose: only a slice of the lm_head's "
                "[..., V] output as laid out in x (logits[..., :-1, :]) commutes with it")
    logits = val(m.anchor.args[0])
    if m.variant.fn is lce_class_dim_second:
        return _classes_second_reason(m)
    if logits is None or logits.dim() != 2:
        # the canonical view elides the [N, V] row merges before cross_entropy (canon_rules._logits_chain)
        return (f"cross_entropy's input has shape {list(logits.shape) if logits is not None else '?'}, not "
                "[N, V] logits (with its class dim elsewhere the fused op would read the wrong axis)")
    return None


def _classes_second_reason(m) -> str | None:
    """None where cross_entropy reads [B, V, T] logits made by swapping the last two dims of the
    lm_head's [B, T, V] output (casts between them only), so its class dim 1 is the vocabulary. The
    pattern's transpose matches any two last dims: a 2-D z.T, a 4-D [B, T, S, V] swapped to
    [B, T, V, S] or a transpose reshaped to rows put tokens, not the vocabulary, in dim 1."""
    n, shape = uncast(m.anchor.args[0]), val(m.anchor.args[0]).shape
    if n.target != aten.transpose.int or len(shape) != 3 or val(n.args[0]).dim() != 3:
        return (f"cross_entropy's input has shape {list(shape)}, not the [B, T, V] logits with their last two "
                "dims swapped: its class dim 1 would not be the vocabulary")
    return None


def _logits_node(m) -> fx.Node:
    (n,) = [n for n in m.region if n.target in (aten.linear.default, aten.matmul.default)]
    return n


def _bias_add(m) -> fx.Node:
    """lce_logits_bias_bart's ``logits + b`` (the logits cast first or not)."""
    z = _logits_node(m)
    (n,) = [n for n in m.region if n.target == aten.add.Tensor and z in map(uncast, n.args)]
    return n


def _vocab_prefix(m) -> int | None:
    """V where the logits are the lm_head's output sliced to its first V columns, else None."""
    z = _logits_node(m)
    sl = [n for n in m.region if n.target == aten.slice.Tensor and n.args[0] is z and not is_row_slice(n)]
    return sl[0].args[3] if sl else None


def _row_slices(m) -> list[fx.Node]:
    """The row slices on the way from the lm_head to the loss (``logits[..., :-1, :]``), lm_head first."""
    order = {n: i for i, n in enumerate(m.anchor.graph.nodes)}
    return sorted((n for n in m.region if is_row_slice(n)), key=order.__getitem__)


def _slices_lm_head_rows(m, sl: fx.Node) -> bool:
    """Between the lm_head and the row slice sl only elementwise ops, casts and other row slices: sl's
    dim is the same dim of x."""
    n, z = sl.args[0], _logits_node(m)
    while n is not z:
        if not (is_row_slice(n) or n.target in (*CASTS, aten.contiguous.default) or (
                isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags)):
            return False
        inputs = [a for a in n.all_input_nodes if a in m.region]
        if len(inputs) != 1:
            return False
        n = inputs[0]
    return True


def _vocab_rows(m) -> int:
    """The lm_head rows the loss reads: V of a padded head's logits sliced to z[..., :V], else all."""
    return _vocab_prefix(m) or val(m.inputs["w"]).shape[0]


def _transform(scalars: dict) -> tuple[float, float]:
    """(softcap, logit scale) of the fused op: z = softcap * tanh(scale * zr / softcap) (no softcap: 0).
    A sigmoid cap c * sigmoid(zr / k) is the softcap c / 2 of zr * c / (4 k), shifted by c / 2."""
    if "sigmoid_cap" in scalars:
        cap, k = float(scalars["sigmoid_cap"]), float(scalars["sigmoid_temperature"])
        return cap / 2, cap / (4 * k)
    if "logits_scaling" in scalars:
        return float(scalars.get("softcap", 0.0)), 1.0 / float(scalars["logits_scaling"])
    return float(scalars.get("softcap", 0.0)), float(scalars.get("logit_scale", 1.0))


def lower(m, graph: fx.Graph, opts) -> fx.Node:
    import fxfuse.kernels.linear_cross_entropy  # noqa: F401  registers torch.ops.fxfuse.linear_cross_entropy

    call = graph.call_function
    x, w, b = _x(m), m.inputs["w"], m.inputs.get("b")
    low = val(_logits_node(m)).dtype
    # autocast ran the lm_head in low precision: cast its operands as it does (x may already be low, W fp32)
    x, w, b = (t if t is None or val(t).dtype == low else call(aten.to.dtype, (t, low)) for t in (x, w, b))
    if b is not None and val(m.inputs["b"]).dim() != 1:  # BART's [1, V] final_logits_bias
        b = call(aten.reshape.default, (b, [-1]))
    vocab = _vocab_prefix(m)
    if vocab is not None:  # logits z[..., :V] of a padded lm_head: its first V rows (canon_rules._vocab_slice)
        w = call(aten.slice.Tensor, (w, 0, 0, vocab))
        b = call(aten.slice.Tensor, (b, 0, 0, vocab)) if b is not None else None
    vscale = None
    if "s" in m.inputs:  # a learned scale [V] (or one number, expanded): the op multiplies in fp32
        vscale = call(aten.to.dtype, (m.inputs["s"], torch.float32))
        if tuple(val(m.inputs["s"]).shape) != (_vocab_rows(m),):
            vscale = call(aten.expand.default, (call(aten.reshape.default, (vscale, [1])), [_vocab_rows(m)]))
    for sl in _row_slices(m):  # logits[..., :-1, :] is lm_head(x[..., :-1, :])
        x = call(aten.slice.Tensor, (x, *sl.args[1:]), sl.kwargs)
    x = call(aten.flatten.using_ints, (x, 0, -2))
    target = call(aten.flatten.using_ints, (_target(m), 0, -1))
    s = m.scalars
    loss = call(torch.ops.fxfuse.linear_cross_entropy.default, (
        x, w, b, target, int(s["ignore_index"]), REDUCTIONS[s["reduction"]], float(s["label_smoothing"]),
        *_transform(s), opts.loss_head_algorithm(), opts.eager_rounding and "s" not in m.inputs,
        m.variant.consts.get("fp32_transform", False), *([vscale] if vscale is not None else [])))
    if REDUCTIONS[s["reduction"]] == "none":  # row losses [N] in the target's shape ([B, T]: class dim second)
        loss = call(aten.view_as.default, (loss, _target(m)))
    out_dtype = val(m.anchor).dtype
    return loss if out_dtype == torch.float32 else call(aten.to.dtype, (loss, out_dtype))


def _hidden(m) -> list:
    """cross_entropy writes an fp32 log-softmax of the logits, kept for backward, and backward writes
    the logits' gradient: both [N, V], both gone with the fused op."""
    from fxfuse.rewrite import bytes_of, example_shape

    shape = example_shape(val(m.anchor.args[0]))  # [N, V] or [B, V, T], at the example inputs
    dtype = val(_logits_node(m)).dtype
    rows, vocab = math.prod(shape) // shape[1], shape[1]
    f32 = torch.empty((rows, vocab), dtype=torch.float32, device="meta")
    grad = f32.to(dtype)
    return [(f"log_softmax (in cross_entropy):float32[{rows}, {vocab}]", bytes_of(f32)),
            (f"grad of logits (backward):{str(dtype).removeprefix('torch.')}[{rows}, {vocab}]", bytes_of(grad))]


_bf, _f32, _i64 = torch.bfloat16, torch.float32, torch.int64
# transform after the .float(): only the lm_head's output rounds in low precision (in fp32 models the
# cast is a no-op and these graphs are the cast-after variants', so they are traced in bf16 only)
_FP32_TRANSFORM = {"fp32_transform": True}
_LOW = ({"x": _bf, "w": _bf, "b": _bf, "s": _f32, "target": _i64},)
PATTERN = Pattern(
    name="linear_cross_entropy",
    variants=(
        Variant(lce_hf_softcap, {}),
        Variant(lce_hf_scaled, {}),
        Variant(lce_hf_divided, {}),
        Variant(lce_bias_softcap, {}),
        Variant(lce_bias_scaled, {}),
        Variant(lce_bias_divided, {}),
        Variant(lce_softcap_nanochat, _FP32_TRANSFORM, dtypes=_LOW),
        Variant(lce_fp32_scaled, _FP32_TRANSFORM, dtypes=_LOW),
        Variant(lce_fp32_divided, _FP32_TRANSFORM, dtypes=_LOW),
        Variant(lce_bias_fp32_softcap, _FP32_TRANSFORM, dtypes=_LOW),
        Variant(lce_bias_fp32_scaled, _FP32_TRANSFORM, dtypes=_LOW),
        Variant(lce_bias_fp32_divided, _FP32_TRANSFORM, dtypes=_LOW),
        Variant(lce_sigmoid_modded_nanogpt, _FP32_TRANSFORM),
        Variant(lce_vocab_scaled, {}),
        Variant(lce_bias_vocab_scaled, {}),
        Variant(lce_fp32_vocab_scaled_dory, {}, dtypes=_LOW),
        Variant(lce_bias_fp32_vocab_scaled, {}, dtypes=_LOW),
        Variant(lce_hf_bias, {}),
        Variant(lce_logits_bias_bart, {}),
        Variant(lce_hf, {}),
        Variant(lce_class_dim_second, {}),
    ),
    shapes={"x": (2, 3, 22), "w": (50, 22), "b": (50,), "s": (50,), "target": (6,), "target2d": (2, 3)},
    dtypes=({"x": _bf, "w": _bf, "b": _bf, "s": _bf, "target": _i64, "target2d": _i64},
            {"x": _f32, "w": _f32, "b": _f32, "s": _f32, "target": _i64, "target2d": _i64}),
    check=check,
    lower=lower,
    may_escape=lambda n, users: returned_only(users),  # a z-loss would lose its gradient
    hidden_saved=_hidden,
    free_literals={aten.cross_entropy_loss.default: {3: "reduction"}},
    is_candidate=is_candidate,
    miss_reason=miss_reason,
)
