"""The caller's autocast at the first compile: pattern graphs are traced once per process, then, and
must not depend on it."""
import pytest
import torch

import fxfuse
from helpers import batch, bf16_errors, hf_model


def _pattern_signatures() -> dict:
    from fxfuse.pattern import _signature, trace_variant
    from fxfuse.patterns import all_patterns

    trace_variant.cache_clear()
    sigs = {(p.name, v.name): [_signature(pg.graph, pg.vnodes) for pg in trace_variant(p, v)]
            for p in all_patterns() for v in p.variants}
    trace_variant.cache_clear()
    return sigs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_pattern_traces_ignore_the_callers_autocast(dtype):
    """Pattern graphs are traced once per process, at the first compile, which may run under the
    user's autocast: they must come out as without it (bf16 autocast changed two loss-head spellings,
    fp16 autocast made every RoPE spelling's trace raise)."""
    plain = _pattern_signatures()
    with torch.autocast("cpu", dtype=dtype):
        assert _pattern_signatures() == plain


def test_fp16_autocast_as_the_first_compile_fuses_every_site():
    """A first compile under fp16 autocast had left the whole graph unfused (the pattern traces raised
    under it); now every site fuses, within twice eager's fp16 error of the fp32 reference."""
    from fxfuse.pattern import trace_variant

    trace_variant.cache_clear()
    inputs = batch()
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(lambda dt: hf_model("llama", dtype=dt), inputs, autocast=True,
                                                      low=torch.float16)
    report = fxfuse.last_report()
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}, str(report)
    assert not report.errors and not report.unmatched, str(report)
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


@pytest.mark.gpu
def test_default_device_cuda_at_the_first_compile():
    """torch.set_default_device("cuda") before the first compile: the patterns' example inputs are made
    on the CPU explicitly (a CPU generator cannot draw a CUDA tensor), and every site fuses."""
    from fxfuse.pattern import trace_variant

    trace_variant.cache_clear()
    inputs = {k: v.cuda() for k, v in batch().items()}  # batch() draws from a CPU generator
    with torch.device("cuda"):
        model = hf_model("llama")
        loss = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(**inputs).loss
    report = fxfuse.last_report()
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}, str(report)
    assert not report.errors and loss.is_cuda
