"""HF generate() through a forward compiled with fxfuse (the usual way to sample during training:
``model.forward = torch.compile(model.forward, ...)``): prefill and KV-cache decode steps of one token,
under no_grad, each compiled graph with every norm, rotation and gated MLP fused; greedy tokens and
every step's scores as eager's; the same compiled forward then trains with eager's loss."""
import copy

import pytest
import torch

import fxfuse
from helpers import batch, hf_model, rel_err

FP32_TOL = 1e-5
# per compiled graph of a 2-layer model: (rms_norm, rope, swiglu); Gemma 2 has 4 norms per layer
SITES = {"llama": (5, 2, 2), "gemma2": (9, 2, 2)}


def generate_through_a_compiled_forward(model_type: str, device: str, inner: str) -> None:
    model = hf_model(model_type, use_cache=True).to(device).eval()
    ids = batch(t=7)["input_ids"].to(device)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(ids, **kw)
    mine = copy.deepcopy(model)
    mine.forward = torch.compile(mine.forward, backend="fxfuse", options={"inner": inner})
    since = len(fxfuse.compiled_reports())
    out = mine.generate(ids, **kw)
    reports = fxfuse.compiled_reports()[since:]
    assert reports, "generate() never ran the compiled forward"
    for r in reports:  # prefill and decode graphs alike
        c = r.counts()
        assert (c["rms_norm"], c["rope"], c["swiglu"]) == SITES[model_type], str(r)
        assert not r.unmatched and not r.errors, str(r)
    assert torch.equal(out.sequences, ref.sequences)
    assert max(rel_err(s, e) for s, e in zip(out.scores, ref.scores)) < FP32_TOL

    model.train(), mine.train()
    inputs = {k: v.to(device) for k, v in batch().items()}
    ref_loss, loss = model(**inputs).loss, mine(**inputs).loss
    assert fxfuse.last_report().counts()["linear_cross_entropy"] == 1
    assert rel_err(loss, ref_loss) < FP32_TOL


@pytest.mark.parametrize("model_type", sorted(SITES))
def test_generate_through_a_compiled_forward(model_type):
    generate_through_a_compiled_forward(model_type, "cpu", "aot_eager")


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", sorted(SITES))
def test_generate_through_a_compiled_forward_on_cuda_under_inductor(model_type):
    generate_through_a_compiled_forward(model_type, "cuda", "inductor")
