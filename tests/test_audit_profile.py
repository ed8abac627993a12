"""``fxfuse audit``'s attribution pieces: the profiler rule that assigns kernels and ops to patterns
and the allocator-trace replay of --memory-peak (profiler events and traces faked: no GPU here)."""
from __future__ import annotations

import pytest

from fxfuse.audit_profile import category, tensor_bytes


def test_attribution_rule():
    cases = {
        "aten::pow": "rms_norm", "aten::rsqrt": "rms_norm", "fxfuse::rms_norm_backward": "rms_norm",
        "triton_per_fused_add_mean_mul_pow_rsqrt_0": "rms_norm", "_rms_norm_forward_kernel": "rms_norm",
        "aten::silu_backward": "swiglu", "_swiglu_fwd_kernel": "swiglu", "triton_poi_fused_mul_silu_1": "swiglu",
        "fxfuse::rope_bwd": "rope", "aten::neg": "rope", "_triton_rope": "rope",
        "aten::_log_softmax": "linear_cross_entropy", "aten::nll_loss_forward": "linear_cross_entropy",
        "_lce_fwd_chunk_kernel": "linear_cross_entropy", "liger_cross_entropy_kernel": "linear_cross_entropy",
        "aten::mm": None, "aten::mul": None, "aten::_softmax": None, "aten::_foreach_pow": None,
        "Optimizer.step#AdamW.step": None, "aten::scaled_dot_product_attention": None,
    }
    assert {n: category(n) for n in cases} == cases


def test_tensor_bytes():
    assert tensor_bytes("mul_3:float32[2, 9, 32]") == ("mul_3", "float32", [2, 9, 32], 2304)
    assert tensor_bytes("log_softmax (in cross_entropy):bfloat16[18, 96]")[::3] == (
        "log_softmax (in cross_entropy)", 18 * 96 * 2)
    assert tensor_bytes("x:float32[s0, 32]")[3] is None


def test_attribution_of_gpu_kernels():
    """CUDA branch (no GPU here: profiler events faked): a kernel counts for its own name's pattern,
    else for its launching op's; the total is all device time."""
    from types import SimpleNamespace as NS

    from torch.autograd import DeviceType

    from fxfuse.audit_profile import attribute

    def cpu(name, kernels, parent=None):
        return NS(name=name, device_type=DeviceType.CPU, is_async=False, is_legacy=False, cpu_parent=parent,
                  kernels=[NS(name=k, duration=us) for k, us in kernels])

    def gpu(name, start, us):
        return NS(name=name, device_type=DeviceType.CUDA, is_async=False, device_index=0,
                  time_range=NS(start=start, end=start + us))

    step = cpu("ProfilerStep#0", [])
    events = [step, cpu("fxfuse::rms_norm", [("_rms_norm_fwd_kernel", 40), ("vectorized_copy", 30)], step),
              cpu("aten::mm", [("sm90_gemm", 100)], step),
              gpu("_rms_norm_fwd_kernel", 0, 40), gpu("vectorized_copy", 40, 30), gpu("sm90_gemm", 70, 100)]
    per_pattern, per_name, total, parts = attribute(events, cuda=True)
    assert per_pattern.keys() == {"rms_norm"} and per_pattern["rms_norm"] == pytest.approx(0.07)
    assert total == pytest.approx(0.17) and per_name["sm90_gemm"] == pytest.approx(0.1)
    assert parts.keys() == {"rms_norm"}
    assert parts["rms_norm"] == {"_rms_norm_fwd_kernel": [pytest.approx(0.04), 1],
                                 "vectorized_copy (in fxfuse::rms_norm)": [pytest.approx(0.03), 1]}

    # A dependent launch (the dw reduction under PDL) starts 2 us into the row backward's 38 us and
    # ends 2 us after it: 2 us of its own, not 38; the total is the 40 us the device was busy.
    # The dw kernel's name has no pattern word: it counts for fxfuse::rms_norm_backward, which launched it.
    pdl = [step, cpu("fxfuse::rms_norm_backward", [("_rms_norm_bwd_kernel", 38), ("_dw_reduce_kernel", 38)], step),
           gpu("_rms_norm_bwd_kernel", 200, 38), gpu("_dw_reduce_kernel", 202, 38)]
    per_pattern, per_name, total, parts = attribute(pdl, cuda=True)
    assert per_name["_dw_reduce_kernel"] == pytest.approx(0.002) and total == pytest.approx(0.04)
    assert per_pattern["rms_norm"] == pytest.approx(0.04)
    assert parts["rms_norm"]["_dw_reduce_kernel (in fxfuse::rms_norm_backward)"] == [pytest.approx(0.002), 1]

    # The GPU-side span of a record_function range (the profiler's gpu_user_annotation, here one
    # starting before the kernels it covers) is no work of its own: the kernels keep their time.
    note = gpu("Optimizer.step#AdamW.step", -5, 200)
    note.is_user_annotation = True
    per_pattern, per_name, total, _ = attribute(events + [note], cuda=True)
    assert "Optimizer.step#AdamW.step" not in per_name and total == pytest.approx(0.17)
    assert per_pattern["rms_norm"] == pytest.approx(0.07)


def test_memory_peak_replays_the_allocator_trace():
    """peak_blocks finds the peak of live bytes and groups what is alive there by source line."""
    from fxfuse.audit_memory import peak_blocks, render

    model = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
             {"filename": "/m/modeling_llama.py", "line": 42, "name": "forward"}]
    kernel = [{"filename": "/s/fxfuse/kernels/rms_norm.py", "line": 7, "name": "_fwd"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100 << 20, "frames": model},
        {"action": "alloc", "addr": 2, "size": 50 << 20, "frames": kernel},
        {"action": "alloc", "addr": 3, "size": 30 << 20, "frames": model},  # peak: 180 MiB
        {"action": "free_requested", "addr": 2, "size": 50 << 20},
        {"action": "free_completed", "addr": 2, "size": 50 << 20},
        {"action": "alloc", "addr": 4, "size": 20 << 20, "frames": kernel},  # 150 MiB: not the peak
        {"action": "free_requested", "addr": 1, "size": 100 << 20},
    ]
    peak = peak_blocks(trace)
    assert peak["peak_mib"] == 180
    assert peak["lines"] == [{"where": "modeling_llama.py:42 forward", "mib": 130.0, "blocks": 2},
                             {"where": "rms_norm.py:7 _fwd", "mib": 50.0, "blocks": 1}]
    text = "\n".join(render("fxfuse", peak))
    assert "180 MiB" in text and "modeling_llama.py:42" in text
