"""Gated MLPs on one packed gate_up (its two halves or interleaved columns): the packed ops take the
tensor and write its gradient whole (fxfuse::swiglu_packed, clamped_swiglu_packed, softcapped_swiglu_packed)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import batch, compiled_parity, hf_model
from test_swiglu_graph import FP32_TOL, _inkling, gpt_oss


def joint_graphs(model: nn.Module, inputs: dict, loss_fn=lambda out: out.loss):
    """(fused fxfuse calls in the rewritten graph as (op name, args after the input), backward graph's
    op names) of one fwd+bwd through fxfuse's rewrite and AOTAutograd."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from fxfuse.backend import transform
    from fxfuse.options import Options

    calls, backward = [], []

    def keep_backward(gm, ex):
        backward.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    def backend(gm, ex):
        aten_gm, _ = transform(gm, ex, Options.parse({"inner": "aot_eager"}))
        calls.extend((n.target.__name__.split(".")[0], n.args[1:]) for n in aten_gm.graph.nodes
                     if n.op == "call_function" and str(n.target).startswith("fxfuse."))
        return aot_module_simplified(aten_gm, ex, fw_compiler=lambda g, e: make_boxed_func(g),
                                     bw_compiler=keep_backward)

    torch._dynamo.reset()
    loss_fn(torch.compile(model, backend=backend)(**inputs)).backward()
    return calls, backward


class PackedGLU(nn.Module):
    """gate and up as the two halves of one linear's output, in each spelling models use; act "silu"
    (SwiGLU) or "softcapped" (Inkling 2's, whose gate_up is one projection chunked in two)."""

    def __init__(self, layout, d=24, hidden=40, act="silu"):
        super().__init__()
        self.act = F.silu if act == "silu" else None
        self.emb = nn.Embedding(50, d)
        self.gate_up = nn.Linear(d, 2 * hidden + (hidden if layout == "partial" else 0), bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.layout, self.hidden = layout, hidden

    def forward(self, input_ids):
        x, i = self.gate_up(self.emb(input_ids)), self.hidden
        g, u = {
            "chunk": lambda: x.chunk(2, dim=-1),
            "chunk_up_first": lambda: x.chunk(2, dim=-1)[::-1],
            "split": lambda: x.split(i, dim=-1),
            "slices": lambda: (x[..., :i], x[..., i:]),
            "interleaved": lambda: (x[..., ::2], x[..., 1::2]),
            "interleaved_up_first": lambda: (x[..., 1::2], x[..., ::2]),
            "partial": lambda: (x[..., :i], x[..., i:2 * i]),  # a third of x is neither
        }[self.layout]()
        return self.down(self.act(g) * u if self.act else _inkling()(g, u)).pow(2).mean()


@pytest.mark.parametrize("layout,packing", [
    ("chunk", (False, False)), ("chunk_up_first", (False, True)), ("split", (False, False)),
    ("slices", (False, False)), ("interleaved", (True, False)), ("interleaved_up_first", (True, True)),
    ("partial", None)])
@pytest.mark.parametrize("act", ["silu", "softcapped"])
def test_packed_gate_up_gradient_written_whole(layout, packing, act):
    """gate and up the halves of one tensor: fxfuse::swiglu_packed (softcapped_swiglu_packed) takes
    the tensor, and its backward
    writes gate_up's gradient itself, so the backward graph has no cat / slice_backward scattering
    dgate and dup into it; the report names the two gradients no longer written. Halves that do not
    cover the tensor ("partial") keep the unpacked op. fp32 parity either way."""
    torch.manual_seed(0)
    model = PackedGLU(layout, act=act)
    ids = torch.randint(0, 50, (2, 7))
    calls, backward = joint_graphs(copy.deepcopy(model), {"input_ids": ids}, loss_fn=lambda out: out)
    scatter = [t for t in backward if "cat" in t or "slice_backward" in t]
    loss_err, grad_err, report, _ = compiled_parity(model, {"input_ids": ids}, loss_fn=lambda out: out)
    (site,) = report.matched
    unscattered = [t for t in site.saved_tensors if "before its scatter" in t]
    op, args = ("swiglu", ("silu",)) if act == "silu" else ("softcapped_swiglu", (20.0, 30.0))
    if packing:
        assert calls == [(f"{op}_packed", (*args, *packing, *((True,) if act == "silu" else ())))], calls
        assert scatter == [], backward
        assert len(unscattered) == 2 and unscattered[0].endswith("float32[2, 7, 40]"), site.saved_tensors
    else:
        assert [c[0] for c in calls] == [op], calls
        assert scatter and not unscattered, (backward, site.saved_tensors)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.parametrize("model_type,op", [("phi3", "swiglu_packed"), ("gpt_oss", "clamped_swiglu_packed"),
                                           ("llama", "swiglu")])
def test_hf_packed_gate_up(model_type, op):
    """Phi-3's gate_up_proj chunk and gpt-oss's interleaved gate_up take the packed ops; Llama's
    separate projections the plain one. Parity of these models is test_hf_gated_mlps_fused's and
    test_gpt_oss_clamped_swiglu_fused's."""
    model = gpt_oss() if model_type == "gpt_oss" else hf_model(model_type, num_hidden_layers=1)
    calls, _ = joint_graphs(model, batch())
    assert [c[0] for c in calls if "swiglu" in c[0]] == [op] * model.config.num_hidden_layers, calls
