"""The harness's bf16 training check (fxfuse/harness.py): where fxfuse's 20-step bf16 autocast loss
curve parts from eager's by BF16_TOL or more, both bf16 curves are judged against an fp32 run's
curve, and fxfuse passes if it is at most BF16_MULTIPLIER x as far from it as eager is."""
from __future__ import annotations

import re

import pytest
import torch

import fxfuse.harness as harness
from fxfuse.harness import BF16_MULTIPLIER, BF16_TOL, check, curve_gap, fp32_curve_verdict
from fxfuse.zoo import summary
from tests.helpers import batch
from tests.models import TitanLM

EXACT = [2.0, 1.8, 1.5, 1.2]


def _off(curve, rel):
    return [v * (1 + rel) for v in curve]


def test_curve_gap_is_the_largest_step_difference():
    assert curve_gap([1.0, 2.2, 3.0], [1.0, 2.0, 3.3]) == pytest.approx(0.1)
    assert curve_gap(EXACT, EXACT) == 0.0


@pytest.mark.parametrize("mine,ok", [(0.5e-2, True), (2e-2, True), (2 * BF16_MULTIPLIER * 1e-2, False)])
def test_verdict_compares_the_distances_to_the_fp32_curve(mine, ok):
    eager = 1e-2  # eager's bf16 curve this far from the fp32 one
    got_ok, line = fp32_curve_verdict(_off(EXACT, mine), _off(EXACT, eager), EXACT)
    assert got_ok is ok
    assert line == (f"against an fp32 run's curve: fxfuse bf16 {mine:.2e}, eager bf16 {eager:.2e} -> "
                    + ("as close as eager" if ok else "FURTHER THAN EAGER"))


def _titan():
    torch.manual_seed(0)
    return TitanLM()


@pytest.mark.parametrize("multiplier", [BF16_MULTIPLIER, 0.0])
def test_check_runs_the_fp32_verdict_where_the_curves_part(monkeypatch, multiplier):
    """BF16_TOL at 0 makes every pair of curves 'part': the verdict runs on a real fp32 training run;
    with a multiplier of 0 no bf16 curve can pass it, so the result must say FURTHER THAN EAGER."""
    monkeypatch.setattr(harness, "BF16_TOL", 0.0)
    monkeypatch.setattr(harness, "BF16_MULTIPLIER", multiplier)
    r = check("titan", _titan, batch(), loss_of=lambda out: out, bf16_steps=4)
    assert r.bf16_max_rel is not None and r.bf16_max_rel > 0
    assert r.bf16_fp32.startswith("against an fp32 run's curve: fxfuse bf16 ")
    mine, eager = map(float, re.findall(r"bf16 ([-+.e0-9]+)", r.bf16_fp32))
    assert mine > 0 and eager > 0  # the fp32 curve is a run of its own, not one of the bf16 curves
    assert r.bf16_ok is r.bf16_fp32_ok is (multiplier > 0) and r.passed is (multiplier > 0)
    text = summary(r)
    assert f"    judged {r.bf16_fp32}" in text
    assert text.endswith("PASS") if multiplier else text.endswith("NOT PASSED: bf16")


def test_no_verdict_where_the_curves_stay_within_the_bound():
    r = check("titan", _titan, batch(), loss_of=lambda out: out, bf16_steps=4)
    assert r.bf16_max_rel < BF16_TOL and r.bf16_fp32 == "" and r.bf16_ok and r.passed
