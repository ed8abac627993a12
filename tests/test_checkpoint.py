"""Activation checkpointing: checkpointed layers are fused like any others and still recomputed.

HF ``gradient_checkpointing_enable`` (both use_reentrant settings) and a torchtitan-style model that
checkpoints each block by hand: every site fused, the report says which sites sit in a checkpointed
region, loss and every gradient equal eager's (fp32 < 1e-5), and the compiled step saves fewer bytes
for backward than the same compile without checkpointing (what the compiled autograd function packs,
seen through saved_tensors_hooks on a call after the compiling one: make_fx's fake tracing at compile
time packs fake tensors too). A pattern that would straddle a region boundary is not fused across
it. Selective checkpointing (a context_fn policy) is kept as written: tests/test_opaque.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fxfuse
from fxfuse.checkpoint import inline_checkpoints
from tests.helpers import (batch, compiled_parity, hf_model, inductor_in_place, loss_and_grads, random_biases, rel_err,
                           saved_bytes)
from tests.models import TitanLM

pytestmark = pytest.mark.hf_checkpointing

COUNTS = {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}  # 2 layers + final norm + head


def _checkpointed_llama(use_reentrant: bool):
    model = hf_model("llama", num_hidden_layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    return model


class CheckpointedTitan(TitanLM):
    """torchtitan's per-block activation checkpointing, written out."""

    def forward(self, input_ids, labels=None):
        x = self.tok_embeddings(input_ids)
        freqs = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            x = checkpoint(layer, x, freqs, use_reentrant=False)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_gradient_checkpointing_is_fused_with_parity(use_reentrant):
    loss_err, grad_err, report, _ = compiled_parity(_checkpointed_llama(use_reentrant), batch())
    assert not report.errors, report.errors
    assert report.counts() == COUNTS and not report.unmatched
    in_region = [s.module for s in report.matched if "activation-checkpointed region" in s.saved]
    assert len(in_region) == 8 and all(m.startswith("model.layers.") for m in in_region)  # not the final norm / head
    assert loss_err < 1e-5 and grad_err < 1e-5


def test_hand_written_checkpoint_is_fused_with_parity():
    torch.manual_seed(0)
    model = CheckpointedTitan()
    ids = batch()["input_ids"]
    loss_err, grad_err, report, _ = compiled_parity(model, {"input_ids": ids, "labels": ids}, loss_fn=lambda out: out)
    assert not report.errors and report.counts() == COUNTS, (report.errors, report.counts())
    assert loss_err < 1e-5 and grad_err < 1e-5


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_checkpointed_regions_are_recomputed(inner):
    inputs = batch()
    ref_loss, ref = loss_and_grads(hf_model("llama", num_hidden_layers=2), inputs)
    kept, _, _ = saved_bytes(hf_model("llama", num_hidden_layers=2), inputs, {"inner": inner})
    recomputed, loss, grads = saved_bytes(_checkpointed_llama(False), inputs, {"inner": inner})
    assert recomputed < 0.85 * kept, (recomputed, kept)
    assert rel_err(loss, ref_loss) < 1e-5 and max(rel_err(grads[k], ref[k]) for k in ref) < 1e-5


def test_norm_split_by_a_region_boundary_is_not_fused_across_it():
    """RMSNorm whose normalisation runs in a checkpointed region and whose weight multiply runs
    outside: the whole is not fused (that would move the multiply into the recomputed region or the
    normalisation out of it) and is reported with the reason; the weightless norm inside the region
    is fused there; gradients stay exact."""
    w = torch.nn.Parameter(torch.rand(32) + 0.5)

    def normalise(x):
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)

    def f(x):
        return (w * checkpoint(normalise, x, use_reentrant=False).to(x.dtype)).sum()

    x = torch.randn(4, 32, requires_grad=True)
    f(x).backward()
    ref = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    n0 = len(fxfuse.compiled_reports())
    torch._dynamo.reset()
    torch.compile(f, backend="fxfuse", options={"inner": "aot_eager"})(x).backward()
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    (inside,), (straddling,) = report.matched, report.unmatched
    assert inside.variant == "rmsnorm_no_weight" and "activation-checkpointed region" in inside.saved, str(report)
    assert "activation-checkpoint boundary" in straddling.reason, str(report)
    assert rel_err(x.grad, ref[0]) < 1e-5 and rel_err(w.grad, ref[1]) < 1e-5


def test_inline_leaves_the_dynamo_graph_alone_and_tags_each_region():
    """Nested checkpoint calls are inlined too, each region with its own increasing ac_graph_id;
    Dynamo's graph module is not modified (the fail-safe path compiles it as it came)."""
    graphs = []

    def grab(gm, example_inputs):
        n_before = len(gm.graph.nodes)
        out, regions = inline_checkpoints(gm)
        graphs.append((n_before, gm, out, regions))
        return gm

    def inner(x):
        return torch.sin(x) * 2

    def outer(x):
        return checkpoint(inner, torch.cos(x), use_reentrant=False) + 1

    def f(x):
        return torch.exp(checkpoint(outer, x, use_reentrant=False))

    torch._dynamo.reset()
    torch.compile(f, backend=grab)(torch.randn(3, requires_grad=True))
    (n_before, gm, out, regions), = graphs
    assert regions == 2 and out is not gm and len(gm.graph.nodes) == n_before
    assert any(getattr(n.target, "__name__", "") == "tag_activation_checkpoint" for n in gm.graph.nodes)
    tags = {n.target.__name__: n.meta.get("ac_graph_id") for n in out.graph.nodes if n.op == "call_function"
            and hasattr(n.target, "__name__")}
    assert tags["cos"] == 1 and tags["sin"] == 2 and tags["exp"] is None, tags
    assert all(getattr(n.target, "__name__", "") != "tag_activation_checkpoint" for n in out.graph.nodes)


class _AddInPlace(torch.nn.Module):
    """A layer adding its bias in place, the result of add_ unused (as gpt-oss's experts do)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, bias=False)
        self.bias = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        h = self.lin(x)
        h.add_(self.bias)
        return torch.relu(h)


def test_in_place_op_with_unused_result_in_a_region_is_kept():
    """Inlining a region once ran FX's dead-code elimination over Dynamo's graph, which counts an
    in-place method whose result nobody reads as dead: the bias add vanished (wrong loss, no bias
    gradient; seen on gpt-oss's experts under checkpointing)."""
    torch.manual_seed(0)
    layer = _AddInPlace()
    x = torch.randn(4, 8, requires_grad=True)

    def f(layer, x):
        return checkpoint(layer, x, use_reentrant=False).square().sum()

    ref = f(layer, x)
    ref_grads = torch.autograd.grad(ref, [x, *layer.parameters()])
    torch._dynamo.reset()
    got = torch.compile(f, backend="fxfuse", options={"inner": "aot_eager"})(layer, x)
    grads = torch.autograd.grad(got, [x, *layer.parameters()], allow_unused=True)
    assert rel_err(got, ref) < 1e-5
    assert all(g is not None and rel_err(g, r) < 1e-5 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3", "phi3", "mixtral", "gpt_neox", "olmo2", "gpt_oss"])
def test_checkpointed_architectures_fuse_as_without(model_type):
    """Across the zoo's spellings (Gemma2's four norms and softcaps, Qwen3's q/k norms, Phi-3's fused
    gate_up, Mixtral's experts, NeoX's partial rotary, OLMo2's post-norms, gpt-oss's in-place expert
    biases): checkpointing every layer fuses the same sites as without it, with fp32 parity (the
    same parameters get a gradient: compiled_parity)."""
    from fxfuse.zoo import HF_ZOO

    plain = random_biases(hf_model(model_type, **HF_ZOO[model_type]))
    _, _, expected, _ = compiled_parity(plain, batch())
    model = random_biases(hf_model(model_type, **HF_ZOO[model_type]))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss_err, grad_err, report, _ = compiled_parity(model, batch())
    assert not report.errors and report.counts() == expected.counts(), (report.errors, report.counts())
    assert any("activation-checkpointed region" in s.saved for s in report.matched)
    assert loss_err < 1e-5 and grad_err < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("exact_fp32")
def test_gpu_checkpointed_llama_inductor():
    """The CUDA path: Inductor, the Triton kernels compiled for the GPU, checkpointed layers
    recomputed, each SwiGLU backward written over its dead inputs (fxfuse.reinplace); fp32 (TF32
    off) parity with eager and fewer saved bytes than without checkpointing."""
    inputs = {k: v.cuda() for k, v in batch().items()}
    ref_loss, ref = loss_and_grads(hf_model("llama", num_hidden_layers=2).cuda(), inputs)
    kept, _, _ = saved_bytes(hf_model("llama", num_hidden_layers=2).cuda(), inputs, {"inner": "inductor"})
    from torch._dynamo.utils import counters

    counters["fxfuse"].clear()
    with torch._inductor.config.patch(force_disable_caches=True):  # fxfuse.reinplace runs on a compile
        recomputed, loss, grads = saved_bytes(_checkpointed_llama(False).cuda(), inputs, {"inner": "inductor"})
    assert counters["fxfuse"]["gradients_in_place"] == 4  # dgate and dup of both layers
    assert recomputed < 0.85 * kept, (recomputed, kept)
    assert rel_err(loss, ref_loss) < 1e-5 and max(rel_err(grads[k], ref[k]) for k in ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.usefixtures("exact_fp32")
def test_gpu_checkpointed_packed_gate_up_inductor():
    """Phi-3's packed gate_up on the GPU under checkpointing: each layer's d gate_up written over
    its recomputed gate_up, fp32 (TF32 off) parity with eager. (Not gpt-oss: in fp32 on CUDA its
    experts run transformers 5.17's grouped_mm_fallback, whose backward calls .tolist(), and plain
    Inductor fails on that graph too; its packed kernel is checked in test_gpu_kernels.)"""
    inputs = {k: v.cuda() for k, v in batch().items()}
    model = random_biases(hf_model("phi3", num_hidden_layers=2)).cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    placed, loss_err, grad_err = inductor_in_place(model, inputs)
    assert placed == 2 and loss_err < 1e-5 and grad_err < 1e-5


def test_dynamic_shapes_with_checkpointing():
    """dynamic=True: Dynamo lifts each checkpointed layer's Python floats (the norms' eps) into graph
    inputs, unspecialised. The fused norms read eps from its symbol under a guard (they were once
    lowered with a default eps instead: gradients off by 1e-2); every site fuses, parity at every
    length, one graph for all of them."""
    from torch._dynamo.utils import counters

    counters.clear()
    model = _checkpointed_llama(False)
    ref = copy.deepcopy(model)
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}, dynamic=True)
    for t in (9, 13, 17):
        inputs = batch(t=t)
        ref_loss, ref_grads = loss_and_grads(ref, inputs)
        loss, grads = loss_and_grads(model, inputs, call=compiled)
        assert rel_err(loss, ref_loss) < 1e-5 and max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < 1e-5, t
    assert counters["stats"]["unique_graphs"] == 1
    assert len(fxfuse.compiled_reports()) > n0 and fxfuse.compiled_reports()[-1].counts() == COUNTS


def test_inlining_is_the_inner_compilers_own_checkpointing():
    """With dropout inside the checkpointed layers (random ops recomputed in backward), fxfuse with
    no pattern on gives bit for bit the loss and gradients of aot_eager's own handling of the
    checkpoint calls: the inlined, tagged regions are what AOTAutograd builds from them."""
    out = {}
    for name, backend, options in (("aot_eager", "aot_eager", {}),
                                   ("fxfuse", "fxfuse", {"options": {"inner": "aot_eager", "patterns": [],
                                                                     "causal_attention": False}})):
        torch._dynamo.reset()
        model = hf_model("llama", num_hidden_layers=2, attention_dropout=0.2)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        compiled = torch.compile(model, backend=backend, **options)
        torch.manual_seed(0)
        out[name] = loss_and_grads(model, batch(), call=compiled)
    (ref_loss, ref), (loss, grads) = out["aot_eager"], out["fxfuse"]
    assert torch.equal(loss, ref_loss) and all(torch.equal(grads[k], ref[k]) for k in ref)
