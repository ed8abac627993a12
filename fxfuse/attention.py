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

import operator

import torch
import torch.fx as fx

from .normalize import eliminate_dead_code
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


def causal_attention(gm: fx.GraphModule, assume: set | None = None) -> tuple[list[Site], list[Site]]:
    """Rewrite every SDPA call of gm whose mask is provably causal; (rewritten, left) sites.
    assume: mask nodes taken as causal (the caller compares their values with the causal mask
    before running this graph: fxfuse/attention_tags.py); their sites get the suffix "_checked"."""
    done, left = [], []
    assume = assume or set()
    verdicts = {}  # (mask, q shape, k shape) -> reason: every layer's call shares one mask, evaluated once
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _SDPA]:
        args = _sdpa_args(node)
        if args["attn_mask"] is None:
            continue
        key = (args["attn_mask"], *(_shape_key(args[a]) for a in ("query", "key")))
        if key not in verdicts:
            if args["attn_mask"] in assume:
                ok = _lengths_match(args["attn_mask"], args["query"], args["key"])
                verdicts[key] = "" if ok else "checked mask does not end in this call's [q length, k length]"
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
        eliminate_dead_code(gm.graph)
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


def checkable_masks(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """{mask: the nodes computing it, in graph order} of SDPA masks (left after causal_attention)
    not judged at compile time whose value can be compared with the causal mask before the graph
    runs: a graph input that needs no gradient, or a mask computed from such inputs by
    deterministic, non-mutating ops (from position ids, a padding mask, any mask under dynamic
    shapes). A mask that needs a gradient (a learned bias) is never dropped. The mask must end in
    [q length, k length] (the same sizes, symbolic or not), so that "equal to the causal mask"
    means what is_causal=True does."""
    found: dict[fx.Node, list[fx.Node]] = {}
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _SDPA]:
        args = _sdpa_args(node)
        mask = args["attn_mask"]
        if not isinstance(mask, fx.Node) or mask in found or not _lengths_match(mask, args["query"], args["key"]):
            continue
        if mask.meta.get("fxfuse_constant_mask"):  # a constant judged at compile time (window, bias)
            continue
        cone = _runtime_cone(mask)
        if cone is not None:
            found[mask] = cone
    return found


def _lengths_match(mask: fx.Node, q: fx.Node, k: fx.Node) -> bool:
    qv, kv, mv = _val(q), _val(k), _val(mask)
    if qv is None or kv is None or mv is None or qv.dim() != 4 or kv.dim() != 4 or mv.dim() < 2:
        return False
    if not (mv.dtype == torch.bool or mv.is_floating_point()):
        return False
    return str(mv.shape[-2]) == str(qv.shape[-2]) and str(mv.shape[-1]) == str(kv.shape[-2])


def _runtime_cone(mask: fx.Node) -> list[fx.Node] | None:
    """The call_function / get_attr nodes mask is computed from, in graph order ([] for a graph
    input), if the only inputs they read are graph inputs that need no gradient and every op is
    deterministic and functional; else None."""
    seen, stack = {}, [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op == "placeholder":
            if n.meta.get("fxfuse_requires_grad", True) and isinstance(_val(n), torch.Tensor):
                return None
            if n is mask:
                return []
            continue
        seen[n] = True
        if n.op == "get_attr":
            continue
        if n.op != "call_function":
            return None
        if isinstance(n.target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in n.target.tags or n.target._schema.is_mutable:
                return None
        elif getattr(n.target, "__module__", None) != operator.__name__:  # size arithmetic, getitem
            return None
        stack += n.all_input_nodes
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


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
    mask.meta["fxfuse_constant_mask"] = True  # judged by value here: a run-time check would add nothing
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


def _same(shape, expected) -> bool:
    """Sizes equal one by one, symbolic sizes compared as expressions (no guard is added)."""
    return len(shape) == len(expected) and all(str(a) == str(b) for a, b in zip(shape, expected))


def _unrepeat(q: fx.Node, k: fx.Node, v: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(k0, v0) if k and v are repeat_kv(k0, r), repeat_kv(v0, r) with r * heads(k0) = heads(q)."""
    k0, rk = _repeat_source(k)
    v0, rv = _repeat_source(v)
    qv = _val(q)
    if k0 is None or v0 is None or rk != rv or qv is None:
        return None
    if _val(k0).shape[1] * rk != qv.shape[1]:
        return None
    if qv.device.type == "cuda" and qv.dtype not in (torch.float16, torch.bfloat16):
        # no CUDA kernel takes enable_gqa in fp32 (flash: fp16 / bf16 only; memory-efficient: no
        # GQA): SDPA would fall back to the math backend, which writes the [B, H, Tq, Tk] scores
        # (and returns another layout: measured on an H100, bench/RESULTS.md)
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
    if sv is None or ev is None or ov is None or sv.dim() != 4 or ev.dim() != 5:
        return None, 0
    b, h, t, d = sv.shape
    r = ev.shape[2]
    if not (isinstance(h, int) and isinstance(r, int)):
        return None, 0
    if not (_same(ev.shape, (b, h, r, t, d)) and _same(ov.shape, (b, h * r, t, d))):
        return None, 0
    return src, r
