"""lm_head + cross-entropy end to end: the loss head fused in HF (untied, tied, softcap) and
hand-written models, HF's sum / num_items_in_batch path, all-ignored batches; loss and gradients
equal eager's; returned logits exact and detached."""
import copy

import pytest
import torch

import fxfuse
from helpers import batch, bf16_errors, compiled_parity, hf_model, loss_and_grads, rel_err
from models import NanoGPT
from probe_spellings import head_fn

FP32_TOL = 1e-5


@pytest.mark.parametrize("model_type,overrides,variant", [
    ("llama", {"tie_word_embeddings": False}, "lce_hf"),
    ("qwen2", {"tie_word_embeddings": True}, "lce_hf"),
    ("gemma2", {"final_logit_softcapping": 30.0}, "lce_hf_softcap"),
])
def test_hf_loss_head_fused(model_type, overrides, variant):
    model = hf_model(model_type, **overrides)
    loss_err, grad_err, report, names = compiled_parity(model, batch())
    (site,) = [s for s in report.matched if s.pattern == "linear_cross_entropy"]
    assert site.variant == variant
    assert any(t.startswith("log_softmax") for t in site.saved_tensors)  # CE's [N, V] buffer is gone
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert any("embed_tokens" in n or "lm_head" in n for n in names)


def test_num_items_in_batch_sum_path():
    model = hf_model("llama")
    inputs = batch() | {"num_items_in_batch": torch.tensor(11)}
    loss_err, grad_err, report, _ = compiled_parity(model, inputs)
    assert report.counts()["linear_cross_entropy"] == 1
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


def test_all_ignored_batch_matches_eager():
    model = hf_model("llama")
    ids = batch()["input_ids"]
    inputs = {"input_ids": ids, "labels": torch.full_like(ids, -100)}
    ref = model(**inputs).loss
    out = torch.compile(copy.deepcopy(model), backend="fxfuse", options={"inner": "aot_eager"})(**inputs).loss
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert torch.isnan(ref) and torch.isnan(out)  # mean over zero targets is nan in PyTorch


def test_nanogpt_tied_ignore_index_minus_one():
    torch.manual_seed(0)
    model = NanoGPT()
    ids = batch()["input_ids"]
    labels = ids.clone()
    labels[:, -3:] = -1
    loss_err, grad_err, report, names = compiled_parity(model, {"input_ids": ids, "labels": labels},
                                                        loss_fn=lambda out: out)
    (site,) = [s for s in report.matched if s.pattern == "linear_cross_entropy"]
    assert report.counts()["rms_norm"] == 0 and report.counts()["swiglu"] == 0  # LayerNorm, plain GELU
    assert loss_err < FP32_TOL and grad_err < FP32_TOL
    assert "wte.weight" in names


class Head(torch.nn.Module):
    """A bare loss head in the spellings hand-written code uses."""

    def __init__(self, spelling, h=24, v=70, bias=False):
        super().__init__()
        self.spelling = spelling
        self.lin = torch.nn.Linear(h, v, bias=bias)
        if spelling.startswith("logits_bias"):  # a bias added on its own: [1, V] as BART's, or [V]
            self.logits_bias = torch.nn.Parameter(torch.randn((1, v) if spelling.endswith("row") else (v,)))

    def forward(self, x, labels):
        F = torch.nn.functional
        if self.spelling == "matmul":
            logits = x @ self.lin.weight.t()
            return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), reduction="sum") / 7
        if self.spelling == "matmul_flatten":  # x @ W.T in torchtitan's flatten-then-cast form
            return F.cross_entropy((x @ self.lin.weight.T).flatten(0, 1).float(), labels.flatten(0, 1))
        if self.spelling == "matmul_transpose_scaled":
            logits = ((x @ self.lin.weight.transpose(0, 1)) * 0.5).float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        if self.spelling == "class_dim_second":
            return F.cross_entropy(self.lin(x).float().transpose(1, 2), labels, label_smoothing=0.1)
        if self.spelling == "flatten":
            return F.cross_entropy(self.lin(x).flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=3)
        if self.spelling == "scaled":
            logits = (self.lin(x) * 0.5).float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        if self.spelling == "flat_bias_scaled":  # 2-D hidden states, a biased head, a logit scale
            return F.cross_entropy((self.lin(x.flatten(0, 1)) * 0.5).float(), labels.flatten())
        if self.spelling.startswith("logits_bias"):  # BART: lm_head(x) + final_logits_bias, uncast
            logits = self.lin(x) + self.logits_bias
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        if self.spelling == "cast_then_flatten_softcap":  # .float() before flatten, a biased head
            logits = torch.tanh(self.lin(x) / 30.0) * 30.0
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1), reduction="sum")
        return F.cross_entropy(self.lin(x).float().view(-1, 70), labels.view(-1))


@pytest.mark.parametrize("spelling,variant,bias", [
    ("matmul", "lce_hf", False), ("matmul_flatten", "lce_hf", False),
    ("matmul_transpose_scaled", "lce_hf_scaled", False), ("class_dim_second", "lce_class_dim_second", False),
    ("flatten", "lce_hf", False), ("scaled", "lce_hf_scaled", False), ("bias", "lce_hf_bias", True),
    ("flat_bias_scaled", "lce_bias_scaled", True), ("cast_then_flatten_softcap", "lce_bias_softcap", True),
    ("logits_bias_row", "lce_logits_bias_bart", False), ("logits_bias_vector", "lce_logits_bias_bart", False)])
def test_hand_written_heads(spelling, variant, bias):
    torch.manual_seed(0)
    model = Head(spelling, bias=bias)
    x = torch.randn(3, 5, 24, requires_grad=True)
    labels = torch.randint(0, 70, (3, 5))
    loss_err, grad_err, report, _ = compiled_parity(model, {"x": x, "labels": labels}, loss_fn=lambda out: out)
    assert [s.variant for s in report.matched] == [variant], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


# (dtype, cast): in fp32 .float() is no op, so only bf16 runs it before the transform, or without it
HEAD_OPTIONS = [pytest.param(dt, layout, transform, bias, cast,
                             id=f"{str(dt)[6:]}-{layout}-{transform}-{'bias' if bias else 'no_bias'}-float_{cast}")
                for dt, cast in ((torch.float32, "after"), (torch.bfloat16, "after"), (torch.bfloat16, "before"),
                                 (torch.bfloat16, "none"))
                for layout in ("2d", "view", "flatten") for transform in ("none", "scale", "divide", "softcap")
                for bias in (False, True)]


@pytest.mark.parametrize("dtype,layout,transform,bias,cast", HEAD_OPTIONS)
def test_every_combination_of_head_options_fuses(dtype, layout, transform, bias, cast):
    """Issue 3's options are independent: 2-D hidden states or [B, T, H] with view / flatten, any
    logit transform, with or without a bias and .float(): each is one fused site, nothing unmatched."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*((16,) if layout == "2d" else (2, 8)), 16, generator=g).to(dtype).requires_grad_()
    w = torch.randn(40, 16, generator=g).to(dtype).requires_grad_()
    b = torch.randn(40, generator=g).to(dtype).requires_grad_()
    t = torch.randint(0, 40, (16,), generator=g)
    report = fxfuse.explain(head_fn(layout, transform, bias, cast), x, w, b, t)
    assert report.counts()["linear_cross_entropy"] == 1 and not report.unmatched, str(report)


def _bf16_head_runs(fn, layout, w_std, options):
    """[loss, dx, dw, db] of fn in fp32, in bf16 eager and in bf16 compiled with options, on one set of
    values (a biased head over 48 tokens, every 7th ignored)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*((48,) if layout == "2d" else (4, 12)), 32, generator=g)
    w, b = w_std * torch.randn(96, 32, generator=g), torch.randn(96, generator=g)
    t = torch.randint(0, 96, (48,), generator=g)
    t[::7] = -100

    def run(f, dtype):
        leaves = [v.to(dtype).requires_grad_() for v in (x, w, b)]
        loss = f(*leaves, t)
        return [loss.float(), *(d.float() for d in torch.autograd.grad(loss, leaves))]

    compiled = torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"} | options)
    return run(fn, torch.float32), run(fn, torch.bfloat16), run(compiled, torch.bfloat16)


@pytest.mark.parametrize("layout,transform", [("2d", "softcap"), ("flatten", "scale")])
def test_bf16_uncast_head_within_twice_eager_error(layout, transform):
    """A bf16 head with no .float() (cross_entropy on bf16 logits) and a bias, fused: loss and
    gradients within 2x eager bf16's error against the fp32 computation on the same values."""
    ref, eager, mine = _bf16_head_runs(head_fn(layout, transform, True, "none"), layout, 0.2, {})
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    for name, e, f, r in zip(("loss", "dx", "dw", "db"), eager, mine, ref):
        assert rel_err(f, r) <= 2 * rel_err(e, r), (name, rel_err(f, r), rel_err(e, r))


@pytest.mark.parametrize("numerics", ["eager", "fp32"])
@pytest.mark.parametrize("transform,variant", [("softcap", "lce_bias_fp32_softcap"),
                                               ("divide", "lce_bias_fp32_divided")])
def test_bf16_head_cast_before_transform(numerics, transform, variant):
    """.float() before the softcap / divisor (nanochat): the transform runs in fp32, so
    numerics="eager" rounds only the lm_head's output and its gradient: loss and gradients equal
    eager bf16's (fast algorithm: eager's own matmuls); either numerics within 2x eager's error
    against the fp32 computation. Logits std ~11: the softcap is not flat."""
    ref, eager, mine = _bf16_head_runs(head_fn("flatten", transform, True, "before"), "flatten", 2.0,
                                       {"numerics": numerics, "loss_head": "fast"})
    assert [s.variant for s in fxfuse.last_report().matched] == [variant]
    for name, e, f, r in zip(("loss", "dx", "dw", "db"), eager, mine, ref):
        assert rel_err(f, r) <= 2 * rel_err(e, r), (name, rel_err(f, r), rel_err(e, r))
        if numerics == "eager":
            assert rel_err(f, e) < 2e-4, (name, rel_err(f, e))


def _modded_nanogpt_head(x, w, t):
    """modded-nanogpt's head: lm_head(x).float(), 30 * sigmoid(z / (7.5 sqrt(H))), sum reduction."""
    logits = torch.nn.functional.linear(x, w).float()
    logits = 30 * torch.sigmoid(logits / (7.5 * x.size(-1) ** 0.5))
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), t, reduction="sum",
                                             label_smoothing=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_capped_head_modded_nanogpt(dtype):
    """30 * sigmoid(z / k) is the softcap 15 of z * 30 / (4 k) shifted by 15, which cross-entropy
    (label smoothing's mean term too) does not see: fused, loss and gradients equal eager's (fp32
    < 1e-5; bf16 under numerics="eager" < 2e-4, only the lm_head output rounded)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 12, 64, generator=g).to(dtype)
    w = (8.0 * torch.randn(96, 64, generator=g)).to(dtype)  # z / k ~ +-1: the sigmoid bends
    t = torch.randint(0, 96, (48,), generator=g)
    t[::7] = -100

    def run(fn):
        leaves = [v.detach().clone().requires_grad_() for v in (x, w)]
        loss = fn(*leaves, t)
        return [loss, *torch.autograd.grad(loss, leaves)]

    eager = run(_modded_nanogpt_head)
    opts = {"inner": "aot_eager", "loss_head": "fast"}
    mine = run(torch.compile(_modded_nanogpt_head, backend="fxfuse", options=opts))
    assert [s.variant for s in fxfuse.last_report().matched] == ["lce_sigmoid_modded_nanogpt"]
    tol = FP32_TOL if dtype == torch.float32 else 2e-4
    for name, f, e in zip(("loss", "dx", "dw"), mine, eager):
        assert rel_err(f, e) < tol, (name, rel_err(f, e))


class ChunkedAndPerTokenHeads(torch.nn.Module):
    """Heads chunked over tokens or keeping per-token losses: torchtune's CEWithChunkedOutputLoss
    (the output projection per 2-token chunk, each chunk's .float() sum loss added up, over the
    unmasked count), litgpt's chunked lm_head (reduction="none" per 4-token chunk, losses
    concatenated), an SFT loss weighted per token, class dim second ([B, V, T] logits, [B, T] losses)."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling, self.lin = spelling, torch.nn.Linear(24, 70, bias=False)

    def forward(self, x, labels, weights):
        F = torch.nn.functional
        if self.spelling == "torchtune_chunked":
            chunks = [self.lin(xc).reshape(-1, 70) for xc in x.chunk(4, dim=1)]
            total = 0.0
            for z, t in zip(chunks, [t.reshape(-1) for t in labels.chunk(4, dim=1)]):
                total += F.cross_entropy(z.float(), t, ignore_index=-100, reduction="sum")
            return total / (labels != -100).sum()
        if self.spelling == "litgpt_chunked":
            chunks = [self.lin(xc) for xc in x.split(4, dim=1)]
            losses = [F.cross_entropy(z.reshape(-1, z.size(-1)), t.reshape(-1), reduction="none")
                      for z, t in zip(chunks, labels.split(4, dim=1))]
            count = (labels != -100).sum()
            return torch.cat(losses).sum() / count.maximum(torch.ones_like(count))
        if self.spelling == "weighted":
            rows = F.cross_entropy(self.lin(x).float().view(-1, 70), labels.view(-1), reduction="none")
            return (rows * weights.view(-1)).sum() / weights.sum()
        rows = F.cross_entropy(self.lin(x).float().transpose(1, 2), labels, reduction="none", label_smoothing=0.1)
        return (rows * weights).mean()


@pytest.mark.parametrize("spelling,sites,inner", [("torchtune_chunked", 4, "aot_eager"),
                                                 ("litgpt_chunked", 2, "aot_eager"), ("weighted", 1, "aot_eager"),
                                                 ("class_dim_second", 1, "aot_eager"),
                                                 ("class_dim_second", 1, "inductor")])
def test_chunked_and_per_token_heads_fuse(spelling, sites, inner):
    """Each chunk's head is one site; reduction="none" fuses, its row losses [N] (or [B, T]) keep
    their shape, 0 on ignored tokens; loss and every gradient equal eager's."""
    torch.manual_seed(0)
    labels = torch.randint(0, 70, (3, 8))
    labels[0, :3] = -100
    inputs = {"x": torch.randn(3, 8, 24), "labels": labels, "weights": torch.rand(3, 8)}
    loss_err, grad_err, report, _ = compiled_parity(ChunkedAndPerTokenHeads(spelling), inputs, inner=inner,
                                                    loss_fn=lambda out: out)
    assert report.counts()["linear_cross_entropy"] == sites and not report.unmatched, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.parametrize("cut", ["prefix", "offset", "returned"])
def test_padded_vocab_slice(cut):
    """logits[..., :V] of an lm_head padded past V rows fuses as the head over its first V rows (loss
    and gradients equal eager's, the padding rows' gradient 0); a slice that drops leading rows, or
    padded logits used elsewhere too (returned), is another computation and stays unfused."""
    lin = torch.nn.Linear(16, 64, bias=True)
    start = 1 if cut == "offset" else 0

    def fn(x, t):
        z = lin(x)
        logits = z[..., start:40].float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), t.view(-1))
        return (loss, z) if cut == "returned" else loss

    x, t = torch.randn(2, 5, 16, requires_grad=True), torch.randint(0, 40 - start, (2, 5))
    report = fxfuse.explain(fn, x, t)
    assert report.counts()["linear_cross_entropy"] == (cut == "prefix"), str(report)
    if cut != "prefix":
        assert [s.pattern for s in report.unmatched] == ["linear_cross_entropy"], str(report)
        return
    ref = torch.autograd.grad(fn(x, t), (x, lin.weight, lin.bias))
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"})(x, t),
                              (x, lin.weight, lin.bias))
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert all(rel_err(g, r) < FP32_TOL for g, r in zip(got, ref))
    assert got[1][40:].abs().max() == 0 and got[2][40:].abs().max() == 0


def test_cross_entropy_over_another_axis_is_not_fused():
    """Logits [B, T, V] handed to cross_entropy whole (class dim 1 = T, targets [B, V]) are a
    different loss: the row-merge elision must not make them look like [N, V] logits."""
    lin = torch.nn.Linear(16, 6)
    x, t = torch.randn(2, 6, 16), torch.randint(0, 6, (2, 6))
    report = fxfuse.explain(lambda x, t: torch.nn.functional.cross_entropy(lin(x).float(), t), x, t)
    assert report.counts()["linear_cross_entropy"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "linear_cross_entropy"]
    assert "not [N, V] logits" in site.reason, site.reason


def test_logits_used_in_graph_is_not_fused():
    """A z-loss on the logits would lose its gradient if the logits were detached: not fused."""
    class ZLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 40)

        def forward(self, x, labels):
            logits = self.lin(x).float()
            ce = torch.nn.functional.cross_entropy(logits.view(-1, 40), labels.view(-1))
            return ce + 1e-2 * torch.logsumexp(logits, -1).pow(2).mean()

    model = ZLoss()
    x, labels = torch.randn(2, 3, 16), torch.randint(0, 40, (2, 3))
    report = fxfuse.explain(model, x, labels)
    assert report.counts()["linear_cross_entropy"] == 0
    (site,) = [s for s in report.unmatched if s.pattern == "linear_cross_entropy"]
    assert "also used outside" in site.reason


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_bf16_loss_head_within_twice_eager_error(model_type):
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(lambda dt: hf_model(model_type, dtype=dt), batch(),
                                                      patterns=["linear_cross_entropy"])
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_skipped_logits_fail_loudly(inner):
    model = hf_model("llama", num_hidden_layers=1)
    inputs = batch()
    ref_loss, ref_grads = loss_and_grads(model, inputs)
    mine = copy.deepcopy(model)
    compiled = torch.compile(mine, backend="fxfuse", options={"inner": inner, "logits": "skip"})
    mine.zero_grad()
    out = compiled(**inputs)
    out.loss.backward()
    assert rel_err(out.loss, ref_loss) < FP32_TOL
    assert max(rel_err(p.grad, ref_grads[n]) for n, p in mine.named_parameters()) < FP32_TOL
    assert fxfuse.last_report().skipped_outputs
    for use in (lambda t: t.argmax(-1), lambda t: t + 1, lambda t: t.float(), lambda t: t[0],
                lambda t: t.shape, lambda t: t.numel()):
        with pytest.raises(RuntimeError, match="fxfuse skipped computing"):
            use(out.logits)
    assert "fxfuse skipped computing" in repr(out.logits)
    # metadata that holds for the real (detached) logits too: what FSDP2's hooks ask every output
    logits = out.logits
    assert (logits.requires_grad, logits.grad_fn, logits.dtype) == (False, None, torch.float32)


def test_loss_head_option_selects_the_fast_algorithm_with_parity():
    """options={"loss_head": "fast"}: the fused call takes the 3-matmul algorithm; loss and every
    gradient still equal eager's; a bad value is an error naming the option."""
    from fxfuse.backend import transform
    from fxfuse.options import Options

    model = hf_model("llama")
    inputs = batch()
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, options={"loss_head": "fast"})
    assert report.counts()["linear_cross_entropy"] == 1
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    captured = {}

    def capture(gm, ex):
        captured["gm"], captured["ex"] = gm, ex
        return gm

    torch.compile(hf_model("llama"), backend=capture)(**inputs)
    # (algorithm, eager_rounding): default 'auto' is fast under inductor; numerics 'eager' rounds
    for opts, want in (({"loss_head": "fast"}, ("fast", True)), ({"loss_head": "lean"}, ("lean", True)),
                       ({}, ("fast", True)), ({"inner": "aot_eager"}, ("lean", True)),
                       ({"inner": "aot_eager", "loss_head": "fast"}, ("fast", True)),
                       ({"numerics": "fp32"}, ("fast", False))):
        gm, _ = transform(captured["gm"], captured["ex"], Options.parse(opts))
        (call,) = [n for n in gm.graph.nodes if str(n.target) == "fxfuse.linear_cross_entropy.default"]
        assert tuple(call.args[9:]) == (*want, False)  # Llama casts after its (absent) transform
    with pytest.raises(ValueError, match="loss_head"):
        Options.parse({"loss_head": "fastest"})
