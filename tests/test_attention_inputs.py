"""SDPA on a mask input (a model split into graphs: graph breaks, FSDP2's per-layer hooks): the graph
is compiled as traced and with is_causal=True, and each call picks by the mask's value, compared
with SDPA's causal mask once per mask tensor (fxfuse/attention_tags.py)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse.attention_tags as tags
from fxfuse import backend
from helpers import batch, compiled_parity, hf_model

FP32_TOL = 1e-5


@pytest.fixture
def split_llama(monkeypatch):
    """A tiny HF Llama with a graph break at every decoder layer: the mask is built in one graph and
    reaches each layer's graph as an input (what FSDP2's hooks do to a compiled model)."""
    from transformers.models.llama import modeling_llama as ml

    forward = ml.LlamaDecoderLayer.forward

    def broken(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ml.LlamaDecoderLayer, "forward", broken)
    return hf_model("llama", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_split_model_runs_the_causal_variant_with_parity(split_llama, paths, inner):
    loss_err, grad_err, report, _ = compiled_parity(split_llama, batch(), inner=inner)
    assert report.graphs > 1
    checked = [s for s in report.attention if s.variant == "sdpa_causal_gqa_checked"]
    assert checked and all(not s.reason for s in checked), str(report)
    assert "on a mask input" in str(report)
    assert paths == ["causal", "causal"], paths  # both layers' forwards
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_split_model_with_padding_runs_with_the_mask(split_llama, paths):
    inputs = batch()
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    inputs["attention_mask"][0, :3] = 0  # left padding: the mask is not causal
    loss_err, grad_err, report, _ = compiled_parity(split_llama, inputs)
    assert paths and set(paths) == {"traced"}, paths
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


class SplitNet(nn.Module):
    """Builds a constant causal mask, breaks the graph, then attends with it."""

    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        i = torch.arange(t, device=x.device)
        mask = (i[None, :] <= i[:, None])[None, None].expand(b, 1, t, t)
        torch._dynamo.graph_break()
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def test_mask_proven_in_its_graph_is_not_compared_again(paths, monkeypatch):
    """The producing graph proves its constant mask at compile time and stores the verdict on the
    tensor it returns: the attending graph runs causal without a value comparison."""
    compared = []  # _causal builds the reference of a value comparison
    monkeypatch.setattr(tags, "_causal", lambda *a: compared.append(a) or torch.ones(a[:2], dtype=torch.bool).tril())
    x = torch.randn(2, 7, 16)
    loss_err, grad_err, report, _ = compiled_parity(SplitNet(), {"x": x}, loss_fn=lambda out: out)
    assert paths == ["causal"] and compared == [], (paths, compared)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


def test_is_causal_mask_by_value_cached_and_rechecked_after_a_write():
    t = 5
    keep = torch.ones(t, t, dtype=torch.bool).tril()
    causal = keep[None, None].expand(2, 1, t, t)
    assert tags.is_causal_mask(causal, (t, t))
    assert getattr(causal, tags.TAG) == ((t, t), causal._version, True)
    other = causal.clone()
    other[1, 0, 0, 4] = True  # one batch element differs
    assert not tags.is_causal_mask(other, (t, t))
    for blocked in (float("-inf"), torch.finfo(torch.float32).min):
        additive = torch.zeros(t, t).masked_fill(~keep, blocked)
        assert tags.is_causal_mask(additive, (t, t))
    biased = torch.zeros(t, t).masked_fill(~keep, float("-inf"))
    biased[3, 1] = 0.5  # ALiBi-like bias inside the allowed triangle
    assert not tags.is_causal_mask(biased, (t, t))
    written = keep.clone()
    assert tags.is_causal_mask(written, (t, t))
    written[0, 4] = True  # in place: the version counter moves, the cached verdict is stale
    assert not tags.is_causal_mask(written, (t, t))


def test_variant_that_fails_to_compile_keeps_the_mask(split_llama, paths, monkeypatch):
    """Fail safe: the traced graph still runs, and the report says why the calls kept their mask."""
    real = backend.inner_compile

    def failing(gm, *args, **kwargs):
        sdpa = [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
        if any(n.kwargs.get("is_causal") for n in sdpa):
            raise RuntimeError("no variant today")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(backend, "inner_compile", failing)
    loss_err, grad_err, report, _ = compiled_parity(split_llama, batch())
    checked = [s for s in report.attention if s.variant.endswith("_checked")]
    assert checked and all("no variant today" in s.reason for s in checked), str(report)
    assert paths == [] and report.counts()["rms_norm"] > 0
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


def test_failing_mask_check_runs_the_traced_graph():
    """Fail safe at run time: if the mask program raises, the traced graph runs."""
    ran = []

    def broken_masks(*args):
        raise RuntimeError("mask program broke")

    run = tags.dispatch(lambda *a: ran.append("causal"), lambda *a: ran.append("traced"), broken_masks, "g")
    run(torch.zeros(1))
    assert ran == ["traced"]


class BiasNet(nn.Module):
    """A learned additive bias passed as SDPA's mask input, across a graph break."""

    def forward(self, x, bias):
        torch._dynamo.graph_break()
        return F.scaled_dot_product_attention(x, x, x, attn_mask=bias).sum()


def test_mask_input_that_needs_a_gradient_is_never_dropped(paths):
    t = 5
    causal_valued = torch.zeros(t, t).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    bias = causal_valued.clone().requires_grad_()  # equal to the causal mask, but learned
    x = torch.randn(1, 2, t, 4)
    out = torch.compile(BiasNet(), backend="fxfuse", options={"inner": "aot_eager"})(x, bias)
    out.backward()
    assert paths == [] and bias.grad is not None
