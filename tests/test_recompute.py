"""Option ``recompute``: fused RMSNorm / SwiGLU outputs are recomputed in backward, not kept for it.

The check is on what the compiled step really saves for backward (every tensor the compiled
autograd function packs, seen through saved_tensors_hooks): with recompute on, exactly the fused
outputs' bytes (Site.recomputed) disappear, and gradients stay those of eager.
"""
from __future__ import annotations

import copy

import pytest
import torch

import fxfuse
from fxfuse.audit_profile import removed_tensors, tensor_bytes
from fxfuse.options import Options
from tests.helpers import batch, hf_model, loss_and_grads, rel_err


def _saved_bytes_and_grads(model, inputs, options):
    """Bytes saved for backward by one compiled training step, its gradients, and the report."""
    torch._dynamo.reset()
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(model, backend="fxfuse", options=options)
    packed = []

    def pack(t):
        packed.append(t.numel() * t.element_size())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = compiled(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return sum(packed), grads, fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_recomputed_outputs_are_not_saved(inner):
    model = hf_model("llama", num_hidden_layers=2)
    inputs = batch()
    _, ref = loss_and_grads(copy.deepcopy(model), inputs)
    # off first, then on, in one process: the second compile of the same graph code must not reuse
    # the first one's cached partition (AOTAutograd's cache keys graphs by code, not node meta)
    # lean loss head: it keeps the final norm's output for its backward (the fast head, default under
    # Inductor, forms its gradients in the forward and keeps nothing, so that norm saves no bytes)
    opts = {"inner": inner, "loss_head": "lean"}
    kept, grads_off, report_off = _saved_bytes_and_grads(model, inputs, {**opts, "recompute": False})
    lean, grads_on, report = _saved_bytes_and_grads(model, inputs, opts)

    assert all(not s.recomputed for s in report_off.matched)
    by_pattern = {}
    for s in report.matched:
        by_pattern.setdefault(s.pattern, []).extend(s.recomputed)
    assert len(by_pattern["rms_norm"]) == 5 and len(by_pattern["swiglu"]) == 2  # 2 per layer + final; 1 per layer
    assert not by_pattern["rope"] and not by_pattern["linear_cross_entropy"]
    recomputed = sum(tensor_bytes(d)[3] for ds in by_pattern.values() for d in ds)
    assert kept - lean == recomputed > 0
    for grads in (grads_off, grads_on):
        assert max(rel_err(grads[k], ref[k]) for k in ref) < 1e-5
    assert "output recomputed in backward" in str(report)
    agg = removed_tensors(report)
    assert agg["swiglu"]["recomputed_bytes_per_step"] == sum(tensor_bytes(d)[3] for d in by_pattern["swiglu"])


def test_recompute_then_not_in_one_process():
    """The other order: a tagged compile must not leave a cache entry an untagged one picks up."""
    model = hf_model("llama", num_hidden_layers=1)
    inputs = batch()
    lean, _, _ = _saved_bytes_and_grads(model, inputs, {"inner": "inductor", "recompute": True})
    kept, _, _ = _saved_bytes_and_grads(model, inputs, {"inner": "inductor", "recompute": False})
    assert kept > lean


def test_recompute_option_is_checked():
    with pytest.raises(ValueError, match="recompute"):
        Options.parse({"recompute": "yes"})
