"""Vision-language models from tiny configs, trained on a batch with an image: every RMSNorm, RoPE,
gated-MLP and loss-head call of the vision tower and the language model fused (counted at run time,
fxfuse.harness), and the loss and every gradient at fp32 parity with eager."""
import pytest
import torch

from fxfuse.zoo import check_vlm
from fxfuse.zoo_vlm import VLMS

EXPECTED = {  # sites per pattern: (vision tower, language model) summed
    "qwen2_vl": {"rms_norm": 5, "rope": 4, "swiglu": 2, "linear_cross_entropy": 1},
    "qwen2_5_vl": {"rms_norm": 10, "rope": 4, "swiglu": 4, "linear_cross_entropy": 1},
    "qwen3_vl": {"rms_norm": 9, "rope": 4, "swiglu": 2, "linear_cross_entropy": 1},
    "qwen3_5": {"rms_norm": 10, "rope": 3, "swiglu": 3, "linear_cross_entropy": 1},  # 2 q / k L2 norms
    "glm4v": {"rms_norm": 15, "rope": 4, "swiglu": 5, "linear_cross_entropy": 1},
    "qwen3_vl_moe": {"rms_norm": 9, "rope": 4, "swiglu": 2, "linear_cross_entropy": 1},
    "glm4v_moe": {"rms_norm": 11, "rope": 4, "swiglu": 6, "linear_cross_entropy": 1},
    "llava": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "gemma3": {"rms_norm": 14, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "mistral3": {"rms_norm": 11, "rope": 4, "swiglu": 4, "linear_cross_entropy": 1},
    "paligemma": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "smolvlm": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "llama4": {"rms_norm": 9, "rope": 4, "swiglu": 4, "linear_cross_entropy": 1},
    "internvl": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "aya_vision": {"rms_norm": 0, "rope": 2, "swiglu": 3, "linear_cross_entropy": 1},  # its projector's SwiGLU
    "idefics3": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "lfm2_vl": {"rms_norm": 9, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "cohere2_vision": {"rms_norm": 0, "rope": 2, "swiglu": 3, "linear_cross_entropy": 1},  # Aya Vision's projector
    "vipllava": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "qwen3_5_moe": {"rms_norm": 10, "rope": 3, "swiglu": 5, "linear_cross_entropy": 1},
    "glm46v": {"rms_norm": 15, "rope": 4, "swiglu": 5, "linear_cross_entropy": 1},
    "llava_next": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "llava_onevision": {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1},
    "exaone4_5": {"rms_norm": 14, "rope": 4, "swiglu": 4, "linear_cross_entropy": 1},
    "lfm3_vl": {"rms_norm": 18, "rope": 2, "swiglu": 4, "linear_cross_entropy": 1},
    "mllama": {"rms_norm": 7, "rope": 1, "swiglu": 2, "linear_cross_entropy": 1},  # cross-attention: no rotary
}
# Graphs no backend compiles, which Dynamo then runs eagerly; they hold no site. AOTAutograd cannot
# trace Qwen3-VL's (and Qwen3-VL-MoE's) DeepStack add, ``h[mask, :] = h[mask, :] + v`` (the backward
# of a boolean-mask index_put needs a data-dependent nonzero), nor Mistral 3's patch merger, which
# views the image features by sizes read from a tensor (``.item()``); plain aot_eager fails on both
# the same way.
NO_BACKEND = {"qwen3_vl": "nonzero", "qwen3_vl_moe": "nonzero", "mistral3": "_local_scalar_dense"}


@pytest.mark.parametrize("model_type", VLMS)
def test_vlm_with_an_image_is_fused_with_parity(model_type):
    torch._dynamo.reset()  # the models share transformers' functions: keep each below Dynamo's recompile limit
    r = check_vlm(model_type, bf16_steps=0)
    assert r.expected == EXPECTED[model_type] and r.matched == r.expected, (r.expected, r.matched, r.reasons)
    assert r.loss_err < 1e-5 and r.grad_err < 1e-5, (r.loss_err, r.grad_err)
    unfused = [e for e in r.reasons.get("graph", []) if not (model_type in NO_BACKEND and NO_BACKEND[model_type] in e)]
    assert not unfused, unfused


def test_check_cli_builds_a_vlm_with_an_image(capsys):
    """``fxfuse check llava``: the vision-language model with its image batch, not a causal LM."""
    from fxfuse.cli import main

    torch._dynamo.reset()
    assert main(["check", "llava", "--no-train"]) == 0
    assert "llava: rms_norm 5/5, rope 2/2, swiglu 2/2, linear_cross_entropy 1/1" in capsys.readouterr().out
