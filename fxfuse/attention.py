"""Causal attention: an SDPA call whose mask is a constant causal mask becomes ``is_causal=True``.

Under torch.compile some models build the causal mask as a tensor instead of passing
``is_causal=True`` (HF transformers <= 5.17 does so whenever Dynamo traces: its mask-skipping check
refuses to run while tracing). SDPA then gets ``attn_mask=[B, 1, T, T]``: the flash / cuDNN kernels
can no longer skip the upper triangle (about 2x the work), read the mask, and GQA models repeat
k and v to every query head first (``repeat_kv``) because SDPA's ``enable_gqa`` needs no mask.
Measured on an H200 (Llama-1B-like, 4 x 2048, bf16): attention forward 6.3 -> 17.9 ms and backward
17.0 -> 44.9 ms per two steps against the same model in eager mode.

The rewrite is exact, not heuristic: the mask's whole producer cone must be computed from
constants alone (arange, comparisons, views; no graph input, no random op) at static shapes, so it
is evaluated here, on the CPU, and compared with SDPA's own causal mask
(``ones(Tq, Tk).tril()``) over every batch and head. A bool mask must equal it; a float mask must be
0 where it allows and -inf or the dtype's min where it forbids (both give exactly 0 after softmax).
Only then is the mask dropped; a ``repeat_kv`` chain on k and v (unsqueeze(2) -> expand ->
reshape, the same factor on both) is undone and ``enable_gqa=True`` set instead.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .report import Site, module_path, source_line
from .rewrite import bytes_of, tensor_desc

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_MAX_ELEMENTS = 1 << 27  # largest mask evaluated on the CPU to prove it causal (128 Mi elements)
_RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)
# views allocate nothing when evaluated: an expand of the [T, T] mask to [B, 1, T, T] costs no memory
_VIEWS = frozenset((aten.expand.default, aten.unsqueeze.default, aten.slice.Tensor, aten.select.int,
                    aten.view.default, aten.permute.default, aten.transpose.int, aten.squeeze.dim,
                    aten.alias.default))


def causal_attention(gm: fx.GraphModule, assume: dict | None = None) -> tuple[list[Site], list[Site]]:
    """Rewrite every SDPA call of gm whose mask is provably causal; (rewritten, left) sites.
    assume: {placeholder: (Tq, Tk)} graph inputs taken as causal masks of that size (the caller
    checks the input's value before running this graph: fxfuse/attention_tags.py); their sites
    get the variant suffix "_checked"."""
    done, left = [], []
    assume = assume or {}
    verdicts = {}  # (mask, q shape, k shape) -> reason: every layer's call shares one mask, evaluated once
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _SDPA]:
        args = _sdpa_args(node)
        if args["attn_mask"] is None:
            continue
        key = (args["attn_mask"], *(_shape_key(args[a]) for a in ("query", "key")))
        if key not in verdicts:
            if args["attn_mask"] in assume:
                ok = _input_mask_size(args["attn_mask"], args["query"], args["key"]) == assume[args["attn_mask"]]
                verdicts[key] = "" if ok else "tagged mask input does not fit this call's q / k lengths"
            else:
                verdicts[key] = _why_not_causal(args["attn_mask"], args["query"], args["key"])
        reason = verdicts[key]
        if reason:
            left.append(_site(node, "", reason))
            continue
        q, k, v, gqa = args["query"], args["key"], args["value"], args["enable_gqa"]
        unrepeated = _unrepeat(q, k, v)
        if unrepeated is not None:
            k, v, gqa = *unrepeated, True
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(_SDPA, (q, k, v), {
                "attn_mask": None, "dropout_p": args["dropout_p"], "is_causal": True,
                "scale": args["scale"], "enable_gqa": gqa})
        new.meta = dict(node.meta)
        old_name = node.name
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        variant = ("sdpa_causal_gqa" if unrepeated is not None else "sdpa_causal") + (
            "_checked" if args["attn_mask"] in assume else "")
        site = _site(new, variant, "", [new.name, args["attn_mask"].name, old_name])
        if unrepeated is not None:  # the repeated k, v [B, H, T, D] are no longer written (nor saved)
            reps = [args["key"], args["value"]]
            site.saved_tensors = [tensor_desc(n, _val(n)) for n in reps]
            site.saved = f"2 tensors, {sum(bytes_of(_val(n)) for n in reps) / 2**10:.1f} KiB/call"
        done.append(site)
    if done:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return done, left


def causal_outputs(gm: fx.GraphModule) -> list[tuple[int, tuple[int, int]]]:
    """(position, (Tq, Tk)) of each graph output that is a constant causal mask (proven as for SDPA's
    mask argument). A model split into several graphs (a graph break, FSDP2's per-layer hooks)
    builds its mask in one graph and attends in others: the backend tags these outputs at run time
    so that the attending graphs can trust their mask input (fxfuse/attention_tags.py)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (list, tuple)) else ()
    found = []
    for i, a in enumerate(values):
        v = _val(a)
        if v is None or v.dim() < 2 or not _static(v) or not (v.dtype == torch.bool or v.is_floating_point()):
            continue
        if a.op == "placeholder":  # an input passed through: nothing proven here
            continue
        tq, tk = v.shape[-2:]
        if _mask_verdict(a, tq, tk) == "":
            found.append((i, (tq, tk)))
    return found


def mask_inputs(gm: fx.GraphModule) -> dict[fx.Node, tuple[int, int]]:
    """{placeholder: (Tq, Tk)} of graph inputs used directly as the mask of SDPA calls that could be
    causal: 4-D q / k of static lengths, a bool or float mask input ending in [Tq, Tk]."""
    found: dict[fx.Node, tuple[int, int]] = {}
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _SDPA]:
        args = _sdpa_args(node)
        mask = args["attn_mask"]
        if isinstance(mask, fx.Node) and mask.op == "placeholder":
            size = _input_mask_size(mask, args["query"], args["key"])
            if size is not None and found.setdefault(mask, size) != size:
                found[mask] = None  # one input used at two sizes: leave it alone
    return {m: s for m, s in found.items() if s is not None}


def _input_mask_size(mask: fx.Node, q: fx.Node, k: fx.Node) -> tuple[int, int] | None:
    qv, kv, mv = _val(q), _val(k), _val(mask)
    if qv is None or kv is None or mv is None or qv.dim() != 4 or not (_static(qv) and _static(kv)):
        return None
    if not (mv.dtype == torch.bool or mv.is_floating_point()) or not _static(mv) or mv.dim() < 2:
        return None
    size = (qv.shape[-2], kv.shape[-2])
    return size if tuple(mv.shape[-2:]) == size else None


def _shape_key(x) -> str | None:
    v = _val(x)
    return None if v is None else str(tuple(v.shape))  # str: symbolic sizes are not hashable


def _sdpa_args(node: fx.Node) -> dict:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)
    out = dict(defaults, **dict(zip(names, node.args)), **node.kwargs)
    return out


def _site(node: fx.Node, variant: str, reason: str, nodes: list[str] | None = None) -> Site:
    return Site("causal_attention", module_path(node), source_line(node), variant, reason=reason,
                nodes=nodes or [node.name])


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _static(t: torch.Tensor) -> bool:
    return all(isinstance(s, int) for s in t.shape)


def _why_not_causal(mask: fx.Node, q: fx.Node, k: fx.Node) -> str:
    """None if mask equals SDPA's is_causal mask for these q, k; else why it was left alone."""
    if not isinstance(mask, fx.Node):
        return "mask is not a tensor"
    qv, kv = _val(q), _val(k)
    if qv is None or kv is None or qv.dim() != 4 or not (_static(qv) and _static(kv)):
        return "query/key are not 4-D tensors of static shape"
    return _mask_verdict(mask, qv.shape[-2], kv.shape[-2])


def _mask_verdict(mask: fx.Node, tq: int, tk: int) -> str:
    """Empty if the value of mask equals SDPA's causal mask for lengths (tq, tk) at every leading
    index; else why it was left alone."""
    cone = _constant_cone(mask)
    if isinstance(cone, str):
        return cone
    value = _evaluate(cone, mask)
    if isinstance(value, str):
        return value
    if value.dim() > 4 or value.shape[-2:] != (tq, tk):
        return f"mask shape {tuple(value.shape)} is not [..., {tq}, {tk}]"
    # broadcast (stride-0) batch / head dims hold one copy of the data: check that copy only
    value = value[tuple(slice(0, 1) if value.stride(d) == 0 else slice(None) for d in range(value.dim() - 2))]
    causal = torch.ones(tq, tk, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        allowed = value
    else:
        blocked = (value == float("-inf")) | (value == torch.finfo(value.dtype).min)
        if bool((value[~blocked] != 0).any()):
            return "float mask is not only 0 / -inf (or dtype min): it adds a bias"
        allowed = ~blocked
    if not bool((allowed == causal).all()):
        return "mask is not the causal (lower-triangular) mask"
    return ""


def _constant_cone(mask: fx.Node) -> list[fx.Node] | str:
    """The nodes mask is computed from, in graph order, if they read no graph input; else why not."""
    seen, stack = {}, [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = True
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            return f"mask depends on {n.op} {n.name} (e.g. a padding mask from the inputs)"
        if torch.Tag.nondeterministic_seeded in n.target.tags:
            return f"mask uses a random op ({n.name})"
        val = _val(n)
        if val is None or not _static(val):
            return f"mask producer {n.name} has a dynamic shape"
        if n.target not in _VIEWS and val.numel() > _MAX_ELEMENTS:
            return f"mask producer {n.name} has {val.numel()} elements, too many to check on the CPU"
        stack += n.all_input_nodes
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _cpu(a):
    if isinstance(a, torch.device):
        return torch.device("cpu")
    if isinstance(a, (list, tuple)):
        return type(a)(_cpu(x) for x in a)
    return a


def _evaluate(cone: list[fx.Node], mask: fx.Node) -> torch.Tensor | str:
    env: dict[fx.Node, torch.Tensor] = {}
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            for n in cone:
                args = fx.node.map_arg(n.args, env.__getitem__)
                kwargs = {k: _cpu(v) for k, v in fx.node.map_arg(n.kwargs, env.__getitem__).items()}
                if any(isinstance(a, torch.SymInt) for a in fx.node.map_aggregate(args, lambda a: a)):
                    return "mask depends on a symbolic size"
                env[n] = n.target(*_cpu(args), **kwargs)
    except Exception as e:  # an op that cannot run on the CPU: leave the mask alone
        return f"mask could not be evaluated: {type(e).__name__}: {e}"
    return env[mask]


def _unrepeat(q: fx.Node, k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(k0, v0) if k and v are repeat_kv(k0, r), repeat_kv(v0, r) with r * heads(k0) = heads(q)."""
    k0, rk = _repeat_source(k)
    v0, rv = _repeat_source(v)
    qv = _val(q)
    if k0 is None or v0 is None or rk != rv or qv is None:
        return None
    if _val(k0).shape[1] * rk != qv.shape[1]:
        return None
    return k0, v0


def _repeat_source(node: fx.Node) -> tuple[fx.Node | None, int]:
    """repeat_kv: x [B, H, T, D] -> unsqueeze(2) -> expand [B, H, r, T, D] -> reshape [B, H*r, T, D]."""
    if node.op != "call_function" or node.target not in _RESHAPES:
        return None, 0
    exp = node.args[0]
    if not (isinstance(exp, fx.Node) and exp.target == aten.expand.default):
        return None, 0
    uns = exp.args[0]
    if not (isinstance(uns, fx.Node) and uns.target == aten.unsqueeze.default and uns.args[1] in (2, -3)):
        return None, 0
    src = uns.args[0]
    sv, ev, ov = _val(src), _val(exp), _val(node)
    if sv is None or ev is None or ov is None or sv.dim() != 4 or not (_static(sv) and _static(ev)):
        return None, 0
    b, h, t, d = sv.shape
    r = ev.shape[2]
    if tuple(ev.shape) != (b, h, r, t, d) or tuple(ov.shape) != (b, h * r, t, d):
        return None, 0
    return src, r
