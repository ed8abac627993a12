"""How many sites a model has, from its own module calls in one eager forward (``expected_sites``):
name rules for RMSNorm, gated-MLP and attention modules, calls of module-level ``l2norm`` and rotary
functions, and which attention calls rotate. The harness (fxfuse.harness) checks fxfuse's fused calls
against these counts."""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
from typing import Callable

import torch
import torch.nn as nn

from .report import PATTERN_NAMES


def _names(m: nn.Module) -> set[str]:
    """Lower-cased names of m's children and own parameters (DBRX spells its projection Wqkv)."""
    return {n.lower() for n, _ in m.named_children()} | {n.lower() for n, _ in m.named_parameters(recurse=False)}


def is_rms_norm(m: nn.Module) -> bool:
    """nn.RMSNorm and *RMSNorm classes; *L2Norm classes (Llama 4's weightless q/k norm before transformers
    5.25, x * rsqrt(mean(x^2) + eps); Dory's x * rsqrt(sum(x^2) + eps), fused as an RMSNorm);
    gated ones (*RMSNormGated: Qwen3-Next's and Qwen3.5's linear attention, rms_norm(x) * silu(gate));
    Ergo's ExpertNorm (F.rms_norm, then each token's expert's weight); a *LayerNorm class whose docstring
    says it is one (T5's and its copies: "No bias and no subtraction of mean"; CPM-Ant's: "Root Mean
    Square").
    A wrapper around one (AXK2's GatedRMSNorm: its norm, then a sigmoid gate of a low-rank MLP) is not
    a site of its own."""
    return _rms_norm_class(m) and not any(_rms_norm_class(c) for c in m.children())


def _rms_norm_class(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    return (isinstance(m, nn.RMSNorm) or name.endswith(("rmsnorm", "rmsnormgated", "l2norm"))
            or name == "ergoexpertnorm" or (name.endswith("layernorm") and _documented_rms(type(m))))


def _documented_rms(cls: type) -> bool:
    """cls's or its __init__'s docstring names it an RMS norm (T5 copies its LayerNorm's into MT5,
    UMT5, LongT5, Switch Transformers, Pix2Struct, Pop2Piano, UDOP, Kosmos-2.5)."""
    doc = " ".join(((cls.__doc__ or "") + " " + (cls.__init__.__doc__ or "")).split()).lower()
    return "no subtraction of mean" in doc or "root mean square" in doc


@contextlib.contextmanager
def _counting_calls(model: nn.Module, named: Callable[[str], bool], counted: Callable[[], None]):
    """While inside, each call of a module-level function whose name is named() in the files defining
    model's classes, or of such a static method of those classes (RoFormer's attention rotates through
    ``self.apply_rotary_position_embeddings``), first calls counted()."""
    files = {sys.modules.get(type(m).__module__) for m in model.modules()} - {None}
    originals = {(f, n): fn for f in files for n, fn in list(vars(f).items())
                 if named(n) and callable(fn) and not inspect.isclass(fn)}
    statics = {(c, n): fn for c in {type(m) for m in model.modules()} for n, fn in list(vars(c).items())
               if named(n) and isinstance(fn, staticmethod)}

    def counting(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counted()
            return fn(*args, **kwargs)
        return wrapper

    for (f, n), fn in originals.items():
        setattr(f, n, counting(fn))
    for (c, n), fn in statics.items():
        setattr(c, n, staticmethod(counting(fn.__func__)))
    try:
        yield
    finally:
        for (f, n), fn in [*originals.items(), *statics.items()]:
            setattr(f, n, fn)


def _rotary_function(name: str) -> bool:
    """apply_rotary_pos_emb, apply_rotary_emb (Llama 4), apply_multimodal_rotary_pos_emb, ..."""
    return re.match(r"\w*apply\w*_ro(tary|pe)", name) is not None


def _names_rotary_function(cls: type) -> bool:
    """cls.forward (under its decorators) reads a module-level rotary function by name."""
    code = getattr(inspect.unwrap(getattr(cls, "forward", None)), "__code__", None)
    return code is not None and any(_rotary_function(n) for n in code.co_names)


def is_gated_mlp(m: nn.Module) -> bool:
    """act(gate) * up modules: HF gate_proj/up_proj, fused gate_up_proj (Phi-3, MoE experts),
    Meta / gpt-fast w1/w3, DBRX's experts w1/v1, CPM-Ant's w_0 / w_1, T5's gated wi_0 / wi_1; Gemma 4's decoder layer
    (act(per_layer_input_gate(h)) * per_layer_input);
    JetMoE's MoE (input_linear to both halves, its activation; its attention experts have no activation);
    a gated RMSNorm with a SiLU gate (silu(gate) * normed x; Kimi Linear's sigmoid gate is no site);
    xLSTM's proj_up_gate / proj_up; ModernBERT's Wi packing both halves (twice Wo's input width), Aya
    Vision's projector linear_1 and Moshi's fc1 likewise;
    a Mamba-1 mixer (Mamba, Falcon-Mamba, Jamba: its scan output times silu(gate); Zamba's per-head
    x_proj_weight / dt_proj_weight parameters), a Griffin recurrent block (RecurrentGemma: gelu(linear_y(x))
    times its recurrence's output), and a Mamba-2 one
    without a gated RMSNorm (_ungated_norm_mixer)."""
    names = _names(m)
    return ({"gate_proj", "up_proj"} <= names or "gate_up_proj" in names or {"w1", "w3"} <= names
            or {"w1", "v1"} <= names or "per_layer_input_gate" in names or {"proj_up_gate", "proj_up"} <= names
            or {"w_0", "w_1"} <= names or {"wi_0", "wi_1"} <= names
            or {"input_linear", "output_linear", "activation"} <= names or _packed_in_out(m)
            or {"in_proj", "x_proj", "dt_proj", "out_proj"} <= names
            or {"in_proj", "x_proj_weight", "dt_proj_weight", "out_proj"} <= names or _ungated_norm_mixer(m)
            or {"linear_x", "linear_y", "linear_out"} <= names
            or (type(m).__name__.lower().endswith("rmsnormgated") and getattr(m, "activation", "silu") == "silu"))


def _ungated_norm_mixer(m: nn.Module) -> bool:
    """A Mamba-2 style mixer (in_proj, conv1d, out_proj, A_log) whose output gate is no gated RMSNorm
    (Falcon-H1 without mamba_rms_norm: ``scan_output * silu(gate)``); with one, the norm is the site."""
    names = _names(m)
    return {"in_proj", "conv1d", "out_proj", "a_log"} <= names and not any(_rms_norm_class(c) for c in m.children())


def _packed_in_out(m: nn.Module) -> bool:
    """Linear children Wi and Wo (any case; ModernBERT), linear_1 and linear_2 (Aya Vision's projector), or
    fc1 and fc2 (Moshi's gating MLP), with the first twice as wide as the second's input: gate and up in
    one (LLaVA's linear_1 or GPT-2-style fc1, as wide as the second's input, is no gated MLP)."""
    kids = {n.lower(): c for n, c in m.named_children()}
    pairs = (("wi", "wo"), ("linear_1", "linear_2"), ("fc1", "fc2"))
    return any(isinstance(a, nn.Linear) and isinstance(b, nn.Linear) and a.out_features == 2 * b.in_features
               for a, b in ((kids.get(x), kids.get(y)) for x, y in pairs))


def is_attention(m: nn.Module) -> bool:
    """A softmax-attention module (a RoPE site in a rotary model), DeepSeek's MLA (kv_a_proj_with_mqa)
    too, and a layer that reuses an earlier layer's keys (Gemma 3n: q_proj and o_proj, no k_proj;
    it still rotates its queries), one with a joint key-value projection (JetMoE's kv_proj, its queries
    from attention experts), and DeepSeek sparse attention's indexer (wq_b, wk: it rotates its own
    queries and keys to score tokens), one whose queries come with their gate (MiniCPM5-MoE's
    q_gate_proj), a vision transformer's packed qkv and proj (Qwen2-VL's), BERT's query / key / value
    (RoFormer's rotates). Linear attention is not (no
    rotation): MiniMax's lightning layers (a qkv_proj), delta-rule layers (Bailing's DeltaAttention: q_proj,
    k_proj and a causal conv1d); nor is cross-attention (*CrossAttention: BLT's between bytes and patches,
    Mllama's to image tokens; no rotation)."""
    names = _names(m)
    if any(w in type(m).__name__.lower() for w in ("lightning", "crossattention")) or "conv1d" in names:
        return False
    return ({"q_proj", "k_proj"} <= names or {"q_proj", "o_proj"} <= names or {"wq", "wk"} <= names
            or {"query", "key", "value"} <= names
            or {"qkv", "proj"} <= names
            or {"wq_b", "wk"} <= names or {"q_gate_proj", "k_proj"} <= names
            or bool(names & {"query_key_value", "qkv_proj", "wqkv", "kv_a_proj_with_mqa", "kv_proj"}))


def uses_rope(model: nn.Module) -> bool:
    """A rotary embedding module, a rotary table buffer (inv_freq, freqs_cis), an attention that
    keeps its own sin / cos table and a ``rotary_dim`` (GPT-J and CodeGen in transformers <= 5.17;
    None there means every channel rotates), or a class with a rotary method of its own (RoFormer's
    attention: ``apply_rotary_position_embeddings``, from a sinusoidal table)."""
    return any("rotary" in type(m).__name__.lower() or "rotary_dim" in vars(m)
               or any(_rotary_function(n) for n in vars(type(m))) for m in model.modules()) or any(
        n.split(".")[-1] in ("inv_freq", "freqs_cis") for n, _ in model.named_buffers())


def _tower(model: nn.Module, name: str) -> nn.Module:
    """The innermost HF PreTrainedModel holding the module called name (a VLM's vision tower or its
    language model), else model itself."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        m = model.get_submodule(".".join(parts[:k]))
        if any(c.__name__ == "PreTrainedModel" for c in type(m).__mro__):
            return m
    return model


def expected_sites(model: nn.Module, inputs: dict, has_loss_head: bool) -> dict[str, int]:
    """Module calls per pattern in one forward. An attention module is a RoPE site when its tower
    (_tower) has a rotary embedding (a VLM's CLIP / SigLIP vision attention is not, Qwen2-VL's is), with
    two exceptions. Where its class rotates through a module-level ``apply_*rotary*`` / ``apply_*rope*``
    function (some call of it did in this forward), a call in which no such function ran is a NoPE
    layer (Llama 4's and SmolLM3's no_rope_layers, Kolibri's indexed attention), no site. An attention
    nested in another is a site only where such a function ran in it (a DeepSeek sparse-attention
    indexer rotates its own q / k; Zaya's convolutional q / k / v projection does not). Calls of a
    module-level ``l2norm`` function (HF's linear attention: x * rsqrt(sum(x^2) + eps) on q and k, no
    module of its own) are RMSNorm sites."""
    calls = {p: 0 for p in PATTERN_NAMES}
    towers: dict[int, bool] = {}  # id(tower) -> it has a rotary embedding
    rotations = [0]  # rotary function calls so far
    attention_calls: list[tuple[nn.Module, bool]] = []  # (module, a rotary function ran in it), in call order

    def rotary(name: str) -> bool:
        tower = _tower(model, name) if name else model
        if id(tower) not in towers:
            towers[id(tower)] = uses_rope(tower)
        return towers[id(tower)]

    attention = {n for n, m in model.named_modules() if is_attention(m)}
    inner = {id(m) for n, m in model.named_modules() if n in attention
             and any(n.startswith(f"{a}.") or not a for a in attention - {n})}
    rope_attention = {id(m) for n, m in model.named_modules() if n in attention and rotary(n)}
    tests = {"rms_norm": is_rms_norm, "swiglu": is_gated_mlp}

    def count(p):
        def hook(mod, args, out):
            # an RMSNorm class returning only the inverse RMS [..., 1] (HY-V4's UnweightedRMSNorm, which
            # scales a matmul of x) writes no normalized x: no site
            if p != "rms_norm" or not (args and isinstance(out, torch.Tensor)) or out.shape == args[0].shape:
                # Zamba's mixer gates each head's scan output with silu(its gate) in a call of its own
                calls[p] += getattr(mod, "n_mamba_heads", 1) if "x_proj_weight" in _names(mod) else 1
        return hook

    entered: list[int] = []  # rotations at the start of each attention call in progress

    def enter(mod, args):
        entered.append(rotations[0])

    def leave(mod, args, out):
        attention_calls.append((mod, rotations[0] > entered.pop()))

    def rotated():
        rotations[0] += 1

    def l2norm():
        calls["rms_norm"] += 1

    hooks = [mod.register_forward_hook(count(p)) for mod in model.modules() for p, test in tests.items() if test(mod)]
    for mod in model.modules():
        if id(mod) in rope_attention:
            hooks += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]
    try:
        with (torch.no_grad(), _counting_calls(model, lambda n: n == "l2norm", l2norm),
              _counting_calls(model, _rotary_function, rotated)):
            model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    # attention classes rotating through the function: one did in some call, or its forward names it
    # (Flint's full-attention layers skip it: NoPE even where no layer of this forward rotates)
    by_function = {type(m) for m, r in attention_calls if r or _names_rotary_function(type(m))}
    calls["rope"] = sum(r or (type(m) not in by_function and id(m) not in inner) for m, r in attention_calls)
    calls["linear_cross_entropy"] = int(has_loss_head)
    return calls
