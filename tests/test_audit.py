"""``fxfuse audit``: the real command on a tiny Llama (eager vs fxfuse, each in its own process), plus the
pieces that decide its numbers: the largest-batch search (in one process, dynamic batch, OOMs
simulated), --fxfuse-option, the profiler attribution rule, the removed tensors' sizes, the progress
bar and the worker's failure paths."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest
import torch

import fxfuse.audit_worker as worker
from fxfuse.audit import _kv, run_worker, search_largest
from fxfuse.audit_data import Batches
from fxfuse.audit_plot import Progress
from fxfuse.audit_fit import fit_batch
from fxfuse.audit_worker import build_model
from helpers import count_calls, is_rms_norm, load_script

SEQ, BATCH, STEPS = 16, 2, 3


def test_audit_command_eager_vs_fxfuse(tmp_path):
    """The CLI end to end on CPU: table on stdout, JSON, PNG; same losses, fxfuse's report and removed
    tensors present, target ops found by the profiler in both modes."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(3, 512, size=4 * BATCH * SEQ).astype(np.uint16))
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "fxfuse", "audit", "--model", "llama", "--tiny", "--batch", str(BATCH),
           "--seq", str(SEQ), "--steps", str(STEPS), "--warmup", "1", "--compare", "eager,fxfuse",
           "--fxfuse-inner", "aot_eager", "--fit", "none", "--profile-steps", "1", "--tokens", str(tokens),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    audit = json.loads((out / "audit.json").read_text())
    eager, fx = audit["modes"]["eager"], audit["modes"]["fxfuse"]
    assert eager["status"] == "ok" and fx["status"] == "ok"
    assert len(eager["losses"]) == len(fx["losses"]) == STEPS
    assert eager["losses"][0] != eager["losses"][-1], "the optimizer did not change the model"
    assert audit["divergence"]["fxfuse"]["max_rel"] < 1e-5  # fp32: same data, init, optimizer
    assert audit["divergence"]["eager"]["max_abs"] == 0.0
    for r in (eager, fx):
        assert r["step_time_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_allocated_mib"] > 50
        assert len(r["mem_curve_mib"]) == STEPS and r["peak_reserved_mib"] is None  # CPU: RSS only
        assert 0 < r["profile"]["target_share"] <= 1
        parts = r["profile"]["pattern_parts"]["rms_norm"]  # what the rms_norm time is made of
        assert sum(p["ms"] for p in parts) <= r["profile"]["ms"]["rms_norm"] + 1e-9 and parts[0]["calls"] > 0
    assert any(p["name"] == "fxfuse::rms_norm" for p in fx["profile"]["pattern_parts"]["rms_norm"])
    assert "    rms_norm: " in proc.stdout
    assert eager["report"] is None

    model = build_model("llama", {}, True, torch.float32, "cpu", seed=0)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    n_norms = count_calls(model, is_rms_norm, input_ids=ids, labels=ids)
    assert fx["report"]["counts"]["rms_norm"] == n_norms
    removed = fx["removed"]
    assert set(removed) - {"causal_attention"} == {p for p, n in fx["report"]["counts"].items() if n}
    sizes = [agg["bytes_per_step"] for agg in removed.values()]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] > 0
    rms = removed["rms_norm"]
    assert rms["sites"] == n_norms and rms["tensors"][0]["bytes"] >= rms["tensors"][-1]["bytes"] > 0
    assert rms["tensors"][0]["shape"][:2] == [BATCH, SEQ]
    # option recompute (default): every fused norm's fp32 [BATCH, SEQ, hidden] output is not kept
    assert rms["recomputed_bytes_per_step"] == n_norms * BATCH * SEQ * model.config.hidden_size * 4

    table = proc.stdout
    assert audit["table"] in table and "peak RSS" in table
    assert "tensors no longer written" in table and "rms_norm" in table
    assert "recomputed in backward, not kept" in table
    assert (out / "audit.png").read_bytes()[:4] == b"\x89PNG"
    assert "fxfuse [" in proc.stderr and f"{STEPS}/{STEPS}" in proc.stderr  # progress bar


def test_search_largest_doubles_then_bisects():
    fits = lambda n: n <= 37  # noqa: E731
    best, trials = search_largest(fits, cap=256)
    assert best == 37
    assert [n for n, _ in trials[:7]] == [1, 2, 4, 8, 16, 32, 64]
    assert len(trials) <= 7 + 5  # bisection between 32 and 64
    assert search_largest(fits, cap=20)[0] == 20  # cap reached, no failure
    assert search_largest(lambda n: False, cap=8) == (0, [(1, False)])
    best, trials = search_largest(fits, cap=256, start=8)  # from the run's batch: fewer probes
    assert best == 37 and [n for n, _ in trials[:4]] == [8, 16, 32, 64] and len(trials) <= 4 + 5
    best, trials = search_largest(fits, cap=256, start=50)  # the start does not fit: bisection below it
    assert best == 37 and trials[0] == (50, False) and len(trials) <= 1 + 6
    assert search_largest(fits, cap=20, start=64) == (20, [(20, True)])  # start clamped to the cap
    assert search_largest(fits, cap=0, start=4) == (0, [])


def _fit_spec(**kw) -> dict:
    return dict(job="fit_batch", mode="eager", model="llama", config={"num_hidden_layers": 1}, tiny=True,
                dtype="float32", device="cpu", batch=2, seq=8, steps=2, warmup=0, lr=1e-3, seed=0, tokens=None,
                profile_steps=0, fxfuse_inner="aot_eager", fxfuse_options={}, mem_limit_gib=None,
                max_batch_search=8) | kw


def test_fit_batch_in_one_process_frees_a_failed_probe_and_never_recompiles(monkeypatch):
    """fit_batch on the compiled fxfuse mode, OOM simulated above batch 5 (raised mid-step, activations
    alive as at a real OOM): the search starts at --batch, ends at 5, the failed probes' tensors are
    gone before the next probe, and no probe after the first compiles a graph (dynamic batch)."""
    real_step, refs, alive = worker.train_step, [], []

    def step(call, opt, batch):
        alive.append(sum(r() is not None for r in refs))
        if batch["input_ids"].shape[0] > 5:
            loss = call(**batch).loss
            refs.append(weakref.ref(loss))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real_step(call, opt, batch)

    monkeypatch.setattr(worker, "train_step", step)
    partial = []
    r = fit_batch(_fit_spec(mode="fxfuse"), progress=lambda p: partial.append(len(p["probes"])))
    assert r["status"] == "ok" and r["largest"] == 5
    assert [(p["batch"], p["fits"]) for p in r["probes"]] == [(2, True), (4, True), (8, False), (6, False),
                                                              (5, True)]
    assert "OutOfMemoryError" in r["probes"][2]["reason"] and "reason" not in r["probes"][0]
    assert refs and max(alive) == 0  # each failed probe's graph and activations freed before the next step
    graphs = [p["graphs"] for p in r["probes"]]
    assert graphs[0] >= 1 and graphs == [graphs[0]] * len(graphs), graphs  # compiled once, for every batch
    assert partial == [1, 2, 3, 4, 5]  # the result so far after every probe (a killed worker keeps it)
    assert r["report"]["counts"]["rms_norm"] == 3  # the dynamic-batch graph still fuses


def test_fit_batch_static_shapes_compiles_per_batch():
    """--fit-shapes static: one graph per probed batch, as the run compiles it (the causal-attention
    rewrite, which needs static shapes, applies)."""
    r = fit_batch(_fit_spec(mode="fxfuse", fit_shapes="static", max_batch_search=4))
    assert r["largest"] == 4 and r["dynamic_batch"] is False
    graphs = [p["graphs"] for p in r["probes"]]
    assert graphs[1] == graphs[0] + 1
    assert r["report"]["attention"] and all(not a["reason"] for a in r["report"]["attention"])


def test_fit_batch_real_error_is_an_error(monkeypatch, tmp_path):
    """A non-OOM error in a probe ends the search as an error (not "does not fit"), probes so far kept."""
    real_step = worker.train_step

    def step(call, opt, batch):
        if batch["input_ids"].shape[0] > 2:
            raise RuntimeError("boom")
        return real_step(call, opt, batch)

    monkeypatch.setattr(worker, "train_step", step)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps(_fit_spec()))
    assert worker.main([str(spec), str(out)]) == 1
    r = json.loads(out.read_text())
    assert r["status"] == "error: RuntimeError: boom"
    assert [(p["batch"], p["fits"]) for p in r["probes"]] == [(2, True)]


def test_kv_parses_python_literals():
    assert _kv("causal_attention=False") == ("causal_attention", False)
    assert _kv("loss_head=fast") == ("loss_head", "fast")
    assert _kv("num_hidden_layers=4") == ("num_hidden_layers", 4)
    assert _kv("patterns=('rms_norm', 'rope')") == ("patterns", ("rms_norm", "rope"))
    assert _kv("tie_word_embeddings=true") == ("tie_word_embeddings", True)  # JSON still reads
    assert _kv("rope_scaling={\"type\": \"linear\", \"factor\": 2.0}")[1] == {"type": "linear", "factor": 2.0}
    with pytest.raises(Exception, match="KEY=VALUE"):
        _kv("loss_head")


def test_fxfuse_option_end_to_end(tmp_path):
    """--fxfuse-option reaches the backend (causal_attention=False: no attention rewrite in the report),
    is recorded in audit.json and shown in the table header and bench/e2e.py's markdown; --fit batch
    runs the one-process search (no OOM on CPU: up to the cap, compiled once)."""
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "fxfuse", "audit", "--model", "llama", "--tiny", "--config", "num_hidden_layers=1",
           "--batch", str(BATCH), "--seq", str(SEQ), "--steps", "2", "--warmup", "0", "--compare", "fxfuse",
           "--fxfuse-inner", "aot_eager", "--fxfuse-option", "loss_head=fast",
           "--fxfuse-option", "causal_attention=False", "--fit", "batch", "--max-batch-search", "4",
           "--profile-steps", "0", "--cold-compile", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    audit = json.loads((out / "audit.json").read_text())
    fx = audit["modes"]["fxfuse"]
    assert fx["status"] == "ok" and fx["report"]["attention"] == []
    assert audit["args"]["fxfuse_options"] == {"loss_head": "fast", "causal_attention": False}
    assert "fxfuse options: inner=aot_eager, logits=skip, loss_head=fast, causal_attention=False" in proc.stdout
    fit = audit["fit"]["fxfuse"]["batch"]
    assert fit["status"] == "ok" and fit["largest"] == 4 and fit["trials"] == [[BATCH, True], [4, True]]
    assert len({p["graphs"] for p in fit["probes"]}) == 1

    e2e = load_script("bench", "e2e")
    assert "fxfuse options: inner=aot_eager, logits=skip, loss_head=fast" in e2e.markdown(audit).splitlines()[0]
    assert "uniform synthetic tokens, AdamW lr 0.0003" in e2e.markdown(audit).splitlines()[0]
    audit["pairwise"] = {"inductor vs fxfuse": 0.25}
    assert "max |dloss| between modes: inductor vs fxfuse 2.50e-01" in e2e.markdown(audit)
    # the first step (compile included) is a column of both tables; --cold-compile is said in the header
    assert "1st step: the first training step, compile included (empty compile caches per mode)" in proc.stdout
    first = f"{fx['step_times_s'][0]:.1f}"
    assert f"| fxfuse | {first} | {fx['step_time_ms']:.1f} |" in e2e.markdown(audit)
    table = [line for line in e2e.markdown(audit).splitlines() if line.startswith("|")]
    assert len(table) == 3 and len({line.count("|") for line in table}) == 1, table  # header, rule, fxfuse


def test_cold_compile_gives_each_worker_empty_caches(monkeypatch):
    """--cold-compile: the worker process gets its own empty Inductor and Triton cache folders."""
    import fxfuse.audit as audit

    seen = []

    def fake_run(cmd, timeout=None, stdout=None, env=None):
        seen.append(env)
        with open(cmd[-1], "w") as f:
            json.dump({"mode": "eager", "status": "ok"}, f)
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(audit.subprocess, "run", fake_run)
    assert run_worker({"mode": "eager"}, cold=True)["status"] == "ok"
    assert run_worker({"mode": "eager"})["status"] == "ok"
    cold, warm = seen
    assert warm is None and cold["TORCHINDUCTOR_CACHE_DIR"] != cold["TRITON_CACHE_DIR"]
    assert os.path.basename(os.path.dirname(cold["TRITON_CACHE_DIR"])).startswith("fxfuse_audit_")


def test_bad_fxfuse_option_is_the_fxfuse_rows_error():
    spec = dict(_fit_spec(), job="run", mode="fxfuse", batch=1, seq=4, steps=1, fxfuse_options={"nosuch": 1})
    r = run_worker(spec)
    assert r["status"].startswith("error:") and "unknown option(s) ['nosuch']" in r["status"]


def test_fit_worker_and_dead_worker():
    spec = dict(job="fit", mode="eager", model="llama", config={"num_hidden_layers": 1}, tiny=True,
                dtype="float32", device="cpu", batch=2, seq=8, steps=2, warmup=0, lr=1e-3, seed=0, tokens=None,
                profile_steps=0, fxfuse_inner="aot_eager", mem_limit_gib=None)
    assert run_worker(spec)["fits"] is True
    dead = run_worker(spec, timeout=0.01)  # killed before it writes: the parent survives, "does not fit"
    assert dead["fits"] is False and "died" in dead["reason"]
    r = run_worker(_fit_spec(max_batch_search=3))  # the batch search: one process
    assert r["status"] == "ok" and r["largest"] == 3 and [p["batch"] for p in r["probes"]] == [2, 3]
    dead = run_worker(_fit_spec(), timeout=0.01)
    assert "died" in dead["status"]


def test_unknown_mode_is_reported_in_its_row():
    spec = dict(job="run", mode="nosuchmode", model="llama", config={}, tiny=True, dtype="float32",
                device="cpu", batch=1, seq=4, steps=1, warmup=0, lr=1e-3, seed=0, tokens=None, profile_steps=0,
                fxfuse_inner="aot_eager", mem_limit_gib=None)
    r = run_worker(spec)
    assert r["status"].startswith("error: ValueError") and "nosuchmode" in r["status"]


def test_progress_bar_without_terminal_prints_deciles():
    buf = io.StringIO()
    bar = Progress(200, "fxfuse", stream=buf)
    for i in range(1, 201):
        bar.update(i, "note")
    lines = buf.getvalue().splitlines()
    assert 10 <= len(lines) <= 11 and lines[-1].startswith("fxfuse [" + "#" * 28 + "] 200/200")
    assert "\r" not in buf.getvalue()


def test_mem_limit_device_index():
    from fxfuse.audit_worker import device_index

    assert device_index("cuda", lambda: 3) == 3
    assert device_index("cuda:1", lambda: 3) == 1


def test_zipf_tokens_are_seeded_skewed_and_in_range():
    """--synthetic zipf: the same batches in every mode (seeded), token frequencies ~ 1/rank (the top
    token ~ 1/H(V) of all tokens, not 1/V), every id a valid token; uniform stays uniform."""
    vocab, batch, seq = 1000, 4, 512
    a = Batches(vocab, batch, seq, seed=3, device="cpu", synthetic="zipf")
    b = Batches(vocab, batch, seq, seed=3, device="cpu", synthetic="zipf")
    ids = a(0)["input_ids"]
    assert ids.shape == (batch, seq) and torch.equal(ids, b(0)["input_ids"]) and not torch.equal(ids, a(1)["input_ids"])
    assert 0 <= int(ids.min()) and int(ids.max()) < vocab
    counts = torch.bincount(ids.flatten(), minlength=vocab).double()
    harmonic = (1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)).sum()
    top_share = counts.max() / counts.sum()
    assert abs(top_share - 1 / harmonic) < 0.03, (top_share, 1 / harmonic)  # ~0.134 for V=1000
    uniform = Batches(vocab, batch, seq, seed=3, device="cpu")(0)["input_ids"]
    assert torch.bincount(uniform.flatten(), minlength=vocab).max() / uniform.numel() < 0.01
    with pytest.raises(ValueError, match="zipf"):
        Batches(vocab, batch, seq, seed=3, device="cpu", synthetic="zip")


def test_lr_warmup_schedule():
    """--lr-warmup N: step i (0-based) trains at lr * (i + 1) / N, then at lr; 0 means no scheduler."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1e-3)
    assert worker.lr_schedule(opt, 0) is None
    sched = worker.lr_schedule(opt, 4)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_run_with_zipf_tokens_and_warmup_reports_them(tmp_path):
    """The run job trains on zipf tokens with the warm-up (the loss falls from ln(vocab)), and the
    table's header says which data and schedule the numbers come from."""
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "fxfuse", "audit", "--model", "llama", "--tiny", "--config", "num_hidden_layers=1",
           "--device", "cpu", "--dtype", "float32", "--batch", "2", "--seq", "32", "--steps", "12", "--warmup", "0",
           "--lr", "3e-3", "--lr-warmup", "3", "--synthetic", "zipf", "--compare", "eager", "--profile-steps", "0",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    audit = json.loads((out / "audit.json").read_text())
    assert "linear warm-up over 3 steps" in audit["table"] and "synthetic tokens (zipf)" in audit["table"]
    losses = audit["modes"]["eager"]["losses"]
    assert min(losses[-3:]) < losses[0] - 0.5, losses  # zipf: something to learn


def test_autocast_run_keeps_fp32_weights_and_fuses(tmp_path):
    """--autocast bfloat16: fp32 master weights (the default dtype then), the forward under bf16
    autocast in every mode; fxfuse still fuses every site, and its loss tracks eager's (same bf16
    matmuls, fused ops in fp32 registers)."""
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "fxfuse", "audit", "--model", "llama", "--tiny", "--config", "num_hidden_layers=1",
           "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "3", "--warmup", "0", "--autocast", "bfloat16",
           "--compare", "eager,fxfuse", "--fxfuse-inner", "aot_eager", "--profile-steps", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    audit = json.loads((out / "audit.json").read_text())
    assert audit["args"]["dtype"] == "float32" and "float32 weights, bfloat16 autocast" in audit["table"]
    fx = audit["modes"]["fxfuse"]
    assert fx["status"] == "ok", fx["status"]
    assert fx["report"]["counts"] == {"rms_norm": 3, "rope": 1, "swiglu": 1, "linear_cross_entropy": 1}
    assert audit["divergence"]["fxfuse"]["max_rel"] < 1e-2, audit["divergence"]
    # the table's line comparing the non-eager modes with each other (here fxfuse and a shifted copy)
    from fxfuse.audit_render import render
    from fxfuse.audit_compare import pairwise_divergence

    audit["modes"]["other"] = {**fx, "losses": [v + 0.5 for v in fx["losses"]]}
    audit["pairwise"] = pairwise_divergence(audit["modes"])
    assert "max |dloss| between modes: fxfuse vs other 5.00e-01" in render(audit)


def test_with_autocast_runs_the_forward_in_bf16():
    seen = []
    call = worker.with_autocast(lambda **kw: seen.append(torch.is_autocast_enabled("cpu")), "cpu", "bfloat16")
    call(input_ids=None)
    assert seen == [True] and worker.with_autocast(len, "cpu", None) is len


def test_checkpointing_run_fuses_inside_the_checkpointed_layers(tmp_path):
    """--checkpointing: every mode checkpoints each decoder layer; fxfuse fuses the sites inside them
    and its fp32 loss curve equals eager's."""
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "fxfuse", "audit", "--model", "llama", "--tiny", "--config", "num_hidden_layers=1",
           "--device", "cpu", "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "0", "--checkpointing",
           "--compare", "eager,fxfuse", "--fxfuse-inner", "aot_eager", "--profile-steps", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    audit = json.loads((out / "audit.json").read_text())
    assert "activation checkpointing" in audit["table"]
    fx = audit["modes"]["fxfuse"]
    assert fx["status"] == "ok" and not fx["report"].get("errors"), fx
    assert fx["report"]["counts"] == {"rms_norm": 3, "rope": 1, "swiglu": 1, "linear_cross_entropy": 1}
    assert audit["divergence"]["fxfuse"]["max_rel"] < 1e-5, audit["divergence"]



def test_run_reports_what_the_post_grad_passes_did():
    """The fxfuse row of a run under Inductor says how many adds the backward's post-grad pass folded
    and how many bytes they no longer write (one Llama layer: its two norms fold their residual add
    and their dy sum, four [2, 8, 64] fp32 tensors); a cache hit is said to hide the counts."""
    from fxfuse.audit_render import post_grad_text

    # a cache hit would skip the pass (config.patch: monkeypatch's undo deletes a torch config entry)
    with torch._inductor.config.patch(force_disable_caches=True):
        r = worker.run(_fit_spec(job="run", mode="fxfuse", fxfuse_inner="inductor", steps=1))
    assert r["status"] == "ok"
    assert r["post_grad"] == {"residual_adds_folded": 2, "gradient_sums_folded": 2,
                              "fold_bytes_unwritten": 4 * 2 * 8 * 64 * 4, "gradients_in_place": 1, "cache_hits": 0}
    assert post_grad_text(r["post_grad"]).startswith("post-grad (Inductor backward): 2 residual-gradient adds and "
                                                     "2 gradient sums folded into the RMSNorm backward (0.02 MiB no "
                                                     "longer written")
    hit = dict.fromkeys(r["post_grad"], 0) | {"cache_hits": 2}
    assert "not run in this process (2 compile cache hits" in post_grad_text(hit)
    dynamic = r["post_grad"] | {"fold_bytes_unwritten": 0}  # symbolic sizes: the pass counts no bytes
    assert "(bytes not counted: symbolic sizes)" in post_grad_text(dynamic)
