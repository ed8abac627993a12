"""Shared test helpers: tiny HF models from config, site counts derived from the model, parity."""
from __future__ import annotations

import copy
import importlib.util
import os
import sys

import torch
import torch.nn as nn

import fxfuse

from fxfuse.harness import rel_err  # noqa: F401  (re-exported for the tests)
from fxfuse.zoo import TINY


def load_script(folder: str, name: str):
    """The repository's folder/name.py (bench/, examples/: folders, not packages), loaded by path,
    with its folder on sys.path while it loads (as when run from there: bench's `from common import`)."""
    where = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), folder)
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", os.path.join(where, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, where)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(where)
    return mod


def hf_model(model_type: str, dtype=torch.float32, seed: int = 0, **overrides) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def random_biases(model: nn.Module, seed: int = 3) -> nn.Module:
    """model with every bias drawn at random (HF initialises some to zero, gpt-oss's expert biases
    among them: a dropped bias add would then change neither the loss nor any other gradient)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def batch(vocab: int = 96, b: int = 2, t: int = 9, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    return {"input_ids": ids, "labels": ids}


def count_calls(model: nn.Module, is_site, *args, **kwargs) -> int:
    """How many times modules with is_site(module) run in one eager forward of model."""
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.modules() if is_site(m)]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return len(calls)


def is_rms_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.RMSNorm) or type(m).__name__.endswith("RMSNorm")


def loss_and_grads(model: nn.Module, inputs: dict, loss_fn=None, call=None):
    """Loss of (call or model)(**inputs) and the grads of model's parameters after backward."""
    model.zero_grad(set_to_none=True)
    out = (model if call is None else call)(**inputs)
    loss = loss_fn(out) if loss_fn else out.loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def compiled_parity(model: nn.Module, inputs: dict, inner: str = "aot_eager", loss_fn=None, options=None,
                    **compile_kw):
    """Eager vs fxfuse-compiled loss and grads on copies of the same model.
    Returns (loss rel err, worst grad rel err, report, grad names compared)."""
    eager = copy.deepcopy(model)
    ref_loss, ref_grads = loss_and_grads(eager, inputs, loss_fn)
    mine = copy.deepcopy(model)
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(mine, backend="fxfuse", options={"inner": inner} | (options or {}), **compile_kw)
    loss, grads = loss_and_grads(mine, inputs, loss_fn, call=compiled)
    assert grads.keys() == ref_grads.keys(), "compiled model produced gradients for other parameters"
    worst = max(rel_err(grads[k], ref_grads[k]) for k in ref_grads)
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    return rel_err(loss, ref_loss), worst, report, sorted(ref_grads)


def inductor_in_place(model: nn.Module, inputs: dict, options: dict | None = None) -> tuple[int, float, float]:
    """(gradients fxfuse.reinplace placed over dead buffers, loss rel err, worst grad rel err) of model
    compiled with fxfuse under Inductor, against eager on a copy. Inductor's caches are off: a cache
    hit would skip the pass."""
    from torch._dynamo.utils import counters

    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), inputs)
    torch._dynamo.reset()
    counters["fxfuse"].clear()
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "inductor", **(options or {})})
    with torch._inductor.config.patch(force_disable_caches=True):
        loss, grads = loss_and_grads(model, inputs, call=compiled)
    worst = max(rel_err(grads[k], ref_grads[k]) for k in ref_grads)
    return counters["fxfuse"]["gradients_in_place"], rel_err(loss, ref_loss), worst


def flat_grads(grads: dict) -> torch.Tensor:
    return torch.cat([grads[k].double().flatten() for k in sorted(grads)])


def bf16_errors(make_model, inputs: dict, autocast: bool = False, patterns=None, loss_fn=None, inner="aot_eager",
                low=torch.bfloat16):
    """((eager loss err, eager grads err), (fxfuse loss err, fxfuse grads err)) of a bf16 run
    (bf16 weights, or fp32 weights under bf16 autocast; low=torch.float16: fp16 instead) against the
    fp32 eager reference; make_model(dtype) builds the same model each call."""
    ref_loss, ref_grads = loss_and_grads(make_model(torch.float32), inputs, loss_fn)
    dtype = torch.float32 if autocast else low
    ctx = (lambda: torch.autocast("cpu", dtype=low)) if autocast else torch.enable_grad
    with ctx():
        e_loss, e_grads = loss_and_grads(make_model(dtype), inputs, loss_fn)
    mine = make_model(dtype)
    options = {"inner": inner} | ({"patterns": patterns} if patterns else {})
    compiled = torch.compile(mine, backend="fxfuse", options=options)
    with ctx():
        f_loss, f_grads = loss_and_grads(mine, inputs, loss_fn, call=compiled)
    ref, e, f = flat_grads(ref_grads), flat_grads(e_grads), flat_grads(f_grads)
    return (rel_err(e_loss, ref_loss), rel_err(e, ref)), (rel_err(f_loss, ref_loss), rel_err(f, ref))


def gated_grads(fn, g, u, dout):
    """out = fn(g, u) and the gradients of g and u for the output gradient dout."""
    out = fn(g, u)
    dg, du = torch.autograd.grad(out, (g, u), dout)
    return out, dg, du


def saved_bytes(model: nn.Module, inputs: dict, options: dict):
    """Bytes the compiled step saves for backward (second call), its loss and gradients."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxfuse", options=options)
    for _ in range(2):
        packed = []

        def pack(t):
            packed.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss, grads = loss_and_grads(model, inputs, call=compiled)
    return sum(packed), loss, grads


def assert_bf16_head_within_twice_eager(head, x, w, t):
    """head(x, w, t) -> loss, compiled by fxfuse in bf16: its loss head fused once, and its loss, dx and dW
    within 2x eager bf16's error against the fp32 computation on the same values."""
    def run(f, dtype):
        leaves = [v.to(dtype).requires_grad_() for v in (x, w)]
        loss = f(*leaves, t)
        return [loss.float(), *(d.float() for d in torch.autograd.grad(loss, leaves))]

    compiled = torch.compile(head, backend="fxfuse", options={"inner": "aot_eager"})
    ref, eager, mine = run(head, torch.float32), run(head, torch.bfloat16), run(compiled, torch.bfloat16)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    for name, e, f, r in zip(("loss", "dx", "dw"), eager, mine, ref):
        assert rel_err(f, r) <= 2 * rel_err(e, r), (name, rel_err(f, r), rel_err(e, r))


def assert_logits_guarded(run) -> None:
    """run() -> (loss, logits returned beside a fused loss head), one forward per call. The logits
    require grad as eager's do; a backward that brings them a nonzero gradient raises fxfuse's error,
    never a silently missing gradient; a zero one passes. (Both accumulate into the parameters.)"""
    import pytest

    loss, logits = run()
    assert logits.requires_grad and loss.requires_grad
    with pytest.raises(RuntimeError, match="backward reached logits returned beside a fused lm_head"):
        (loss + logits.float().square().mean()).backward()
    loss, logits = run()
    (loss + 0.0 * logits.float().sum()).backward()  # a zero gradient is eager's too
