"""Higher-order ops kept as written through the re-trace (fxfuse/opaque.py): a custom
autograd.Function, selective activation checkpointing and flex attention stay one call with their
own backward or policy, and the patterns around them are fused."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import fxfuse
from tests.helpers import batch, compiled_parity, hf_model, loss_and_grads, rel_err, saved_bytes
from tests.models import TitanBlock, TitanLM

FP32_TOL = 1e-5


class GradReverse(torch.autograd.Function):
    """Gradient reversal (domain-adversarial training): identity forward, -0.5 * grad backward.
    Autograd of the forward alone gives +grad, so a re-trace that dropped this backward would flip
    the sign of every gradient upstream of it."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return -0.5 * g


class GradReverseInPlace(torch.autograd.Function):
    """GradReverse written with in-place methods whose results go unused, as PhiMoE's router
    multiplier builds its gradient (``grad.scatter_add_(...)``): torch's dead-code elimination
    descends into the kept call's subgraphs and counts such a method call as dead, which doubled
    both the forward's output and the gradient here until fxfuse ran a DCE of its own."""

    @staticmethod
    def forward(ctx, x):
        y = x * 2
        y.mul_(0.5)
        return y

    @staticmethod
    def backward(ctx, g):
        out = -g
        out.mul_(0.5)
        return out


class ReversedMLP(nn.Module):
    """RMSNorm -> gradient reversal -> SwiGLU -> tied loss head."""

    def __init__(self, vocab=96, d=32, hidden=48, reverse=GradReverse):
        super().__init__()
        self.reverse = reverse
        self.emb = nn.Embedding(vocab, d)
        self.norm, self.final_norm = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        h = self.reverse.apply(self.norm(x))
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        logits = F.linear(self.final_norm(x), self.emb.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@pytest.mark.parametrize("reverse", [GradReverse, GradReverseInPlace], ids=["functional", "in_place"])
@pytest.mark.parametrize("inner,dynamic", [("aot_eager", False), ("inductor", True)])
def test_custom_autograd_function_keeps_its_backward_and_the_rest_is_fused(inner, dynamic, reverse):
    torch.manual_seed(0)
    model = ReversedMLP(reverse=reverse)
    # labels != ids: with the tied head and labels = ids the loss is ~1e-4, a cancellation that
    # puts fp32 rounding near the tolerance
    ids, labels = batch()["input_ids"], batch(seed=2)["input_ids"]
    loss_err, grad_err, report, _ = compiled_parity(
        model, {"input_ids": ids, "labels": labels}, inner=inner, loss_fn=lambda out: out, dynamic=dynamic)
    assert report.counts() == {"rms_norm": 2, "rope": 0, "swiglu": 1, "linear_cross_entropy": 1}, str(report)
    assert not report.errors and len(report.opaque) == 1 and "autograd_function_apply" in report.opaque[0]
    assert "nothing inside it fused" in str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


class NormIntoFunction(nn.Module):
    """The Function reads the RMSNorm's rsqrt: that intermediate escapes the norm, which must stay
    unfused (with or without its weight)."""

    def __init__(self, d=32):
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.w * (x * rstd)).sum() + GradReverse.apply(rstd).pow(2).sum()


def test_an_intermediate_read_by_the_function_blocks_the_fusion():
    model = NormIntoFunction()
    x = torch.randn(4, 32, requires_grad=True)
    report = fxfuse.explain(model, x)
    assert report.counts()["rms_norm"] == 0 and len(report.opaque) == 1, str(report)
    (site,) = [s for s in report.unmatched if s.pattern == "rms_norm"]
    assert "autograd_function_apply" in site.reason, site.reason
    ref = torch.autograd.grad(model(x), (x, model.w))
    got = torch.autograd.grad(torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(x), (x, model.w))
    assert max(rel_err(a, b) for a, b in zip(got, ref)) < FP32_TOL


def _sac_llama(policy):
    model = hf_model("llama", num_hidden_layers=2)
    context = functools.partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: policy)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": context})
    return model.train()


@pytest.mark.hf_checkpointing
def test_selective_checkpointing_keeps_its_policy_and_the_head_is_fused():
    inputs = batch()
    ref_loss, ref = loss_and_grads(hf_model("llama", num_hidden_layers=2), inputs)
    recompute = _sac_llama(CheckpointPolicy.PREFER_RECOMPUTE)
    loss_err, grad_err, report, _ = compiled_parity(recompute, inputs)
    # the decoder layers are the regions; the final norm and the loss head sit outside them
    assert report.counts() == {"rms_norm": 1, "rope": 0, "swiglu": 0, "linear_cross_entropy": 1}, str(report)
    assert len(report.opaque) == 2 and all("selective activation checkpointing" in o for o in report.opaque)
    assert not report.errors and loss_err < FP32_TOL and grad_err < FP32_TOL
    # the policy still decides what is saved: recompute-everything saves less than save-everything
    recomputed, loss, grads = saved_bytes(recompute, inputs, {"inner": "aot_eager"})
    saved, _, _ = saved_bytes(_sac_llama(CheckpointPolicy.MUST_SAVE), inputs, {"inner": "aot_eager"})
    assert recomputed < 0.85 * saved, (recomputed, saved)
    assert rel_err(loss, ref_loss) < FP32_TOL and max(rel_err(grads[k], ref[k]) for k in ref) < FP32_TOL


class InPlaceRegion(nn.Module):
    """A selectively checkpointed region that scales its activation in place (``h.mul_(2.0)``, its
    result unused): before fxfuse's own DCE, torch's erased that call inside the kept region and the
    loss changed silently (both inner compilers)."""

    def __init__(self, d=8):
        super().__init__()
        self.norm, self.lin = nn.RMSNorm(d, eps=1e-6), nn.Linear(d, d)

    def region(self, x):
        h = self.lin(self.norm(x))
        h.mul_(2.0)
        return F.silu(h)

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts,
                                    lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)
        return torch.utils.checkpoint.checkpoint(self.region, x, use_reentrant=False, context_fn=context).sum()


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_selective_checkpoint_region_keeps_its_in_place_calls(inner):
    torch.manual_seed(0)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    loss_err, grad_err, report, _ = compiled_parity(InPlaceRegion(), {"x": x}, inner=inner, loss_fn=lambda out: out)
    assert len(report.opaque) == 1 and "selective activation checkpointing" in report.opaque[0], report.opaque
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def _causal(b, h, q, kv):
    return q >= kv


class FlexBlock(TitanBlock):
    """torchtitan's block with flex attention on a block mask built outside the model."""

    def attention(self, q, k, v, block_mask):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


class FlexLM(TitanLM):
    def __init__(self, dim=32, heads=4, kv_heads=2, hidden=48, layers=2):
        super().__init__(dim=dim, heads=heads, kv_heads=kv_heads, hidden=hidden, layers=layers)
        self.layers = nn.ModuleList(FlexBlock(dim, heads, kv_heads, hidden) for _ in range(layers))

    def forward(self, input_ids, labels, block_mask):
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, self.freqs_cis[: input_ids.shape[1]], block_mask)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _flex_inputs(device):
    from torch.nn.attention.flex_attention import create_block_mask

    ids = batch()["input_ids"].to(device)
    mask = create_block_mask(_causal, None, None, ids.shape[1], ids.shape[1], device=device)
    return {"input_ids": ids, "labels": ids, "block_mask": mask}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("inner,dynamic", [("aot_eager", False), ("inductor", True)])
def test_flex_attention_model_is_fused_around_it(inner, dynamic):
    """PyTorch's CPU flex attention has no backward, so this checks inference; the gpu test below
    trains."""
    torch.manual_seed(0)
    model = FlexLM()
    inputs = _flex_inputs("cpu")
    with torch.no_grad():
        ref = model(**inputs)
        torch._dynamo.reset()
        out = torch.compile(model, backend="fxfuse", options={"inner": inner}, dynamic=dynamic)(**inputs)
    report = fxfuse.last_report()
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}, str(report)
    assert len(report.opaque) == 2 and all(o.startswith("flex_attention") for o in report.opaque)
    assert rel_err(out, ref) < FP32_TOL


@pytest.mark.gpu
def test_flex_attention_trains_with_parity_on_cuda():
    torch.manual_seed(0)
    model = FlexLM(dim=64).cuda()  # Inductor's flex kernels need head_dim >= 16
    loss_err, grad_err, report, _ = compiled_parity(model, _flex_inputs("cuda"), inner="inductor",
                                                    loss_fn=lambda out: out)
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}, str(report)
    assert len(report.opaque) == 2 and not report.errors
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.gpu
def test_hf_flex_attention_trains_with_parity_on_cuda():
    model = hf_model("llama", attn_implementation="flex_attention", head_dim=16).cuda()  # Inductor's flex: >= 16
    inputs = {k: v.cuda() for k, v in batch().items()}
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, inner="inductor")
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}, str(report)
    flex = [o for o in report.opaque if o.startswith("flex_attention")]  # and the block mask's vmap regions
    assert len(flex) == 2 and all(o.startswith("torch.vmap") for o in report.opaque if o not in flex), report.opaque
    assert not report.errors, report.errors
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_hf_flex_attention_is_fused_around_it():
    """attn_implementation="flex_attention": transformers builds the block mask under the compile
    (its own graph, with torch.vmap regions: kept as written, opaque.outline_vmaps); the model's graphs
    fuse, and no graph is left unfused."""
    model = hf_model("llama", attn_implementation="flex_attention")
    inputs = batch()
    n0 = len(fxfuse.compiled_reports())
    with torch.no_grad():
        ref = model(**inputs).loss
        torch._dynamo.reset()
        out = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(**inputs).loss
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}, str(report)
    flex = [o for o in report.opaque if o.startswith("flex_attention")]
    assert len(flex) == 2 and all(o.startswith("torch.vmap") for o in report.opaque if o not in flex), report.opaque
    assert len(report.opaque) > 2 and not report.errors, report.errors
    assert rel_err(out, ref) < FP32_TOL


def _scan_step(a0, b0, a1, b1):
    """h_t = a_t * h_{t-1} + b_t as an associative combine of (a, b) pairs."""
    return a0 * a1, a1 * b0 + b1


class NormThenScan(nn.Module):
    """An RMSNorm feeding a linear recurrence through torch's associative_scan higher-order op (what
    HF Mamba / Falcon-Mamba / Jamba trace to on CUDA, where the scan's combine mode is pointwise;
    on CPU the op is called directly, as the user-facing wrapper's generic mode traces through vmap)."""

    def __init__(self, d=8):
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)
        self.lin = nn.Linear(d, 2 * d)

    def forward(self, x):  # x [T, B, d]: the scan runs over dim 0
        from torch._higher_order_ops.associative_scan import associative_scan_op

        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        a, b = torch.sigmoid(self.lin(h)).chunk(2, -1)
        return associative_scan_op(_scan_step, (a.contiguous(), b.contiguous()), ())[1].pow(2).sum()


def test_associative_scan_is_kept_and_the_rest_is_fused():
    torch.manual_seed(0)
    model = NormThenScan()
    loss_err, grad_err, report, _ = compiled_parity(model, {"x": torch.randn(6, 2, 8)}, inner="aot_eager",
                                                    loss_fn=lambda out: out)
    assert report.counts()["rms_norm"] == 1 and not report.errors, str(report)
    assert len(report.opaque) == 1 and "associative_scan" in report.opaque[0]
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_other_higher_order_ops_still_leave_the_graph_unfused():
    """torch.cond's branches are not in opaque.KEPT: the graph compiles unfused and says why."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(8)

        def forward(self, x):
            h = self.norm(x)
            return torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t - 1, (h,)).sum()

    model = Branchy()
    x = torch.randn(3, 8)
    report = fxfuse.explain(model, x)
    assert report.counts()["rms_norm"] == 0
    assert any("higher-order op cond" in e for e in report.errors), report.errors
    out = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(x)
    torch.testing.assert_close(out, model(x))


class VmapMaskBlock(TitanBlock):
    """torchtitan's block with SDPA on a boolean mask."""

    def attention(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class VmapMaskLM(TitanLM):
    """Causal attention plus Gemma 3's bidirectional spans (tokens of one image see each other), the
    [B, 1, T, T] mask built as transformers builds it for a custom mask function: a mask function of
    scalar (batch, query, key) indices, torch.vmap'ed over each index in turn."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.layers = nn.ModuleList(VmapMaskBlock(32, 4, 2, 48) for _ in range(2))

    def forward(self, input_ids, labels, span_ids):
        t = input_ids.shape[1]

        def visible(b, q, kv):  # span 0: text; a span > 0 is bidirectional
            s = span_ids[b]
            return (kv <= q) | ((s.index_select(0, q.view(1)) == s.index_select(0, kv.view(1))).squeeze(0)
                               & (s.index_select(0, q.view(1)) > 0).squeeze(0))

        over_kv = torch.vmap(visible, in_dims=(None, None, 0))
        over_q = torch.vmap(over_kv, in_dims=(None, 0, None))
        mask = torch.vmap(over_q, in_dims=(0, None, None))(
            torch.arange(input_ids.shape[0]), torch.arange(t), torch.arange(t))[:, None]
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, self.freqs_cis[:t], mask)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_vmap_region_is_kept_and_the_model_is_fused_around_it(inner):
    """A torch.vmap region in the graph (transformers' masks with a custom mask function: Gemma 3 / 4
    with images, flex attention's block masks) used to leave the whole graph unfused; it is now one
    call kept as written (opaque.outline_vmaps), every site around it fuses, and the loss and every
    gradient match eager."""
    torch.manual_seed(0)
    model = VmapMaskLM()
    inputs = batch()
    span = torch.zeros_like(inputs["input_ids"])
    span[0, 2:5], span[1, 4:8] = 1, 2
    inputs["span_ids"] = span
    with torch.no_grad():  # the spans change the loss: the mask is not plain causal
        assert rel_err(model(**inputs), model(**(inputs | {"span_ids": torch.zeros_like(span)}))) > 1e-4
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, inner=inner, loss_fn=lambda out: out)
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}, str(report)
    assert report.opaque and all(o.startswith("torch.vmap") for o in report.opaque), report.opaque
    assert not report.errors and loss_err < FP32_TOL and grad_err < FP32_TOL, (report.errors, loss_err, grad_err)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_vmap_region_mutating_its_input_is_kept_and_the_mutation_seen(inner):
    """A vmapped function that mutates its input in place (each row doubled) before an RMSNorm reads
    that input: the region is kept as written, the norm after it fuses and sees the doubled rows, and
    the loss and gradients match eager."""
    def double_row(row):
        row.mul_(2.0)
        return row.sum()

    def fn(x, w):
        y = x.clone()
        sums = torch.vmap(double_row)(y)
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * w).sum() + sums.square().sum()

    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    ref = fn(x, w)
    ref_grads = torch.autograd.grad(ref, (x, w))
    torch._dynamo.reset()
    n0 = len(fxfuse.compiled_reports())
    out = torch.compile(fn, backend="fxfuse", options={"inner": inner})(x, w)
    grads = torch.autograd.grad(out, (x, w))
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    assert report.counts()["rms_norm"] == 1 and not report.errors, str(report)
    assert len(report.opaque) == 1 and report.opaque[0].startswith("torch.vmap"), report.opaque
    assert rel_err(out, ref) < FP32_TOL and all(rel_err(g, r) < FP32_TOL for g, r in zip(grads, ref_grads))
