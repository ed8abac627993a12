"""A hand-written nanochat model end to end: its functional weightless norms (q / k norms after the
rotation too), RoPE by -angle on halves, and the loss head of a padded lm_head sliced to the
vocabulary with the softcap after .float() each fuse, with parity."""
import pytest
import torch

import fxfuse

from helpers import batch, bf16_errors, compiled_parity, load_script
from models import NanoChatLM

LAYERS = 2
SITES = {"rms_norm": 2 + 4 * LAYERS, "rope": LAYERS, "swiglu": 0, "linear_cross_entropy": 1}


def _inputs():
    ids = batch(96, t=10)["input_ids"]
    labels = ids[:, 1:].clone()
    labels[0, :3] = -1  # nanochat's ignore_index
    return {"input_ids": ids[:, :-1], "labels": labels}


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_every_site_fuses_with_fp32_parity(inner):
    torch.manual_seed(0)
    model = NanoChatLM(layers=LAYERS)
    loss_err, grad_err, report, names = compiled_parity(model, _inputs(), inner=inner, loss_fn=lambda out: out)
    assert report.counts() == SITES and not report.unmatched, str(report)
    assert {s.variant for s in report.matched if s.pattern == "rope"} == {"rope_halves_nanochat"}
    assert "lm_head.weight" in names and loss_err < 1e-5 and grad_err < 1e-5, (loss_err, grad_err)


def test_padded_lm_head_rows_get_zero_gradient():
    """Rows past the vocabulary never reach the loss: their gradient is exactly 0, as eager's."""
    torch.manual_seed(0)
    model = NanoChatLM(layers=1)
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    compiled(**_inputs()).backward()
    grad = model.lm_head.weight.grad
    assert grad.shape[0] == 128 and grad[96:].abs().max() == 0 and grad[:96].abs().max() > 0


def test_bf16_within_twice_eager_error():
    def make(dtype):
        torch.manual_seed(0)
        return NanoChatLM(layers=LAYERS).to(dtype)

    n0 = len(fxfuse.compiled_reports())
    (e_loss, e_grads), (f_loss, f_grads) = bf16_errors(make, _inputs(), loss_fn=lambda out: out)
    report = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:])
    assert report.counts() == SITES and {s.variant for s in report.matched if s.pattern == "linear_cross_entropy"} \
        == {"lce_softcap_nanochat"}, str(report)
    assert f_loss <= 2 * e_loss and f_grads <= 2 * e_grads, ((e_loss, e_grads), (f_loss, f_grads))


def test_benchmark_script_runs_on_cpu(monkeypatch, capsys):
    """bench/bench_nanochat.py (the GPU end-to-end run) at a smoke size: the table and fxfuse's sites."""
    import sys

    bench = load_script("bench", "bench_nanochat")
    monkeypatch.setattr(sys, "argv", ["bench_nanochat.py", "--dim", "32", "--layers", "2", "--heads", "2",
                                      "--kv-heads", "1", "--vocab", "100", "--batch", "2", "--seq", "16",
                                      "--steps", "2", "--warmup", "1", "--device", "cpu",
                                      "--providers", "eager", "fxfuse", "fxfuse:linear_cross_entropy"])
    bench.main()
    out = capsys.readouterr().out
    assert "| eager |" in out and "| fxfuse |" in out and "| liger | n/a" in out
    assert "fxfuse sites: rms_norm 10, rope 2, swiglu 0, linear_cross_entropy 1" in out, out
    assert "fxfuse:linear_cross_entropy sites: rms_norm 0, rope 0, swiglu 0, linear_cross_entropy 1" in out, out
