"""``fxfuse audit`` with the inputs a training collator passes: an all-ones or right-padded
attention_mask, steps of several sequence lengths, dynamic=True; and the backend's report bookkeeping
those runs depend on (one report per compiled graph, the latest compile of each frame per step)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fxfuse.audit_data import Batches
from fxfuse.audit_worker import build_model


def test_batches_attention_mask_and_lengths():
    """--attention-mask / --seq-lengths: the same seeded batches in every mode; "ones" leaves the
    tokens as they are, "padded" right-pads each row after a length in [seq/2, seq] (pad id 0, label
    -100 exactly where the mask is 0); step i has length L[i % k]."""
    vocab, batch, seq = 1000, 8, 32
    plain = Batches(vocab, batch, seq, seed=3, device="cpu")(0)
    assert set(plain) == {"input_ids", "labels"}
    ones = Batches(vocab, batch, seq, seed=3, device="cpu", mask="ones")(0)
    assert torch.equal(ones["input_ids"], plain["input_ids"]) and bool((ones["attention_mask"] == 1).all())
    a = Batches(vocab, batch, seq, seed=3, device="cpu", mask="padded", seq_lengths=[32, 20])
    b = Batches(vocab, batch, seq, seed=3, device="cpu", mask="padded", seq_lengths=[32, 20])
    x, y = a(0), b(0)
    assert all(torch.equal(x[k], y[k]) for k in x)
    keep = x["attention_mask"]
    lengths = keep.sum(1)
    assert bool((lengths >= seq // 2).all()) and bool((lengths <= seq).all()) and len(set(lengths.tolist())) > 1
    assert torch.equal(keep, (torch.arange(seq) < lengths[:, None]).long())  # right padding
    assert torch.equal(x["labels"] == -100, keep == 0) and bool((x["input_ids"][keep == 0] == 0).all())
    assert torch.equal(x["labels"][keep == 1], plain["input_ids"][keep == 1])
    assert [a(i)["input_ids"].shape[1] for i in range(4)] == [32, 20, 32, 20]
    with pytest.raises(ValueError, match="mask"):
        Batches(vocab, batch, seq, seed=3, device="cpu", mask="causal")


def test_run_with_padded_mask_and_varying_lengths(tmp_path):
    """A collator's inputs: right-padded rows with their attention_mask, two sequence lengths. Every
    site fuses, the fp32 loss curve equals eager's, fxfuse's graphs with a checked mask run with the
    mask (padding is not causal) on every step, one static and one automatic-dynamic graph, each site
    counted once, and the tensors no longer written have sizes (the dynamic graph's at its example)."""
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "fxfuse", "audit", "--model", "llama", "--tiny", "--config", "num_hidden_layers=1",
           "--device", "cpu", "--dtype", "float32", "--batch", "2", "--seq", "16", "--seq-lengths", "16,12",
           "--steps", "4", "--warmup", "0", "--attention-mask", "padded", "--compare", "eager,fxfuse",
           "--fxfuse-inner", "aot_eager", "--profile-steps", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    audit = json.loads((out / "audit.json").read_text())
    assert "batch 2 x seq 16/12 by step" in audit["table"] and "attention_mask padded" in audit["table"]
    fx = audit["modes"]["fxfuse"]
    assert fx["status"] == "ok" and not fx["report"]["errors"], fx["status"]
    assert audit["divergence"]["fxfuse"]["max_rel"] < 1e-5, audit["divergence"]
    assert fx["graphs_compiled"] == 2 and fx["mask_checks"] == {"traced": 4}
    assert "fxfuse's mask-checked graph calls: 0 ran is_causal, 4 ran with the mask" in audit["table"]
    assert fx["report"]["counts"] == {"rms_norm": 3, "rope": 1, "swiglu": 1, "linear_cross_entropy": 1}
    assert all(agg["bytes_per_step"] > 0 for agg in fx["removed"].values()), fx["removed"]
    losses = [audit["modes"][m]["losses"] for m in ("eager", "fxfuse")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_dynamic_compile_reports_each_graph_once_and_runs_is_causal():
    """torch.compile(dynamic=True) with an all-ones attention_mask: Dynamo restarts the first compile
    (TensorifyScalarRestartAnalysis), which must not leave a second report of the same graph; one
    graph serves both lengths, and its checked mask picks the is_causal variant on every call."""
    from fxfuse.attention_tags import RUNS
    from fxfuse.backend import compiled_reports, running_reports

    torch._dynamo.reset()
    model = build_model("llama", {"num_hidden_layers": 1}, True, torch.float32, "cpu", seed=0)
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}, dynamic=True)
    data = Batches(model.config.vocab_size, 2, 16, seed=0, device="cpu", mask="ones", seq_lengths=[16, 12])
    n0, runs0 = len(compiled_reports()), RUNS.copy()
    for i in range(3):
        batch = data(i)
        loss = compiled(**batch).loss
        ref = model(**batch).loss
        assert torch.allclose(loss, ref, rtol=1e-5, atol=0), (loss, ref)
    reports = compiled_reports()[n0:]
    assert len(reports) == 1 and running_reports(n0) == reports
    assert reports[0].counts() == {"rms_norm": 3, "rope": 1, "swiglu": 1, "linear_cross_entropy": 1}
    assert RUNS - runs0 == {"causal": 3}


def test_running_reports_keep_the_latest_compile_of_each_frame(monkeypatch):
    """A recompile of a frame replaces its earlier graph in per-step sums; other frames stay."""
    from fxfuse import backend
    from fxfuse.report import Report

    a, b, c, d = Report(graphs=1), Report(graphs=1), Report(graphs=1), Report(graphs=1)
    monkeypatch.setattr(backend, "_REPORTS", [("0/0", a), ("1/0", b), ("0/1", c), ("", d)])
    assert backend.running_reports() == [b, c, d]
    assert backend.running_reports(2) == [c, d]
