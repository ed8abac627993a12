"""Loss heads spelled around the logits rather than through F.cross_entropy of them as they are:

- GPT-2's shift (``lm_logits[..., :-1, :].contiguous()``, GPT2DoubleHeadsModel, ImageGPT, Qwen2-Audio and
  many remote-code models): the row slice reads as its input, the fused head slices the hidden states;
- per-token log-probs (RL policy losses): ``log_softmax(z).gather(-1, t[..., None])``,
  ``z.gather(...) - z.logsumexp(-1)`` and TRL's row loop of logsumexp, rewritten to minus the per-token
  cross-entropy (fxfuse/respell.py) and fused with reduction "none".

Each: the report's count, fp32 loss and every gradient against eager, and the cases left as written
with the report's reason.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from helpers import assert_bf16_head_within_twice_eager, assert_logits_guarded, compiled_parity, loss_and_grads, rel_err

FP32_TOL = 1e-5
V, H = 70, 24


class ShiftHead(nn.Module):
    """x [B, T, H] -> lm_head -> (loss on the logits shifted by one token, the logits)."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.lin = nn.Linear(H, V, bias=spelling == "bias")

    def forward(self, x, labels):
        z = self.lin(x)
        if self.spelling in ("gpt2", "bias"):  # GPT2DoubleHeadsModel's loss, as written there
            shift = z[..., :-1, :].contiguous()
        elif self.spelling == "softcap":  # the shift after a Gemma-2 softcap
            shift = (torch.tanh(z / 30.0) * 30.0)[:, :-1]
        elif self.spelling == "float_first":  # cast, then shift
            shift = z.float()[:, :-1, :]
        elif self.spelling == "window":  # two row slices: rows 2 .. T-2 predict labels 3 .. T-1
            shift = z[:, 2:][:, :-1]
            labels = labels[:, 2:]
        else:
            raise ValueError(self.spelling)
        loss = F.cross_entropy(shift.reshape(-1, V), labels[..., 1:].reshape(-1))
        return loss, z


def _shift_inputs(t: int = 7, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (2, t), generator=g)
    labels[0, -2:] = -100
    return {"x": torch.randn(2, t, H, generator=g), "labels": labels}


@pytest.mark.parametrize("spelling", ["gpt2", "bias", "softcap", "float_first", "window"])
def test_shifted_logits_fused_with_parity(spelling):
    torch.manual_seed(0)
    loss_err, grad_err, report, names = compiled_parity(ShiftHead(spelling), _shift_inputs(),
                                                        loss_fn=lambda out: out[0])
    assert report.counts()["linear_cross_entropy"] == 1, str(report)
    assert not report.unmatched and not report.errors, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert "lin.weight" in names


def test_shifted_head_returns_exact_logits_and_skips_their_rows_in_the_saved_bytes():
    """The logits the model returns are eager's (recomputed from detached x and W, as for any returned
    logits); the report's saved bytes count the shifted rows, [B * (T - 1), V]."""
    torch.manual_seed(0)
    model, inputs = ShiftHead("gpt2"), _shift_inputs(t=9)
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    _, z = compiled(**inputs)
    _, ref = model(**inputs)
    (report,) = fxfuse.compiled_reports()[n0:]
    assert rel_err(z, ref) < FP32_TOL
    assert_logits_guarded(lambda: compiled(**inputs))
    (site,) = report.matched
    assert any(t.endswith(f"float32[{2 * 8}, {V}]") for t in site.saved_tensors), site.saved_tensors


def test_shifted_head_one_compile_across_lengths():
    model = ShiftHead("gpt2")
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}, dynamic=True)
    seen = []
    for t in (7, 11, 16):
        inputs = _shift_inputs(t=t, seed=t)
        (ref, _), (got, _) = model(**inputs), compiled(**inputs)
        assert rel_err(got, ref) < FP32_TOL
        seen.append(len(fxfuse.compiled_reports()))
    assert seen[0] == seen[1] == seen[2], "the backend compiled again for a new sequence length"
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1


def _sliced_after_reshape(x, w, t):
    """[B, T, V] -> [B * T, V], then a slice over those rows (t: [B * T - 3])."""
    return F.cross_entropy(F.linear(x, w).view(-1, V)[:-3], t.flatten()[:-3])


def _sliced_after_transpose(x, w, t):
    """[B, T, V] -> [B, V, T] (class dim second), then a slice of dim 1: the classes, not x's tokens."""
    return F.cross_entropy(F.linear(x, w).transpose(1, 2)[:, :V - 10], t.clamp(max=V - 11))


@pytest.mark.parametrize("head", [_sliced_after_reshape, _sliced_after_transpose])
def test_slice_of_the_logits_laid_out_otherwise_is_left_with_a_reason(head):
    """A slice over a dim that is not the same dim of x: the head stays as written, the report says why,
    and the value is eager's."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 6, H, generator=g), torch.randn(V, H, generator=g).requires_grad_()
    t = torch.randint(0, V, (2, 6), generator=g)
    n0 = len(fxfuse.compiled_reports())
    got = torch.compile(head, backend="fxfuse", options={"inner": "aot_eager"})(x, w, t)
    (report,) = fxfuse.compiled_reports()[n0:]
    assert report.counts()["linear_cross_entropy"] == 0 and not report.errors, str(report)
    (site,) = report.unmatched
    assert "sliced over rows after a reshape or transpose" in site.reason, str(report)
    assert rel_err(got, head(x, w, t)) < FP32_TOL


def test_imagegpt_shifts_its_logits():
    import transformers

    from fxfuse.zoo import hf_config, hf_inputs, without_randomness

    cfg = without_randomness(hf_config("imagegpt"))
    torch.manual_seed(0)
    model = transformers.ImageGPTForCausalImageModeling(cfg)
    loss_err, grad_err, report, names = compiled_parity(model, hf_inputs(cfg.vocab_size - 1))
    assert report.counts()["linear_cross_entropy"] == 1, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert len(names) > 10


def test_gpt2_double_heads_fuses_its_lm_loss_and_leaves_its_choice_loss():
    """GPT2DoubleHeadsModel: the language-model loss on shifted logits is fused; the multiple-choice loss
    (a [H] -> 1 linear per choice, then cross_entropy over the choices) is no lm_head and stays."""
    import transformers

    from fxfuse.zoo import hf_config, without_randomness

    cfg = without_randomness(hf_config("gpt2"))
    torch.manual_seed(0)
    model = transformers.GPT2DoubleHeadsModel(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (2, 3, 8), generator=g)
    inputs = {"input_ids": ids, "labels": ids, "mc_token_ids": torch.full((2, 3), 7),
              "mc_labels": torch.tensor([2, 0])}
    loss_err, grad_err, report, names = compiled_parity(model, inputs, loss_fn=lambda out: out.loss + out.mc_loss)
    assert report.counts()["linear_cross_entropy"] == 1, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert "multiple_choice_head.summary.weight" in names


def logps_gather(z, t):
    """verl's logprobs_from_logits_naive, OpenRLHF's log_probs_from_logits."""
    return F.log_softmax(z, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def logps_logsumexp(z, t):
    """TRL's selective_log_softmax, the whole batch at once."""
    return torch.gather(z, dim=-1, index=t.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def logps_logsumexp_keepdim(z, t):
    return (z.gather(-1, t[..., None]) - z.logsumexp(-1, keepdim=True)).squeeze(-1)


def logps_trl_rows(z, t):
    """TRL's selective_log_softmax for fp32 logits: the logsumexp row by row."""
    selected = torch.gather(z, dim=-1, index=t.unsqueeze(-1)).squeeze(-1)
    return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in z])


def logps_unsqueezed(z, t):
    """The gathered [B, T, 1] log-probs kept, a mask of the same shape."""
    return F.log_softmax(z, -1).gather(-1, t.view(*t.shape, 1))[..., 0]


def logps_row_loop(z, t):
    """TRL's bf16 selective_log_softmax: one row's log_softmax at a time (batched: fxfuse/unstack.py)."""
    return torch.stack([F.log_softmax(zr, -1).gather(-1, tr[:, None]).squeeze(-1) for zr, tr in zip(z, t)])


LOGPS = [logps_gather, logps_logsumexp, logps_logsumexp_keepdim, logps_trl_rows, logps_row_loop, logps_unsqueezed]


class PolicyHead(nn.Module):
    """GRPO-style policy loss on per-token log-probs: -(exp(lp - lp.detach()) * adv) over the mask,
    logits in fp32 and divided by a sampling temperature (TRL, verl)."""

    def __init__(self, logps):
        super().__init__()
        self.logps = logps
        self.lin = nn.Linear(H, V, bias=False)

    def forward(self, x, tokens, adv, mask):
        lp = self.logps(self.lin(x).float() / 0.7, tokens)
        ratio = torch.exp(lp - lp.detach())
        return -(ratio * adv[:, None] * mask).sum() / mask.sum()


def _policy_inputs(b: int = 2, t: int = 6, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b, t)
    mask[0, -2:] = 0
    return {"x": torch.randn(b, t, H, generator=g), "tokens": torch.randint(0, V, (b, t), generator=g),
            "adv": torch.randn(b, generator=g), "mask": mask}


@pytest.mark.parametrize("logps", LOGPS)
def test_per_token_log_probs_fused_with_parity(logps):
    torch.manual_seed(0)
    loss_err, grad_err, report, names = compiled_parity(PolicyHead(logps), _policy_inputs(), loss_fn=lambda out: out)
    assert [s.variant for s in report.matched] == ["lce_hf_divided"], str(report)
    assert not report.unmatched and not report.errors, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert names == ["lin.weight"]


def test_per_token_log_probs_one_compile_across_lengths():
    """dynamic=True: the token ids' and the logits' row counts are separate symbols (gather does not
    require them equal), so the respelling slices the logits to the ids' rows; still fused, one compile."""
    model = PolicyHead(logps_gather)
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}, dynamic=True)
    seen = []
    for t in (6, 9, 14):
        inputs = _policy_inputs(t=t, seed=t)
        ref_loss, ref_grads = loss_and_grads(model, inputs, loss_fn=lambda out: out)
        loss, grads = loss_and_grads(model, inputs, loss_fn=lambda out: out, call=compiled)
        assert rel_err(loss, ref_loss) < FP32_TOL and rel_err(grads["lin.weight"], ref_grads["lin.weight"]) < FP32_TOL
        seen.append(len(fxfuse.compiled_reports()))
    assert seen[0] == seen[1] == seen[2], "the backend compiled again for a new sequence length"
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1, str(fxfuse.last_report())


def test_gather_of_fewer_rows_than_the_logits():
    """gather takes an index with fewer rows than its input and reads the first ones: the fused head
    reads the same rows (the logits sliced to the index's sizes, a row slice of the lm_head)."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 7, H, generator=g), torch.randn(V, H, generator=g).requires_grad_()
    t = torch.randint(0, V, (2, 5), generator=g)

    def head(x, w, t):
        return logps_gather(F.linear(x, w), t)

    got = torch.compile(head, backend="fxfuse", options={"inner": "aot_eager"})(x, w, t)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1, str(fxfuse.last_report())
    ref = head(x, w, t)
    assert got.shape == (2, 5) and rel_err(got, ref) < FP32_TOL
    dw, dw_ref = (torch.autograd.grad(v.sum(), w)[0] for v in (got, ref))
    assert rel_err(dw, dw_ref) < FP32_TOL


def test_per_token_log_probs_values_under_inductor():
    """The log-probs themselves (not only a loss of them), [B, T], compiled by Inductor."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 5, H, generator=g), torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (3, 5), generator=g)

    def head(x, w, t):
        return logps_gather(F.linear(x, w), t)

    got = torch.compile(head, backend="fxfuse")(x, w, t)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert got.shape == (3, 5) and rel_err(got, head(x, w, t)) < FP32_TOL


def test_per_token_log_probs_bf16_within_twice_eagers_error():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 12, 32, generator=g), 0.5 * torch.randn(96, 32, generator=g)
    t = torch.randint(0, 96, (4, 12), generator=g)

    def head(x, w, t):
        return -logps_gather(F.linear(x, w), t).mean()

    assert_bf16_head_within_twice_eager(head, x, w, t)


def test_out_of_range_token_is_nan_never_a_finite_log_prob():
    """Eager's gather raises on a token outside [0, V); -100 (a label pad) is no exception: the fused
    head ignores no index, so the row is nan, never 0 or another finite value."""
    x, w = torch.randn(2, 4, H), torch.randn(V, H)
    t = torch.randint(0, V, (2, 4))
    t[1, 2] = -100

    def head(x, w, t):
        return logps_gather(F.linear(x, w), t)

    with pytest.raises((RuntimeError, IndexError)):
        head(x, w, t)
    got = torch.compile(head, backend="fxfuse", options={"inner": "aot_eager"})(x, w, t)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert torch.isnan(got[1, 2]) and torch.isfinite(got[0]).all()


def _logps_two_readers(z, t):
    """The log-probs also feed an entropy bonus."""
    lp = F.log_softmax(z, -1)
    return lp.gather(-1, t[..., None]).squeeze(-1) + 0.01 * (lp.exp() * lp).sum(-1)


def _logps_other_logsumexp(z, t):
    """The logsumexp of other logits (a temperature on one side only): no per-token log-prob."""
    return z.gather(-1, t[..., None]).squeeze(-1) - (2 * z).logsumexp(-1)


def _logps_rows_reversed(z, t):
    return z.gather(-1, t[..., None]).squeeze(-1) - torch.stack([torch.logsumexp(r, -1) for r in reversed(list(z))])


@pytest.mark.parametrize("logps", [_logps_two_readers, _logps_other_logsumexp, _logps_rows_reversed])
def test_log_probs_that_are_no_cross_entropy_are_left_as_written(logps):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, H, generator=g), torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (2, 5), generator=g)
    w.requires_grad_()

    def head(x, w, t):
        return logps(F.linear(x, w), t).sum()

    n0 = len(fxfuse.compiled_reports())
    got = torch.compile(head, backend="fxfuse", options={"inner": "aot_eager"})(x, w, t)
    (report,) = fxfuse.compiled_reports()[n0:]
    assert report.counts()["linear_cross_entropy"] == 0 and not report.errors, str(report)
    assert rel_err(got, head(x, w, t)) < FP32_TOL


def test_bench_log_probs_case_is_fused_and_agrees_with_eager():
    """bench_linear_cross_entropy.py --log-probs on CPU: fxfuse-compiled fuses the verl spelling it times,
    and it and the bare ops (reduction "none", no index ignored) give eager's loss and gradients."""
    import argparse

    from helpers import load_script

    bench = load_script("bench", "bench_linear_cross_entropy")
    parser = argparse.ArgumentParser()
    bench.add_args(parser)
    args = parser.parse_args(["--log-probs", "--bias"])
    torch._dynamo.reset()
    compiled, note = bench._provider_fn("fxfuse-compiled-lean", args)
    assert note == "loss head fused 1x, 0 unmatched", note
    eager, _ = bench._provider_fn("eager", args)
    x, w, b, t, s = bench._inputs(40, 16, 70, torch.float32, args, device="cpu")
    assert (t >= 0).all()
    ref = bench._fwd_bwd(eager, x, w, b, t, s)
    assert len(ref) == 4  # loss, dx, dW, db
    for fused in (compiled, bench._provider_fn("fxfuse", args)[0], bench._provider_fn("fxfuse-fast", args)[0]):
        for g, r in zip(bench._fwd_bwd(fused, x, w, b, t, s), ref, strict=True):
            assert rel_err(g, r) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["shift", "gather", "trl_rows", "row_loop"])
def test_spellings_on_cuda_under_inductor(case):
    """The same heads on CUDA, Inductor compiling the rest: fused, fp32 loss and gradients as eager's."""
    torch.manual_seed(0)
    if case == "shift":
        model, inputs, loss_fn = ShiftHead("gpt2"), _shift_inputs(t=33), (lambda out: out[0])
    else:
        logps = {"gather": logps_gather, "trl_rows": logps_trl_rows, "row_loop": logps_row_loop}[case]
        model, inputs, loss_fn = PolicyHead(logps), _policy_inputs(b=4, t=33), (lambda out: out)
    inputs = {k: v.cuda() for k, v in inputs.items()}
    loss_err, grad_err, report, _ = compiled_parity(model.cuda(), inputs, inner="inductor", loss_fn=loss_fn)
    assert report.counts()["linear_cross_entropy"] == 1, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.gpu
def test_returned_logits_guarded_on_cuda_under_inductor():
    """GPT-2's shifted head on CUDA under Inductor: the returned logits are eager's, and guarded."""
    torch.manual_seed(0)
    model, inputs = ShiftHead("gpt2").cuda(), {k: v.cuda() for k, v in _shift_inputs(t=33).items()}
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "inductor"})
    _, z = compiled(**inputs)
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert rel_err(z, model(**inputs)[1]) < FP32_TOL
    assert_logits_guarded(lambda: compiled(**inputs))
