"""Vision-language models from tiny configs, trained on a batch with an image: every RMSNorm, RoPE,
gated-MLP and loss-head call of the vision tower and the language model fused (counted at run time,
fxfuse.harness), and the loss and every gradient at fp32 parity with eager."""
import pytest
import torch

from fxfuse.harness import check
from fxfuse.zoo import without_randomness
from tests.vlm_cases import VLMS

EXPECTED = {  # sites per pattern: (vision tower, language model) summed
    "qwen2_vl": {"rms_norm": 5, "rope": 4, "swiglu": 2, "linear_cross_entropy": 1},
    "qwen2_5_vl": {"rms_norm": 10, "rope": 4, "swiglu": 4, "linear_cross_entropy": 1},
    "llava": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "gemma3": {"rms_norm": 14, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
}


@pytest.mark.parametrize("model_type", VLMS)
def test_vlm_with_an_image_is_fused_with_parity(model_type):
    from transformers import AutoModelForImageTextToText

    cfg, inputs = VLMS[model_type]()
    cfg = without_randomness(cfg)

    def build():
        torch.manual_seed(0)
        return AutoModelForImageTextToText.from_config(cfg)

    r = check(model_type, build, inputs, bf16_steps=0)
    assert r.expected == EXPECTED[model_type] and r.matched == r.expected, (r.expected, r.matched, r.reasons)
    assert r.loss_err < 1e-5 and r.grad_err < 1e-5, (r.loss_err, r.grad_err)
    assert "graph" not in r.reasons, r.reasons["graph"]  # no graph left unfused
