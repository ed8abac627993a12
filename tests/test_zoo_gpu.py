"""The harness on CUDA (``fxfuse check MODEL --device cuda --inner inductor``): every site of an
architecture fused, the loss and every gradient at fp32 parity with eager, and 20 bf16 AdamW steps
tracking eager's losses, with the fused ops running their compiled Triton kernels (on CPU they run
under the interpreter). One model per pattern family: Llama (all four), Gemma 2 (Gemma's (1 + w)
norm, GELU-tanh gate, softcapped loss head), Mamba (a gated norm mixer around a selective scan),
Qwen2-VL (vision tower plus language model, 3-D RoPE); Qwen3.5 (linear attention's q / k L2 norms as
RMSNorm calls with a constant weight) and Dory (nGPT L2 norms, a learned logit scale folded into the
lm_head), where the installed transformers has them (5.25 has both)."""
import pytest
import torch

from fxfuse.zoo import check_hf, summary

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mamba", "qwen2_vl", "qwen3_5_text", "dory"])
def test_zoo_model_on_cuda_with_inductor(model_type):
    import transformers

    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if model_type == "qwen3_5_text" and version < (5, 25):  # checked on CPU with 5.17 and 5.24
        pytest.skip(f"transformers {transformers.__version__}: plain backend='aot_eager' already fails on "
                    "qwen3_5_text's backward (a view error), no fxfuse involved; 5.25 compiles it")
    torch._dynamo.reset()
    r = check_hf(model_type, inner="inductor", device="cuda")
    assert r.passed, summary(r)
