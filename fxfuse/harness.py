"""The architecture harness: how many sites a model has (from its own module calls), whether fxfuse
fused every one and nothing else, and whether training through the fused model matches eager.

``check(build, inputs)``:
  - expected sites per pattern, counted from module calls in one eager forward (``expected_sites``),
    against the fused calls that ran in one compiled forward (``Report.calls``: a graph Dynamo reuses
    for every layer counts once per run);
  - fp32 parity: loss and every gradient of the fxfuse-compiled model against eager (rel err < 1e-5).
    Where a tensor misses that, an fp64 eager run decides whether the fp32 comparison is only at
    rounding's noise floor: the tensor still passes if fxfuse is as accurate as eager fp32 against
    fp64 (``as_accurate_as_eager``), else parity fails;
  - no false match: no pattern matched more sites than the model has;
  - 20 AdamW steps under bf16 autocast on a fixed batch: the loss tracks eager's within 1e-2 relative.
A site that stays unfused is a *gap* (with the report's reason), never a pass. Dropout is set to 0
(its random masks differ between runs: nn.Dropout modules here, config probabilities in
zoo.check_hf); models are otherwise as built, in train mode.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from .outside import Census
from .report import PATTERN_NAMES, Report

FP32_TOL = 1e-5
ZERO_REL = 1e-6  # a gradient this small against all gradients' norm is rounding noise around 0
BF16_STEPS, BF16_TOL = 20, 1e-2
# torch._dynamo.utils.same's fp64 rule: the compiled result's error against fp64 may be at most
# FP64_MULTIPLIER x eager fp32's own error against fp64, plus FP32_TOL / 10
FP64_MULTIPLIER = 2.0


def _names(m: nn.Module) -> set[str]:
    """Lower-cased names of m's children and own parameters (DBRX spells its projection Wqkv)."""
    return {n.lower() for n, _ in m.named_children()} | {n.lower() for n, _ in m.named_parameters(recurse=False)}


def is_rms_norm(m: nn.Module) -> bool:
    """nn.RMSNorm and *RMSNorm classes; *L2Norm classes (Llama 4's weightless q/k norm before transformers
    5.25, x * rsqrt(mean(x^2) + eps); Dory's x * rsqrt(sum(x^2) + eps), fused as an RMSNorm);
    gated ones (*RMSNormGated: Qwen3-Next's and Qwen3.5's linear attention, rms_norm(x) * silu(gate));
    Ergo's ExpertNorm (F.rms_norm, then each token's expert's weight).
    A wrapper around one (AXK2's GatedRMSNorm: its norm, then a sigmoid gate of a low-rank MLP) is not
    a site of its own."""
    return _rms_norm_class(m) and not any(_rms_norm_class(c) for c in m.children())


def _rms_norm_class(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    return (isinstance(m, nn.RMSNorm) or name.endswith(("rmsnorm", "rmsnormgated", "l2norm"))
            or name == "ergoexpertnorm")


@contextlib.contextmanager
def _counting_calls(model: nn.Module, named: Callable[[str], bool], counted: Callable[[], None]):
    """While inside, each call of a module-level function whose name is named() in the files defining
    model's classes first calls counted()."""
    files = {sys.modules.get(type(m).__module__) for m in model.modules()} - {None}
    originals = {(f, n): fn for f in files for n, fn in list(vars(f).items())
                 if named(n) and callable(fn) and not inspect.isclass(fn)}

    def counting(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            counted()
            return fn(*args, **kwargs)
        return wrapper

    for (f, n), fn in originals.items():
        setattr(f, n, counting(fn))
    try:
        yield
    finally:
        for (f, n), fn in originals.items():
            setattr(f, n, fn)


def _rotary_function(name: str) -> bool:
    """apply_rotary_pos_emb, apply_rotary_emb (Llama 4), apply_multimodal_rotary_pos_emb, ..."""
    return re.match(r"\w*apply\w*_ro(tary|pe)", name) is not None


def is_gated_mlp(m: nn.Module) -> bool:
    """act(gate) * up modules: HF gate_proj/up_proj, fused gate_up_proj (Phi-3, MoE experts),
    Meta / gpt-fast w1/w3, DBRX's experts w1/v1; Gemma 4's decoder layer (act(per_layer_input_gate(h)) * per_layer_input);
    JetMoE's MoE (input_linear to both halves, its activation; its attention experts have no activation);
    a gated RMSNorm with a SiLU gate (silu(gate) * normed x; Kimi Linear's sigmoid gate is no site);
    xLSTM's proj_up_gate / proj_up; ModernBERT's Wi packing both halves (twice Wo's input width), Aya
    Vision's projector linear_1 likewise;
    a Mamba-1 mixer (Mamba, Falcon-Mamba, Jamba: its scan output times silu(gate); Zamba's per-head
    x_proj_weight / dt_proj_weight parameters), a Griffin recurrent block (RecurrentGemma: gelu(linear_y(x))
    times its recurrence's output), and a Mamba-2 one
    without a gated RMSNorm (_ungated_norm_mixer)."""
    names = _names(m)
    return ({"gate_proj", "up_proj"} <= names or "gate_up_proj" in names or {"w1", "w3"} <= names
            or {"w1", "v1"} <= names or "per_layer_input_gate" in names or {"proj_up_gate", "proj_up"} <= names
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
    """Linear children Wi and Wo (any case; ModernBERT), or linear_1 and linear_2 (Aya Vision's projector),
    with the first twice as wide as the second's input: gate and up in one (LLaVA's linear_1, as wide
    as linear_2's input, is no gated MLP)."""
    kids = {n.lower(): c for n, c in m.named_children()}
    return any(isinstance(a, nn.Linear) and isinstance(b, nn.Linear) and a.out_features == 2 * b.in_features
               for a, b in ((kids.get("wi"), kids.get("wo")), (kids.get("linear_1"), kids.get("linear_2"))))


def is_attention(m: nn.Module) -> bool:
    """A softmax-attention module (a RoPE site in a rotary model), DeepSeek's MLA (kv_a_proj_with_mqa)
    too, and a layer that reuses an earlier layer's keys (Gemma 3n: q_proj and o_proj, no k_proj;
    it still rotates its queries), one with a joint key-value projection (JetMoE's kv_proj, its queries
    from attention experts), and DeepSeek sparse attention's indexer (wq_b, wk: it rotates its own
    queries and keys to score tokens), one whose queries come with their gate (MiniCPM5-MoE's
    q_gate_proj), a vision transformer's packed qkv and proj (Qwen2-VL's). Linear attention is not (no
    rotation): MiniMax's lightning layers (a qkv_proj), delta-rule layers (Bailing's DeltaAttention: q_proj,
    k_proj and a causal conv1d); nor is cross-attention (*CrossAttention: BLT's between bytes and patches,
    Mllama's to image tokens; no rotation)."""
    names = _names(m)
    if any(w in type(m).__name__.lower() for w in ("lightning", "crossattention")) or "conv1d" in names:
        return False
    return ({"q_proj", "k_proj"} <= names or {"q_proj", "o_proj"} <= names or {"wq", "wk"} <= names
            or {"qkv", "proj"} <= names
            or {"wq_b", "wk"} <= names or {"q_gate_proj", "k_proj"} <= names
            or bool(names & {"query_key_value", "qkv_proj", "wqkv", "kv_a_proj_with_mqa", "kv_proj"}))


def uses_rope(model: nn.Module) -> bool:
    """A rotary embedding module, a rotary table buffer (inv_freq, freqs_cis), or an attention that
    keeps its own sin / cos table and a ``rotary_dim`` (GPT-J and CodeGen in transformers <= 5.17;
    None there means every channel rotates)."""
    return any("rotary" in type(m).__name__.lower() or "rotary_dim" in vars(m) for m in model.modules()) or any(
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
    by_function = {type(m) for m, r in attention_calls if r}  # attention classes rotating through the function
    calls["rope"] = sum(r or (type(m) not in by_function and id(m) not in inner) for m, r in attention_calls)
    calls["linear_cross_entropy"] = int(has_loss_head)
    return calls


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def grad_errors(grads: dict, ref: dict) -> dict[str, float]:
    """Relative error per gradient. A reference gradient that is numerically zero (norm below
    ZERO_REL of all gradients' norm: a key bias, whose true gradient is 0 since softmax ignores a
    constant shift) has no meaningful relative error: it must just be numerically zero too (0, else inf)."""
    total = torch.cat([g.detach().double().flatten() for g in ref.values()]).norm().item()
    errs = {}
    for k, r in ref.items():
        if r.double().norm().item() < ZERO_REL * total:
            errs[k] = 0.0 if grads[k].double().norm().item() < ZERO_REL * total else float("inf")
        else:
            errs[k] = rel_err(grads[k], r)
    return errs


def grad_error(grads: dict, ref: dict) -> float:
    """Worst per-tensor relative error (grad_errors); inf where the parameter sets differ. A parameter
    with no gradient in eager may have an all-zero one in the compiled run: torch.compile itself, under
    any backend, gives zeros to parameters that enter its graph without reaching the loss (a VLM vision
    tower's unused pooling head)."""
    grads = {k: g for k, g in grads.items() if k in ref or bool(g.any())}
    if grads.keys() != ref.keys():
        return float("inf")
    return max(grad_errors(grads, ref).values(), default=0.0)


def as_accurate_as_eager(got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> bool:
    """got (fxfuse, fp32) is as accurate as eager fp32, both measured against exact (an fp64 run).
    For a tensor whose fp32 rounding error alone is near FP32_TOL (ill-conditioned: a small
    gradient that sums cancelling terms), got vs eager can miss FP32_TOL though neither is wrong."""
    return rel_err(got, exact) <= FP64_MULTIPLIER * rel_err(eager, exact) + FP32_TOL / 10


def _copy(model: nn.Module, build: Callable[[], nn.Module] | None = None) -> nn.Module:
    """A deep copy of model; where torch refuses one (weight_norm's non-leaf weights: RecurrentGemma),
    a fresh build() with model's state loaded."""
    try:
        return copy.deepcopy(model)
    except RuntimeError:
        if build is None:
            raise
    device = next(model.parameters()).device
    fresh = build().to(device)
    fresh.load_state_dict(model.state_dict())
    for a, b in zip(model.modules(), fresh.modules()):
        b.train(a.training)
        if isinstance(a, nn.Dropout):
            b.p = a.p
    return fresh


def fp64_run(model: nn.Module, call_inputs: dict, loss_of, build=None) -> tuple[torch.Tensor, dict] | None:
    """Eager loss and gradients of an fp64 copy of model; None where the model cannot run in fp64
    (one that casts to float32 on its own)."""
    m64 = _copy(model, build).double()
    inputs = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in call_inputs.items()}
    try:
        return step(m64, m64, inputs, loss_of)
    except (RuntimeError, TypeError):
        return None


def fp64_verdict(loss, grads, ref_loss, ref_grads, exact) -> tuple[bool, list[str]]:
    """Whether every tensor that missed FP32_TOL against eager is as accurate as eager against the
    fp64 run exact = (loss, grads), and one line per such tensor for the summary. A gradient
    grad_errors scores inf (nonzero where eager's is numerically zero) is never rescued."""
    errs = {"loss": rel_err(loss, ref_loss)} | grad_errors(grads, ref_grads)
    missed = {k: e for k, e in errs.items() if not e < FP32_TOL}
    ok, lines = exact is not None and all(e != float("inf") for e in missed.values()), []
    for k, e in missed.items():
        got, ref = (loss, ref_loss) if k == "loss" else (grads[k], ref_grads[k])
        if exact is None or e == float("inf"):
            lines.append(f"{k}: rel err {e:.2e} vs eager" + (", no fp64 run" if exact is None else ""))
            continue
        want = exact[0] if k == "loss" else exact[1][k]
        good = as_accurate_as_eager(got, ref, want)
        ok &= good
        lines.append(f"{k}: rel err vs eager {e:.2e}; vs fp64: fxfuse {rel_err(got, want):.2e}, "
                     f"eager {rel_err(ref, want):.2e} -> {'as accurate as eager' if good else 'LESS ACCURATE'}")
    return ok, lines


def step(model, call, inputs, loss_of=lambda out: out.loss):
    """Loss of call(**inputs) and the gradients of model's parameters after backward."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(call(**inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train(model, call, inputs, loss_of, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16):
            loss = loss_of(call(**inputs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@dataclass
class Result:
    name: str
    expected: dict[str, int]
    matched: dict[str, int]
    loss_err: float
    grad_err: float
    bf16_max_rel: float | None
    reasons: dict[str, list[str]] = field(default_factory=dict)  # unmatched reasons per pattern; "graph", "graph_breaks"
    fp64: list[str] = field(default_factory=list)  # tensors judged against an fp64 run (fp64_verdict)
    fp64_ok: bool = False

    @property
    def false_matches(self) -> list[str]:
        return [p for p in PATTERN_NAMES if self.matched[p] > self.expected[p]]

    @property
    def gaps(self) -> list[str]:
        return [p for p in PATTERN_NAMES if self.matched[p] < self.expected[p]]

    @property
    def parity_ok(self) -> bool:
        return (self.loss_err < FP32_TOL and self.grad_err < FP32_TOL) or self.fp64_ok

    @property
    def bf16_ok(self) -> bool:
        return self.bf16_max_rel is not None and self.bf16_max_rel < BF16_TOL

    @property
    def passed(self) -> bool:
        return not self.gaps and not self.false_matches and self.parity_ok and self.bf16_ok

    def to_dict(self) -> dict:
        return asdict(self) | {"gaps": self.gaps, "false_matches": self.false_matches, "passed": self.passed}


def check(name: str, build: Callable[[], nn.Module], inputs: dict, loss_of=lambda out: out.loss,
          has_loss_head: bool = True, inner: str = "aot_eager", bf16_steps: int = BF16_STEPS,
          device: str = "cpu") -> Result:
    """Run the harness on the model build() returns (random weights, fp32, train mode), moved with
    inputs to device: on "cuda" the fused ops run their Triton kernels, on "cpu" their CPU path."""
    import fxfuse

    model = build().to(device)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    for m in model.modules():  # random dropout masks would differ between eager and compiled runs
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    expected = expected_sites(model, inputs, has_loss_head)
    ref_loss, ref_grads = step(model, model, inputs, loss_of)
    mine = _copy(model, build)
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(mine, backend="fxfuse", options={"inner": inner})
    census = Census(mine)
    loss, grads = step(mine, census.around(compiled), inputs, loss_of)
    report = census.apply(Report.merge(fxfuse.compiled_reports()[n0:]))
    loss_err, grad_err = rel_err(loss, ref_loss), grad_error(grads, ref_grads)
    fp64_ok, fp64 = False, []
    if not (loss_err < FP32_TOL and grad_err < FP32_TOL) and grads.keys() == ref_grads.keys():
        fp64_ok, fp64 = fp64_verdict(loss, grads, ref_loss, ref_grads, fp64_run(model, inputs, loss_of, build))
    bf16 = None
    if bf16_steps:
        torch._dynamo.reset()
        eager_model, fx_model = _copy(model, build), _copy(model, build)
        ref = _train(eager_model, eager_model, inputs, loss_of, bf16_steps)
        got = _train(fx_model, torch.compile(fx_model, backend="fxfuse", options={"inner": inner}),
                     inputs, loss_of, bf16_steps)
        bf16 = max(abs(g - r) / max(abs(r), 1e-12) for g, r in zip(got, ref))
    reasons: dict[str, list[str]] = {}
    for s in report.unmatched:
        reasons.setdefault(s.pattern, []).append(s.reason)
    reasons.update({"graph": report.errors} if report.errors else {})
    reasons.update({"graph_breaks": report.graph_breaks} if report.graph_breaks else {})
    return Result(name, expected, report.calls, loss_err, grad_err, bf16, reasons, fp64, fp64_ok)
