"""``fxfuse audit``'s loss-curve yardsticks (fxfuse/audit_compare.py): the difference between modes,
eager's own spread (mode eager-rerun), eager with an fp32 loss head (mode eager-fp32-head) and an
earlier run's curve at another precision (--reference)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fxfuse.audit_worker as worker
from fxfuse.audit_compare import divergence, pairwise_divergence, render_lines
from fxfuse.audit_worker import build_model


def test_pairwise_divergence_between_non_eager_modes():
    results = {"eager": {"losses": [1.0, 2.0]}, "inductor": {"losses": [1.1, 2.0]},
               "liger": {"status": "not installed"}, "fxfuse": {"losses": [1.1, 2.3]}}
    assert pairwise_divergence(results) == pytest.approx({"inductor vs fxfuse": 0.3})


def test_eager_rerun_and_reference_compare_the_curves(tmp_path):
    """mode eager-rerun trains eager again (its spread is the noise floor of "within X of eager"; on
    CPU eager repeats bit for bit); --reference compares every curve of a bf16-autocast run to the
    eager curve of an fp32 run of the same model, data and optimizer; a reference from another run
    (other seed) is refused before anything trains, naming the key."""
    base = [sys.executable, "-m", "fxfuse", "audit", "--model", "llama", "--tiny", "--config", "num_hidden_layers=1",
            "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "0",
            "--fxfuse-inner", "aot_eager", "--profile-steps", "0"]
    ref_out, out = tmp_path / "fp32", tmp_path / "amp"
    proc = subprocess.run(base + ["--compare", "eager,eager-rerun", "--out", str(ref_out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ref = json.loads((ref_out / "audit.json").read_text())
    assert ref["divergence"]["eager-rerun"]["max_abs"] == 0.0
    assert "eager's own run-to-run spread (eager-rerun vs eager): max |dloss| 0.00e+00" in ref["table"]

    proc = subprocess.run(base + ["--compare", "eager,fxfuse", "--autocast", "bfloat16", "--reference",
                                  str(ref_out / "audit.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    audit = json.loads((out / "audit.json").read_text())
    div = audit["reference"]["divergence"]
    assert set(div) == {"eager", "fxfuse"} and audit["reference"]["dtype"] == "float32"
    assert 0 < div["eager"]["max_abs"] < 0.1  # bf16 autocast vs fp32: rounding, not a different run
    assert div["fxfuse"]["max_abs"] < 0.1
    assert "vs the reference (float32 eager" in audit["table"]

    proc = subprocess.run(base + ["--compare", "eager", "--seed", "1", "--reference", str(ref_out / "audit.json"),
                                  "--out", str(tmp_path / "other")], capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "seed=0 there, 1 here" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "other").exists()


def test_render_lines_name_the_modes_within_eagers_spread():
    results = {"eager": {"losses": [2.0, 1.0]}, "eager-rerun": {"losses": [2.0, 1.02]},
               "inductor": {"losses": [2.01, 1.0]}, "fxfuse": {"losses": [2.0, 1.05]}}
    audit = {"divergence": divergence(results), "pairwise": pairwise_divergence(results)}
    assert audit["divergence"]["fxfuse"] == pytest.approx(
        {"max_abs": 0.05, "max_rel": 0.05, "at_step": 2, "last_abs": 0.05, "steps": 2})
    assert list(audit["pairwise"]) == ["inductor vs fxfuse"]  # eager-rerun is eager, not a compared mode
    lines = render_lines(audit)
    assert lines[1] == ("eager's own run-to-run spread (eager-rerun vs eager): max |dloss| 2.00e-02 (step 2); "
                        "modes within it: inductor")


def test_eager_fp32_head_runs_the_logit_ops_in_fp32():
    """mode eager-fp32-head: eager with the lm_head output upcast, so Gemma 2's softcap runs in fp32
    on the bf16 matmul output (the numerics of the fused heads), not rounded to bf16 after each op."""
    model = build_model("gemma2", {}, True, torch.bfloat16, "cpu", seed=0)
    call = worker.prepare("eager-fp32-head", model, {})
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    out = call(input_ids=ids, labels=ids, output_hidden_states=True)
    c = model.config.final_logit_softcapping
    expected = torch.tanh(model.lm_head(out.hidden_states[-1]).float() / c) * c
    assert out.logits.dtype == torch.float32 and torch.equal(out.logits, expected)
    eager = worker.prepare("eager", build_model("gemma2", {}, True, torch.bfloat16, "cpu", seed=0), {})
    assert eager(input_ids=ids, labels=ids).logits.dtype == torch.bfloat16
    headless = type("Headless", (), {"get_output_embeddings": lambda self: None})()
    with pytest.raises(worker.ModeUnavailable, match="no lm_head"):
        worker.prepare("eager-fp32-head", headless, {})
