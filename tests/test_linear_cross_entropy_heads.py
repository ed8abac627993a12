"""Loss heads of other model families: BART's logits bias added on its own (and the autocast case
where that add promotes), and the logits a model returns: exact and guarded (HF Llama), fp32 under
autocast (Mamba)."""
import copy

import pytest
import torch

import fxfuse
from helpers import assert_logits_guarded, batch, bf16_errors, compiled_parity, hf_model, loss_and_grads, rel_err

FP32_TOL = 1e-5


class BiasedLogits(torch.nn.Module):
    """BART's head: an unbiased lm_head, then a [1, V] bias added on its own."""

    def __init__(self, h=24, v=70):
        super().__init__()
        self.lin = torch.nn.Linear(h, v, bias=False)
        self.logits_bias = torch.nn.Parameter(torch.randn(1, v))

    def forward(self, x, labels):
        logits = self.lin(x) + self.logits_bias
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def test_bart_final_logits_bias_fused():
    """BART and its kin add a [1, V] final_logits_bias buffer after an unbiased lm_head (random here:
    HF starts it at zero, where a dropped add would change nothing)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    cfg = AutoConfig.for_model("bart", vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
                               decoder_ffn_dim=48, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)

    def make(dtype=torch.float32):
        torch.manual_seed(0)
        model = AutoModelForSeq2SeqLM.from_config(cfg)
        model.final_logits_bias.normal_()
        for name, p in model.named_parameters():  # softmax ignores k's bias: its true gradient is 0, both
            p.requires_grad_(not name.endswith("k_proj.bias"))  # runs' are rounding noise, no relative error
        return model.to(dtype)

    loss_err, grad_err, report, _ = compiled_parity(make(), batch())
    assert [s.variant for s in report.matched] == ["lce_logits_bias_bart"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, batch(), patterns=["linear_cross_entropy"])
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


def test_bias_add_promoted_by_autocast_is_not_fused():
    """fp32 model under bf16 autocast: the bf16 logits plus the fp32 bias add in fp32, which the fused
    op (adding the bias in the lm_head's dtype) would not reproduce; the report says why."""
    torch.manual_seed(0)
    model = BiasedLogits()
    x, labels = torch.randn(3, 5, 24), torch.randint(0, 70, (3, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fxfuse.explain(model, x, labels)
    assert report.counts()["linear_cross_entropy"] == 0
    (miss,) = [s for s in report.unmatched if s.pattern == "linear_cross_entropy"]
    assert "promotes" in miss.reason, miss.reason


def test_returned_fp32_logits_under_autocast():
    """Mamba returns ``lm_head(h).float()`` and its loss casts them again: under bf16 autocast that cast
    is real and returned, and the head was unfused. Now fused; the returned logits equal eager's, loss
    and gradients within 2x eager's bf16 error."""
    def make(dtype=torch.float32):
        return hf_model("mamba", dtype=dtype)

    inputs = batch()
    options = {"inner": "aot_eager", "patterns": ["linear_cross_entropy"]}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = make()(**inputs).logits
        out = torch.compile(make(), backend="fxfuse", options=options)(**inputs).logits
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1, str(fxfuse.last_report())
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, inputs, autocast=True, patterns=["linear_cross_entropy"])
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


class LastTokenLogits(torch.nn.Module):
    """Returns ``lm_head(h).float()`` through a slice (the last position, as generation reads it) next
    to a loss that casts the same logits again."""

    def __init__(self, h=24, v=70):
        super().__init__()
        self.lin = torch.nn.Linear(h, v, bias=False)

    def forward(self, x, labels):
        logits = self.lin(x).float()
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]).float(), labels.view(-1))
        return loss, logits[:, -1:]


def test_returned_fp32_logits_through_a_slice_under_autocast():
    torch.manual_seed(0)
    model = LastTokenLogits()
    x, labels = torch.randn(3, 5, 24), torch.randint(0, 70, (3, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_last = model(x, labels)
        loss, last = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(x, labels)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1, str(fxfuse.last_report())
    assert last.dtype == torch.float32
    torch.testing.assert_close(last, ref_last, rtol=0, atol=0)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-3, atol=0)


def test_returned_logits_exact_and_guarded():
    """HF's returned logits: eager's values; the loss's backward as eager's, also after an in-place
    write to the logits (same storage, not a view); a backward through them raises; under no_grad
    nothing is guarded."""
    model = hf_model("llama")
    inputs = batch()
    ref_loss, ref_grads = loss_and_grads(model, inputs)
    ref = model(**inputs).logits
    mine = copy.deepcopy(model)
    # the loss head alone: other fusions change the hidden states within fp32 rounding
    options = {"inner": "aot_eager", "patterns": ["linear_cross_entropy"]}
    compiled = torch.compile(mine, backend="fxfuse", options=options)
    out = compiled(**inputs)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    torch.testing.assert_close(out.logits, ref, rtol=0, atol=0)
    out.logits[..., 0] = 0.0
    out.loss.backward()
    assert max(rel_err(p.grad, ref_grads[n]) for n, p in mine.named_parameters()) < FP32_TOL
    assert_logits_guarded(lambda: tuple(compiled(**inputs)[:2]))
    with torch.no_grad():
        assert not compiled(**inputs).logits.requires_grad


class FlatLogits(torch.nn.Module):
    """Returns the [N, V] logits it hands the loss (``logits = lm_head(x).view(-1, V)``, then
    ``cross_entropy(logits.float(), labels.view(-1))`` under autocast): the row merge sits in the site
    and is also a graph output. It had left the head unfused ("no variant matched")."""

    def __init__(self, h=24, v=70):
        super().__init__()
        self.lin = torch.nn.Linear(h, v, bias=False)

    def forward(self, x, labels):
        z = self.lin(x)
        logits = z.view(-1, z.shape[-1])
        upcast = logits if logits.dtype == torch.float32 else logits.float()  # no returned no-op cast in fp32
        return torch.nn.functional.cross_entropy(upcast, labels.view(-1), ignore_index=-1), logits


@pytest.mark.parametrize("autocast", [False, True])
def test_returned_flattened_logits_fused_exact_and_guarded(autocast):
    """fp32, or bf16 autocast (bf16 logits returned, cast to fp32 for the loss): the returned logits
    are eager's bit for bit; loss and gradients within fp32 rounding or 2x eager's bf16 error; a
    backward through the logits raises."""
    torch.manual_seed(0)
    model = FlatLogits()
    x, labels = torch.randn(3, 5, 24, requires_grad=True), torch.randint(0, 70, (3, 5))
    labels[0, :2] = -1
    compiled = torch.compile(copy.deepcopy(model), backend="fxfuse", options={"inner": "aot_eager"})
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ref_loss, ref_logits = model(x, labels)
        loss, logits = compiled(x, labels)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1, str(fxfuse.last_report())
    assert logits.shape == (15, 70) and logits.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    if autocast:
        def make(dtype):
            torch.manual_seed(0)
            return FlatLogits().to(dtype)

        (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(make, {"x": x.detach(), "labels": labels}, autocast=True,
                                                         loss_fn=lambda out: out[0])
        assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))
    else:
        ref_grads = torch.autograd.grad(ref_loss, [x, model.lin.weight])
        grads = torch.autograd.grad(loss, [x, compiled.lin.weight])
        assert rel_err(loss, ref_loss) < FP32_TOL
        assert max(rel_err(g, r) for g, r in zip(grads, ref_grads)) < FP32_TOL
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert_logits_guarded(lambda: compiled(x, labels))
