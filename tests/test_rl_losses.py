"""RL and preference losses compiled with the policy model: the whole step fused, the loss head included.

The per-token log-probs come from the model's returned logits, shifted by one token, over a sampling
temperature, spelled as TRL (``selective_log_softmax``, both branches; DPO's ``get_batch_logps``) and
verl (``log_softmax(...).gather``) write them; compiled as one function with the model, the logits are an
interior value and the head fuses (fxfuse/respell.py, the row slice of canon_rules). Each loss: every
site of the tiny HF Llama matched, loss and every gradient as eager's in fp32.
"""
import pytest
import torch
import torch.nn.functional as F

import fxfuse
from helpers import hf_model, rel_err
from test_unstack import trl_bf16_branch  # TRL's selective_log_softmax for bf16 logits

FP32_TOL = 1e-5
LLAMA_SITES = {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}


def selective_log_softmax(logits, index):
    """TRL's, for fp32 logits: the taken token's logit minus each row's logsumexp, one batch row at a time."""
    selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])


def grpo_trl(model, ids, mask, adv, old_logps, selective=selective_log_softmax):
    """GRPO with a clipped ratio against the sampling policy's log-probs (TRL's GRPOTrainer, simplified)."""
    logits = model(input_ids=ids).logits[:, :-1, :] / 0.7
    logps = selective(logits, ids[:, 1:])
    ratio = torch.exp(logps - old_logps)
    per_token = -torch.min(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.2) * adv[:, None])
    return (per_token * mask).sum() / mask.sum()


def grpo_trl_rows(model, ids, mask, adv, old_logps):
    return grpo_trl(model, ids, mask, adv, old_logps, selective=trl_bf16_branch)


def pg_verl(model, ids, mask, adv, old_logps):
    """A policy gradient with a KL penalty to the old log-probs (verl's logprobs_from_logits_naive)."""
    logits = model(input_ids=ids).logits
    logps = F.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    kl = torch.exp(old_logps - logps) - (old_logps - logps) - 1
    return ((-logps * adv[:, None] + 0.05 * kl) * mask).sum() / mask.sum()


def dpo_trl(model, ids, mask, adv, old_logps):
    """DPO on a chosen / rejected pair, the reference model's log-probs given (TRL's get_batch_logps:
    the -100 labels set to 0 in place, then masked out)."""
    labels = ids[:, 1:].masked_fill(mask == 0, -100)
    logits = model(input_ids=ids).logits[:, :-1, :]
    loss_mask = labels != -100
    labels = labels.clone()
    labels[labels == -100] = 0
    logps = (torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2) * loss_mask).sum(-1)
    ref = (old_logps * mask).sum(-1)
    return -F.logsigmoid(0.1 * ((logps[0] - ref[0]) - (logps[1] - ref[1])))


def _inputs(t: int = 9) -> tuple:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (2, t), generator=g)
    mask = torch.ones(2, t - 1)
    mask[0, -3:] = 0
    return ids, mask, torch.randn(2, generator=g), -4.5 + 0.1 * torch.randn(2, t - 1, generator=g)


@pytest.mark.parametrize("loss_fn", [grpo_trl, grpo_trl_rows, pg_verl, dpo_trl])
def test_rl_loss_compiled_with_the_model_fuses_every_site(loss_fn):
    model, inputs = hf_model("llama"), _inputs()
    ref = loss_fn(model, *inputs)
    ref_grads = dict(zip([n for n, _ in model.named_parameters()],
                         torch.autograd.grad(ref, list(model.parameters()))))
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(loss_fn, backend="fxfuse", options={"inner": "aot_eager"})
    loss = compiled(model, *inputs)
    grads = dict(zip(ref_grads, torch.autograd.grad(loss, list(model.parameters()))))
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    assert report.counts() == LLAMA_SITES and not report.unmatched, str(report)
    assert rel_err(loss, ref) < FP32_TOL
    assert max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < FP32_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("loss_fn", [grpo_trl_rows, pg_verl])
def test_rl_loss_on_cuda_under_inductor(loss_fn):
    """The same on CUDA with Inductor compiling the rest (the fused head's CUDA kernels)."""
    model, inputs = hf_model("llama").cuda(), [v.cuda() for v in _inputs(t=33)]
    ref = loss_fn(model, *inputs)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    n0 = len(fxfuse.compiled_reports())
    loss = torch.compile(loss_fn, backend="fxfuse")(model, *inputs)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    assert report.counts() == LLAMA_SITES and not report.unmatched, str(report)
    assert rel_err(loss, ref) < FP32_TOL
    assert max(rel_err(g, r) for g, r in zip(grads, ref_grads)) < FP32_TOL
