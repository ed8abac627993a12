"""Every soundness case (tests/soundness_*.py): compiled with fxfuse (aot_eager, fp32, the Triton
kernels under the interpreter), output and every gradient within 1e-5 of eager's, and fused or not
as the case says. A look-alike that fuses into another function fails here on its value."""
from __future__ import annotations

import pytest

from soundness import ROUND_TRIPS, all_cases, postgrad_cases, run

CASES = all_cases()
POSTGRAD = postgrad_cases()


def test_case_names_are_unique():
    names = [c.name for c in CASES + POSTGRAD]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_soundness(case):
    verdict = run(case)
    assert not verdict.problems(case), (case.name, verdict)


@pytest.mark.parametrize("case", POSTGRAD, ids=[c.name for c in POSTGRAD])
def test_postgrad_soundness_under_inductor(case, monkeypatch, tmp_path):
    """The backward rewrites that run only under Inductor (residual-add and dy-sum folds, gated-MLP
    gradients written in place, the fast head's scaled gradients); a fresh cache folder, as a cache
    hit would skip the post-grad pass."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    verdict = run(case, inner="inductor")
    assert not verdict.problems(case), (case.name, verdict)


def test_a_wrong_fused_op_is_caught(monkeypatch):
    """The check itself: an RMSNorm lowered with eps * 4 (a plausible slip) fails on its value, as
    awkward()'s small rows put mean(x^2) near eps."""
    import dataclasses

    from fxfuse.patterns import rms_norm

    def lower_eps_times_4(m, graph, opts):
        node = rms_norm.lower(m, graph, opts)
        node.args = (*node.args[:2], node.args[2] * 4, *node.args[3:])
        return node

    case = next(c for c in CASES if c.name == "rms_norm/llama")
    assert not run(case).problems(case)
    monkeypatch.setattr(rms_norm, "PATTERN", dataclasses.replace(rms_norm.PATTERN, lower=lower_eps_times_4))
    verdict = run(case)
    assert verdict.fused == 1 and verdict.out_err > 1e-3 and verdict.problems(case)


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_inductor_keeps_bf16_round_trips_in_fp32_unless_told(name):
    """The CUDA twin's exception, shown on CPU: plain Inductor misses eager's value on these cases (a
    bf16 round trip kept in fp32) and keeps it when told to round as eager does (precise_casts); fxfuse
    under Inductor so told keeps it too, fused where the case fuses."""
    case = next(c for c in CASES if c.name == name)
    assert run(case, backend="inductor").value_problems()
    assert not run(case, backend="inductor", precise_casts=True).value_problems()
    assert not run(case, inner="inductor", precise_casts=True).problems(case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + POSTGRAD, ids=[c.name for c in CASES + POSTGRAD])
def test_soundness_on_cuda_under_inductor(case):
    """The same on CUDA, the kernels compiled by Triton and the rest by Inductor. Inductor's own numerics
    may miss eager's value where a bf16 round trip is kept in fp32 (on the H100, torch 2.11:
    linear_cross_entropy/through_bf16 unfused, 5e-4 / 1.2e-2; rms_norm/rounded_to_bf16 and
    rope/mixed_dtype_q_fp32_k_bf16 fused, ~2e-3; plain Inductor missed all three too). Such a miss
    passes only where plain Inductor misses eager's value too and fxfuse keeps it once Inductor rounds
    as eager does (run(precise_casts=True); with emulate_precision_casts alone the three stayed as far
    off on that H100, and bench/probe_round_trips.py has not yet run there). Whether a case fuses is
    checked either way."""
    verdict = run(case, inner="inductor", device="cuda")
    problems = verdict.problems(case)
    assert problems == verdict.value_problems(), (case.name, verdict)
    if not problems:
        return
    plain = run(case, device="cuda", backend="inductor")
    assert plain.value_problems(), (case.name, verdict, "plain Inductor keeps eager's value", plain)
    precise = run(case, inner="inductor", device="cuda", precise_casts=True)
    assert precise.fused == verdict.fused and not precise.problems(case), (case.name, verdict, precise)
