"""Rotary position embedding: q and k rotated by cos / sin, one fused call per attention layer.

One match is one tensor's rotation; ``group`` pairs the rotations that share cos / sin (q and k of
one attention layer) into one ``fxfuse::rope`` call, which is one site. Spellings:
  - HF ``rotate_half``: ``x * cos + cat(-x2, x1) * sin``, cos / sin per channel [..., D], NanoChat's
    ``cat(x2, -x1)`` (the rotation by -angle), and the interleaved form (Cohere, GLM, Helium:
    ``stack(-x[..., 1::2], x[..., ::2]).flatten(-2)``; ERNIE 4.5 upcasts the rotated copy on its own);
  - the same rotation written out on halves: ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``,
    cos / sin [..., D/2], the halves sliced or ``torch.chunk``-ed (gpt-oss; canonically the same
    slices), nanochat's rotation by -angle ``cat(x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos)``,
    or the even / odd channels (DeepSeek V3's ``apply_rotary_pos_emb_interleave``: interleaved
    pairs in, the halves layout out; lowered as that channel permutation of x, one
    copy, then the halves rotation);
  - interleaved pairs: Meta / torchtitan ``view_as_complex(x.reshape(..., -1, 2)) * freqs_cis``, and
    gpt-fast's real form (``reshape(..., -1, 2)`` + ``stack``).
Partial rotary (Phi, GPT-NeoX, StableLM, GLM) needs no spelling of its own: the rotated slice
``x[..., :r]`` binds as the input, and the pass-through concatenation stays as it was.
The lowering turns every cos / sin form into per-channel [.., D] tensors (a few tiny ops on the
[T, D] tables), which the kernel reads once per position.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxfuse.canon import requires_grad, val
from fxfuse.pattern import Pattern, Variant

aten = torch.ops.aten
SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def rope_rotate_half(x, cos, sin):
    """HF Llama / Mistral / Qwen2 / Phi-3 / Gemma / GPT-NeoX ``apply_rotary_pos_emb``."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def rope_rotate_half_flipped(x, cos, sin):
    """NanoChat: ``rotate_half`` as ``cat(x2, -x1)``, the rotation by -angle (sin negated)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return (x * cos) + (torch.cat((x2, -x1), dim=-1) * sin)


def rope_interleaved(x, cos, sin):
    """HF Cohere / GLM / Helium: interleaved pairs, ``stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return (x * cos) + (torch.stack((-x2, x1), dim=-1).flatten(-2) * sin)


def rope_interleaved_ernie(x, cos, sin):
    """ERNIE 4.5 (and its MoE): interleaved pairs rotated in x's dtype, then each term upcast,
    ``(q.float() * cos) + (rotate_half(q).float() * sin)``; in fp32 it is rope_interleaved (the casts are
    no-ops), under bf16 autocast the rotated copy is cast on its own (an exact move of bf16 values)."""
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return (x.float() * cos) + (torch.stack((-x2, x1), dim=-1).flatten(-2).float() * sin)


def rope_halves(x, cos_h, sin_h):
    """The rotate-half rotation written out, cos / sin holding one value per pair [..., D/2]. gpt-oss's
    ``_apply_rotary_emb`` splits x by ``torch.chunk``: the canonical view reads chunk / split /
    narrow pieces as these slices (fxfuse/canon.py), so it is this graph."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat([x1 * cos_h - x2 * sin_h, x2 * cos_h + x1 * sin_h], dim=-1)


def rope_halves_nanochat(x, cos_h, sin_h):
    """nanochat's ``apply_rotary_emb``: the halves rotation by -angle, ``y1 = x1 * cos + x2 * sin``,
    ``y2 = x1 * (-sin) + x2 * cos`` (rope_halves with sin negated)."""
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    y1 = x1 * cos_h + x2 * sin_h
    y2 = x1 * (-sin_h) + x2 * cos_h
    return torch.cat([y1, y2], 3)


def rope_halves_pairs_deepseek(x, cos_h, sin_h):
    """DeepSeek V2 / V3 ``apply_rotary_pos_emb_interleave`` (MLA's rope part): pairs (x[2i], x[2i+1])
    rotated, results written as halves."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos_h - x2 * sin_h, x2 * cos_h + x1 * sin_h], dim=-1)


def rope_complex_meta(x, freqs_cis):
    """Meta Llama / torchtitan: complex pairs, freqs_cis already shaped for broadcast [1, T, 1, D/2]."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)


def rope_pairs_gptfast(x, freqs):
    """gpt-fast: the complex product in real arithmetic, freqs [1, T, 1, D/2, 2] (cos, sin)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    out = torch.stack(
        [xs[..., 0] * freqs[..., 0] - xs[..., 1] * freqs[..., 1],
         xs[..., 1] * freqs[..., 0] + xs[..., 0] * freqs[..., 1]], -1)
    return out.flatten(3).type_as(x)


def _tables(m) -> tuple:
    """(cos, sin) FX nodes or tensors of one match, before any per-channel expansion."""
    form = m.consts["form"]
    if form in ("complex", "pairs"):
        return (m.inputs["freqs_cis" if form == "complex" else "freqs"],)
    return (m.inputs.get("cos", m.inputs.get("cos_h")), m.inputs.get("sin", m.inputs.get("sin_h")))


def check(m) -> str | None:
    x, out = val(m.inputs["x"]), val(m.anchor)
    if x is None or out is None:
        return "no shape/dtype information on the input"
    if not 2 <= x.dim() <= 4:
        return f"input has {x.dim()} dims; the kernel rotates [B, H, T, D] or [B, T, H, D] (or fewer leading dims)"
    if tuple(out.shape) != tuple(x.shape):
        return f"cos/sin broadcast the input {list(x.shape)} to {list(out.shape)}; the kernel keeps the input's shape"
    if x.dtype not in SUPPORTED or out.dtype not in SUPPORTED:
        return f"dtype {x.dtype} -> {out.dtype} not supported (float32, bfloat16, float16)"
    tables = [val(t) for t in _tables(m)]
    promoted = torch.promote_types(x.dtype, tables[0].dtype) if tables[0] is not None else x.dtype
    if out.dtype not in (x.dtype, promoted):
        return f"output dtype {out.dtype} is neither the input's {x.dtype} nor its promotion with cos/sin"
    if x.device.type not in ("cuda", "cpu"):
        return f"device {x.device} not supported"
    for node in _tables(m):
        t = val(node)
        if t is None:
            return "no shape information on cos/sin"
        if requires_grad(node):
            return "cos/sin require grad; the fused op gives them no gradient"
        if t.dim() > 4 + (m.consts["form"] == "pairs"):
            return f"cos/sin have {t.dim()} dims"
    return _table_shape_reason(m, x.shape[-1])


def _table_shape_reason(m, d) -> str | None:
    """Why cos / sin cannot be the kernel's per-channel tables of x's D channels (one shape for both,
    one angle per channel pair), else None."""
    form, shapes = m.consts["form"], [tuple(val(t).shape) for t in _tables(m)]
    if len(shapes) == 2 and shapes[0] != shapes[1]:
        return f"cos {list(shapes[0])} and sin {list(shapes[1])} differ in shape; the kernel reads both alike"
    last = shapes[0][-2:] if form == "pairs" else shapes[0][-1:]
    want = {"pairs": (d // 2, 2), "complex": (d // 2,), "halves": (d // 2,), "halves_flipped": (d // 2,),
            "halves_pairs": (d // 2,)}.get(form, (d,))
    if last != want:
        return (f"cos/sin end in {list(last)} where one angle per channel pair of the {d} channels ends in "
                f"{list(want)} (a table broadcast over the channels, say)")
    return None


def group(matches: list) -> list[list]:
    """Pairs of rotations whose cos/sin compute the same values (q and k of one layer), else singles."""
    by_tables: dict[tuple, list] = {}
    memo: dict[fx.Node, object] = {}
    for m in matches:
        # one call rotates both in one dtype: only rotations of equal input and output dtypes pair;
        # and its two outputs require grad alike: a detached k beside q would come back requiring grad
        dtypes = (val(m.inputs["x"]).dtype, val(m.anchor).dtype, requires_grad(m.inputs["x"]))
        key = (m.consts["form"], *dtypes, *(_same_value_key(t, memo) for t in _tables(m)))
        by_tables.setdefault(key, []).append(m)
    return [ms[i:i + 2] for ms in by_tables.values() for i in range(0, len(ms), 2)]


_UNSAFE_TAGS = {torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise}
# writes at indices: with repeated indices the value that lands depends on the device's write order
_INDEXED_WRITES = {"aten::index_put", "aten::_index_put_impl", "aten::_unsafe_index_put", "aten::scatter",
                   "aten::scatter_add", "aten::scatter_reduce", "aten::index_add", "aten::index_copy",
                   "aten::index_reduce", "aten::put"}


def _deterministic(target) -> bool:
    """A functional op whose value depends only on its arguments, bit for bit (not random, no
    atomics-order rounding, no mutation, not uninitialised memory), or getitem of a multi-output op."""
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and not _UNSAFE_TAGS & set(target.tags) and "empty" not in target._schema.name
            and target._schema.name not in _INDEXED_WRITES)


_KEY_DEPTH = 32  # cos/sin tables are a few ops from their source; deeper cones count as distinct


def _same_value_key(n, memo: dict, depth: int = 0):
    """Equal for nodes that compute the same value: the same deterministic ops on the same sources
    (gpt-fast reshapes freqs_cis separately for q and for k; GPT-J / CodeGen repeat_interleave sin
    and cos inside each apply_rotary_pos_emb call)."""
    if isinstance(n, (list, tuple)):
        return tuple(_same_value_key(a, memo, depth) for a in n)
    if not isinstance(n, fx.Node):
        return repr(n)
    if n.op != "call_function" or not _deterministic(n.target) or depth > _KEY_DEPTH:
        return n
    if n not in memo:
        memo[n] = (str(n.target), _same_value_key(n.args, memo, depth + 1),
                   tuple((k, _same_value_key(v, memo, depth + 1)) for k, v in sorted(n.kwargs.items())))
    return memo[n]


def _per_channel(graph: fx.Graph, m) -> tuple[fx.Node, fx.Node]:
    """cos, sin as rank-4 per-channel tables [.., D] for the kernel."""
    form, call = m.consts["form"], graph.call_function
    if form in ("complex", "pairs"):  # [.., D/2, 2] -> cos, sin each repeated per pair: [.., D]
        src = m.inputs["freqs_cis" if form == "complex" else "freqs"]
        # resolve_conj: freqs_cis.conj() (the rotation by -angle) is a lazy conjugate view_as_real refuses
        real = lambda t: call(aten.view_as_real.default, (call(aten.resolve_conj.default, (t,)),))  # noqa: E731
        pairs = real(src) if form == "complex" else src
        rank = val(src).dim() if form == "complex" else val(src).dim() - 1
        halves = [call(aten.select.int, (pairs, -1, i)) for i in (0, 1)]
        tabs = [call(aten.flatten.using_ints, (call(aten.stack.default, ([h, h], -1)), -2, -1)) for h in halves]
    elif form in ("halves", "halves_flipped", "halves_pairs"):
        rank = val(m.inputs["cos_h"]).dim()
        tabs = [call(aten.cat.default, ([m.inputs[n], m.inputs[n]], -1)) for n in ("cos_h", "sin_h")]
        if form == "halves_flipped":  # the rotation by -angle: rope_halves with -sin
            tabs[1] = call(aten.neg.default, (tabs[1],))
    else:
        rank = val(m.inputs["cos"]).dim()
        tabs = [m.inputs["cos"], m.inputs["sin"]]
        if form == "half_flipped":  # x cos + cat(x2, -x1) sin = x cos + cat(-x2, x1) (-sin)
            tabs[1] = call(aten.neg.default, (tabs[1],))
    for _ in range(4 - rank):
        tabs = [call(aten.unsqueeze.default, (t, 0)) for t in tabs]
    return tabs[0], tabs[1]


def _as(graph: fx.Graph, x: fx.Node, dtype: torch.dtype) -> fx.Node:
    return x if val(x).dtype == dtype else graph.call_function(aten.to.dtype, (x, dtype))


def lower_group(ms: list, graph: fx.Graph, opts) -> list[fx.Node]:
    import fxfuse.kernels.rope  # noqa: F401  registers torch.ops.fxfuse.rope

    cos, sin = _per_channel(graph, ms[0])
    # under autocast q/k are bf16 but cos/sin fp32: eager's product is fp32, so rotate in fp32
    out_dtype = val(ms[0].anchor).dtype
    lone = len(ms) == 1  # a lone rotation rotates its input twice (k is q)
    q = _rank4(graph, _as(graph, ms[0].inputs["x"], out_dtype), ms[0])
    k = q if lone else _rank4(graph, _as(graph, ms[1].inputs["x"], out_dtype), ms[1])
    if ms[0].consts["form"] == "halves_pairs":  # channels (0, 2, 4, .., 1, 3, ..): then the halves form
        q = _deinterleave(graph, q)
        k = q if lone else _deinterleave(graph, k)
    interleaved = ms[0].consts["form"] in ("complex", "pairs", "interleaved")
    d = int(val(ms[0].inputs["x"]).shape[-1])
    rnd = opts.eager_rounding and _low_precision_products(ms)
    if all(_heads_inner(val(x)) for x in (q, k)):
        # q, k are [B, H, T, D] views of [B, T, H, D] projections: rotate in that memory layout and
        # hand back [B, H, T, D] views of it, as eager's elementwise rotation keeps the layout. SDPA
        # allocates its output in q's layout, so HF's transpose(1, 2).contiguous() before o_proj
        # stays a view; a contiguous [B, H, T, D] rotation made it a copy per layer, saved for backward.
        swap = lambda n: graph.call_function(aten.transpose.int, (n, 1, 2))  # noqa: E731
        pair = graph.call_function(torch.ops.fxfuse.rope.default,
                                   (swap(q), swap(k), swap(cos), swap(sin), interleaved, d, rnd))
        return [swap(graph.call_function(operator.getitem, (pair, i))) for i in range(len(ms))]
    pair = graph.call_function(torch.ops.fxfuse.rope.default, (q, k, cos, sin, interleaved, d, rnd))
    return [_rank_of(graph, graph.call_function(operator.getitem, (pair, i)), m) for i, m in enumerate(ms)]


def _rank4(graph: fx.Graph, x: fx.Node, m) -> fx.Node:
    """x (m's input, or a cast of it: a node with no value yet) with leading dims of 1 up to rank 4
    (Qwen2-VL's vision rotates unbatched [T, H, D]); broadcasting aligns trailing dims, so cos / sin,
    lifted to rank 4 too, still line up."""
    for _ in range(4 - val(m.inputs["x"]).dim()):
        x = graph.call_function(aten.unsqueeze.default, (x, 0))
    return x


def _rank_of(graph: fx.Graph, out: fx.Node, m) -> fx.Node:
    """The rank-4 rotation of m's input back at the input's rank."""
    lift = 4 - val(m.inputs["x"]).dim()
    return graph.call_function(aten.squeeze.dims, (out, list(range(lift)))) if lift else out


def _deinterleave(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """cat(x[..., 0::2], x[..., 1::2]) as one copy: [.., D] -> [.., D/2, 2] -> [.., 2, D/2] -> [.., D]."""
    call = graph.call_function
    pairs = call(aten.transpose.int, (call(aten.unflatten.int, (x, -1, [-1, 2])), -1, -2))
    dense = call(aten.clone.default, (pairs,), {"memory_format": torch.contiguous_format})
    return call(aten.flatten.using_ints, (dense, -2, -1))


def _low_precision_products(ms: list) -> bool:
    """The rotation's products run in bf16 / fp16 in the graph (HF's q * cos + rotate_half(q) * sin
    in a bf16 model): eager rounds each one, so the fused call does too (numerics="eager"). fp32
    math (Meta's complex product on q.float(), gpt-fast, cos/sin fp32 under autocast) rounds once."""
    muls = [val(n) for m in ms for n in m.region if n.target == aten.mul.Tensor]
    return bool(muls) and all(v is not None and v.dtype in (torch.bfloat16, torch.float16) for v in muls)


def _heads_inner(v) -> bool:
    """v is a [B, H, T, D] tensor laid out as [B, T, H, D] in memory (and not contiguous as is)."""
    return (v is not None and v.dim() == 4 and v.shape[1] > 1 and v.shape[2] > 1
            and v.transpose(1, 2).is_contiguous() and not v.is_contiguous())


def _is_candidate(n: fx.Node) -> bool:
    """view_as_complex, or a concatenation / stack of two pieces: rotate_half's (one negated) or the
    written-out rotation's (a difference and a sum of products)."""
    if n.target == aten.view_as_complex.default:
        return True
    if n.target not in (aten.cat.default, aten.stack.default) or len(n.args[0]) != 2:
        return False
    pieces = [p for p in n.args[0] if isinstance(p, fx.Node)]
    return any(p.target == aten.neg.default for p in pieces) or (
        len(pieces) == 2 and {p.target for p in pieces} <= {aten.sub.Tensor, aten.add.Tensor}
        and all(isinstance(a, fx.Node) and a.target == aten.mul.Tensor for p in pieces for a in p.args[:2]))


_bf, _f32, _c64 = torch.bfloat16, torch.float32, torch.complex64
PATTERN = Pattern(
    name="rope",
    variants=(
        Variant(rope_rotate_half, {"form": "half"}),
        Variant(rope_rotate_half_flipped, {"form": "half_flipped"}),
        Variant(rope_interleaved, {"form": "interleaved"}),
        Variant(rope_interleaved_ernie, {"form": "interleaved"}),
        Variant(rope_halves, {"form": "halves"}),
        Variant(rope_halves_nanochat, {"form": "halves_flipped"}),
        Variant(rope_halves_pairs_deepseek, {"form": "halves_pairs"}),
        Variant(rope_complex_meta, {"form": "complex"}, dtypes=({"x": _bf, "freqs_cis": _c64},
                                                                 {"x": _f32, "freqs_cis": _c64})),
        Variant(rope_pairs_gptfast, {"form": "pairs"}),
    ),
    shapes={"x": (2, 3, 4, 22), "cos": (2, 1, 4, 22), "sin": (2, 1, 4, 22), "cos_h": (1, 3, 1, 11),
            "sin_h": (1, 3, 1, 11), "freqs_cis": (1, 3, 1, 11), "freqs": (1, 3, 1, 11, 2)},
    dtypes=({"x": _bf, "cos": _bf, "sin": _bf, "cos_h": _bf, "sin_h": _bf, "freqs": _f32},
            {"x": _f32, "cos": _f32, "sin": _f32, "cos_h": _f32, "sin_h": _f32, "freqs": _f32}),
    check=check,
    lower_group=lower_group,
    group=group,
    is_candidate=_is_candidate,
)
