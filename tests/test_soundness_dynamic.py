"""Every soundness case compiled with dynamic=True (aot_eager, the Triton kernels under the
interpreter): every size a symbol, the head dim and hidden size of these plain functions too. Output
and every gradient within 1e-5 of eager's, and a case that must not fuse does not. A case that fuses
with static shapes may stay unfused here: a spelling whose sizes enter the math (a rotation's halves
x[..., :D // 2], a sum divided by D) needs D's value, which a model's weights fix and a plain
function's symbolic input does not (README, Limits)."""
from __future__ import annotations

import pytest

from soundness import all_cases, run

CASES = all_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_soundness_with_symbolic_sizes(case):
    verdict = run(case, dynamic=True)
    assert not verdict.problems(case, must_fuse=False), (case.name, verdict)
