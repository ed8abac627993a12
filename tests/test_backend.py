"""The backend's contract: entry point, options, dynamic shapes, inference, frozen weights, autocast,
bf16 accuracy, fail-safe, report and debug dumps."""
import json
import os
import subprocess
import sys

import pytest
import torch

import fxfuse
from helpers import batch, bf16_errors, compiled_parity, count_calls, hf_model, is_rms_norm, loss_and_grads, rel_err


def test_entry_point_without_import():
    code = (
        "import sys, torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))\n"
        "x = torch.randn(3, 8)\n"
        "assert 'fxfuse' not in sys.modules\n"
        "out = torch.compile(m, backend='fxfuse', options={'inner': 'eager'})(x)\n"
        "torch.testing.assert_close(out, m(x))\n"
        "import fxfuse\n"
        "print(fxfuse.last_report().counts()['rms_norm'])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "1"


def test_unknown_option_lists_valid_ones():
    m = torch.nn.Linear(4, 4)
    with pytest.raises(Exception, match="unknown option.*'bogus'[\\s\\S]*inner[\\s\\S]*patterns[\\s\\S]*debug_dir"):
        torch.compile(m, backend="fxfuse", options={"bogus": 1})(torch.randn(2, 4))
    with pytest.raises(Exception, match="'inner' must be one of"):
        torch.compile(m, backend="fxfuse", options={"inner": "tvm"})(torch.randn(2, 4))
    with pytest.raises(Exception, match="unknown pattern"):
        torch.compile(m, backend="fxfuse", options={"patterns": ["layer_norm"]})(torch.randn(2, 4))


def test_patterns_option_turns_fusion_off():
    model = hf_model("llama", num_hidden_layers=1)
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "eager", "patterns": []})
    compiled(**batch())
    assert fxfuse.last_report().counts()["rms_norm"] == 0


def test_dynamic_shapes_one_compile_across_lengths():
    model = hf_model("llama")
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}, dynamic=True)
    seen = []
    for t in (9, 13, 21):
        inputs = batch(t=t)
        ref_loss, ref_grads = loss_and_grads(model, inputs)
        loss, grads = loss_and_grads(model, inputs, call=compiled)
        assert rel_err(loss, ref_loss) < 1e-5
        assert max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < 1e-5
        seen.append(len(fxfuse.compiled_reports()))
    assert seen[0] == seen[1] == seen[2], "the backend compiled again for a new sequence length"
    assert fxfuse.last_report().counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}


def test_automatic_dynamic_recompile_keeps_every_site():
    """Default dynamic=None: the second length recompiles with symbolic sizes (reshapes such as
    view(-1, V) then read [2, s, V] -> [2*s, V]); every site must still match."""
    model = hf_model("llama")
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    for t in (9, 13, 17):
        inputs = batch(t=t)
        ref_loss, _ = loss_and_grads(model, inputs)
        loss, _ = loss_and_grads(model, inputs, call=compiled)
        assert rel_err(loss, ref_loss) < 1e-5
        assert fxfuse.last_report().counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}


def test_inference_under_no_grad():
    model = hf_model("qwen2").eval()
    inputs = {"input_ids": batch()["input_ids"]}
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    with torch.no_grad():
        ref = model(**inputs).logits
        out = compiled(**inputs).logits
    assert fxfuse.last_report().counts()["rms_norm"] == count_calls(model, is_rms_norm, **inputs)
    assert rel_err(out, ref) < 1e-5


def test_frozen_norm_weights():
    model = hf_model("llama")
    for name, p in model.named_parameters():
        p.requires_grad_("norm" not in name)
    loss_err, grad_err, report, names = compiled_parity(model, batch())
    assert not [n for n in names if "norm" in n]
    assert report.counts()["rms_norm"] == count_calls(model, is_rms_norm, **batch())
    assert loss_err < 1e-5 and grad_err < 1e-5


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16_weights", "bf16_autocast"])
@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_bf16_within_twice_eager_error(model_type, autocast):
    inputs = batch()
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(lambda dt: hf_model(model_type, dtype=dt), inputs, autocast,
                                                      patterns=["rms_norm"])
    assert fxfuse.last_report().counts()["rms_norm"] == count_calls(hf_model(model_type), is_rms_norm, **inputs)
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


def test_unsupported_dtype_stays_unfused_and_correct():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8)).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    out = torch.compile(model, backend="fxfuse", options={"inner": "eager"})(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    report = fxfuse.last_report()
    assert report.counts()["rms_norm"] == 0
    assert any("float64 not supported" in s.reason for s in report.unmatched)


def test_lowering_error_is_fail_safe():
    from fxfuse.patterns import rms_norm

    def broken(m, graph, opts):
        graph.call_function(torch.ops.aten.neg.default, (m.inputs["x"],))  # partial work is rolled back
        raise RuntimeError("kernel says no")

    object.__setattr__(rms_norm.PATTERN, "lower", broken)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
        x = torch.randn(3, 8)
        out = torch.compile(model, backend="fxfuse", options={"inner": "eager"})(x)
    finally:
        object.__setattr__(rms_norm.PATTERN, "lower", rms_norm.lower)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    (site,) = fxfuse.last_report().unmatched
    assert "lowering failed: RuntimeError: kernel says no" in site.reason


def test_check_error_keeps_only_its_site_unfused(monkeypatch):
    """A pattern's check that raises (an fxfuse bug) refuses that match, with the error as its reason;
    the graph's other sites still fuse (before: the whole graph was left unfused)."""
    import dataclasses

    from fxfuse.patterns import rms_norm

    def broken(m):
        raise ValueError("check says no")

    monkeypatch.setattr(rms_norm, "PATTERN", dataclasses.replace(rms_norm.PATTERN, check=broken))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.RMSNorm(16), torch.nn.Linear(16, 8))
    x = torch.randn(3, 8)
    fn = lambda x: torch.nn.functional.silu(model(x)[:, :4]) * model(x)[:, 4:]  # noqa: E731
    out = torch.compile(fn, backend="fxfuse", options={"inner": "eager"})(x)
    assert rel_err(out, fn(x)) < 1e-6
    report = fxfuse.last_report()
    assert report.counts()["swiglu"] == 1 and report.counts()["rms_norm"] == 0 and not report.errors
    assert all("rms_norm's check failed (ValueError: check says no)" in s.reason
               for s in report.unmatched if s.pattern == "rms_norm")


def test_report_text_json_and_debug_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("FXFUSE_DEBUG_DIR", str(tmp_path))
    model = hf_model("llama", num_hidden_layers=1)
    torch.compile(model, backend="fxfuse", options={"inner": "eager"})(**batch())
    report = fxfuse.last_report()
    data = json.loads(report.to_json())
    assert data["counts"]["rms_norm"] == 3 and sum(data["counts"].values()) == len(data["matched"])
    assert {"pattern", "module", "source", "variant", "saved_tensors"} <= set(data["matched"][0])
    text = str(report)
    assert "model.layers.0.input_layernorm" in text and "rmsnorm_llama" in text
    (stem,) = {f.split(".")[0] for f in os.listdir(tmp_path)}  # one compiled graph, one dump
    files = set(os.listdir(tmp_path))
    assert {f"{stem}.json", f"{stem}.txt", f"{stem}.before.py", f"{stem}.after.py"} <= files, files
    assert "torch.ops.fxfuse.rms_norm" in (tmp_path / f"{stem}.after.py").read_text()
    assert "torch.ops.fxfuse.rms_norm" not in (tmp_path / f"{stem}.before.py").read_text()
    assert json.loads((tmp_path / f"{stem}.json").read_text())["counts"] == data["counts"]


def test_debug_dump_draws_unmatched_candidates(tmp_path):
    class Shared(torch.nn.Module):
        def forward(self, x):
            v = x.pow(2).mean(-1, keepdim=True)
            return (x * torch.rsqrt(v + 1e-6)).sum() + v.sum()

    report = fxfuse.explain(Shared(), torch.randn(3, 8), fxfuse_options={"debug_dir": str(tmp_path)})
    assert len(report.unmatched) == 1
    (dot_file,) = tmp_path.glob("*.unmatched0.dot")
    dot = dot_file.read_text()
    assert dot.startswith("digraph") and "also used outside" in dot and "(outside)" in dot


def _norm_model_matches_eager():
    """Linear + nn.RMSNorm compiled with fxfuse (aot_eager): its output equals eager's; its report."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8))
    x = torch.randn(3, 8)
    out = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})(x)
    torch.testing.assert_close(out, model(x))
    return fxfuse.last_report()


def test_retrace_failure_leaves_graph_unfused(monkeypatch):
    import fxfuse.backend as backend

    def broken(gm, example_inputs):
        raise RuntimeError("make_fx says no")

    monkeypatch.setattr(backend, "to_aten", broken)
    report = _norm_model_matches_eager()
    assert report.counts()["rms_norm"] == 0
    assert report.errors == ["graph left unfused: RuntimeError: make_fx says no"]
    assert "make_fx says no" in str(report)


def test_kv_cache_constants_in_the_graph():
    """use_cache=True puts the cache's initial tensors in the graph as constants; the re-traced
    graph must still give AOTAutograd a source for each."""
    model = hf_model("llama", use_cache=True)
    loss_err, grad_err, report, _ = compiled_parity(model, batch())
    assert report.counts() == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}
    assert not report.errors and loss_err < 1e-5 and grad_err < 1e-5


def test_inner_compile_failure_falls_back_to_the_unfused_graph(monkeypatch):
    import fxfuse.backend as backend

    real = backend.inner_compile

    def picky(gm, example_inputs, opts, mode):
        if "fxfuse" in gm.code:
            raise RuntimeError("inner compiler rejects the rewritten graph")
        return real(gm, example_inputs, opts, mode)

    monkeypatch.setattr(backend, "inner_compile", picky)
    report = _norm_model_matches_eager()
    assert report.counts()["rms_norm"] == 0 and "inner compiler rejects" in report.errors[0]


class _MaskedAdd(torch.nn.Module):
    """Qwen3-VL's DeepStack add after an RMSNorm: the backward of a boolean-mask index_put needs a
    data-dependent nonzero, which AOTAutograd cannot trace under any backend."""

    def __init__(self):
        super().__init__()
        self.norm, self.lin = torch.nn.RMSNorm(8), torch.nn.Linear(8, 8)

    def forward(self, x, mask, v):
        h = self.lin(self.norm(x))
        h[mask, :] = h[mask, :] + v
        return h.square().mean()


def test_a_graph_no_backend_compiles_is_reported_as_run_eagerly():
    """The rewritten graph fails in the inner compiler, and so does Dynamo's own graph: the report
    says Dynamo ran that code eagerly (not "compiled unfused"), and the result is still eager's."""
    torch.manual_seed(0)
    model = _MaskedAdd()
    mask = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)
    inputs = {"x": torch.randn(6, 8), "mask": mask, "v": torch.randn(3, 8)}
    ref, ref_grads = loss_and_grads(model, inputs, loss_fn=lambda out: out)
    torch._dynamo.reset()
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    loss, grads = loss_and_grads(model, inputs, loss_fn=lambda out: out, call=compiled)
    errors = [e for r in fxfuse.compiled_reports()[n0:] for e in r.errors]
    assert errors and all("the unfused graph fails in the inner compiler (aot_eager) too" in e
                          and "Dynamo runs this code eagerly" in e and "nonzero" in e for e in errors), errors
    assert not any("compiled unfused" in e for e in errors)
    assert rel_err(loss, ref) < 1e-5 and all(rel_err(grads[k], ref_grads[k]) < 1e-5 for k in ref_grads)


def test_explain_command_prints_json(capsys):
    from fxfuse.cli import main

    assert main(["explain", "qwen2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["counts"] == {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}
    assert all(s["module"] or s["pattern"] == "linear_cross_entropy" for s in data["matched"])


class _FuncModule(torch.nn.Module):
    """A function wrapped in a module at global scope, as transformers >= 5.25 does to
    apply_rotary_pos_emb (use_kernelized_func): Dynamo's module stack names it G['...']."""

    def forward(self, x, weight):
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


GLOBAL_NORM = _FuncModule()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16))

    def forward(self, x):
        return GLOBAL_NORM(x, self.weight)


def test_site_module_is_the_model_module_not_a_global_one():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _Block())
    report = fxfuse.explain(model, torch.randn(3, 16))
    assert [(s.pattern, s.module) for s in report.matched] == [("rms_norm", "1")]


def test_kernel_change_misses_the_compile_cache(monkeypatch, tmp_path):
    """A compile cache keyed by the graph's code before the fused ops decompose (AOTAutograd's)
    would hand a new fxfuse the compiled code of an old one (calls with an op's old schema): the
    kernels' hash salts the key, so the same graph hits the caches until fxfuse's kernels or
    patterns change, then misses."""
    import fxfuse.backend as backend
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    norm = torch.nn.RMSNorm(16)

    def compile_once():
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(lambda x: norm(x).sum(), backend="fxfuse")
        fn(torch.randn(4, 16, requires_grad=True)).backward()
        assert fxfuse.last_report().counts()["rms_norm"] == 1
        hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
        misses = counters["aot_autograd"]["autograd_cache_miss"] + counters["inductor"]["fxgraph_cache_miss"]
        return hits > 0, misses > 0

    assert compile_once() == (False, True)
    assert compile_once() == (True, False)
    monkeypatch.setattr(backend, "source_hash", lambda: "another-version")
    assert compile_once()[1]  # the forward misses (the backward compiles later, its code decomposed)


def test_cache_salt_reads_every_kernel_and_pattern_source():
    """The salt above hashes the fused ops' sources wherever the install put them: an editable install
    maps fxfuse.kernels / fxfuse.patterns to the checkout's kernels/ and patterns/, where a hash of
    fxfuse/'s own subfolders found no file, stayed constant, and let a cached backward of an older
    kernel run after an edit or upgrade."""
    import hashlib
    from pathlib import Path

    import fxfuse.backend as backend

    files = sorted((f.parent.name, f.name) for f in backend.hashed_files())
    root = Path(__file__).resolve().parents[1]
    assert files == sorted((d, f.name) for d in ("kernels", "patterns") for f in (root / d).glob("*.py"))
    assert {("kernels", "linear_cross_entropy_fast.py"), ("patterns", "rope.py")} <= set(files)
    assert backend.source_hash() != hashlib.sha256().hexdigest()[:16]  # not the hash of nothing


def test_compiled_autograd_captures_the_fused_backward():
    """Compiled autograd (an option of torchtitan and FSDP2 setups) traces the backward of every fused
    op into the backward graph it compiles: one capture holding each pattern's backward op, the loss and
    every gradient equal to eager's."""
    import copy

    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    model = hf_model("gemma2")  # all four patterns, Gemma's (1 + w) norms and softcapped head
    inputs = batch()
    ref_loss, ref_grads = loss_and_grads(copy.deepcopy(model), inputs)
    counters.clear()
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    loss = compiled(**inputs).loss
    assert fxfuse.last_report().counts() == {"rms_norm": 9, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}
    seen = []

    def record(gm, example_inputs):  # the backward graph compiled autograd hands its compiler
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    with compiled_autograd._enable(torch.compile(backend=record)):
        loss.backward()
    assert counters["compiled_autograd"]["captures"] == 1
    fused = {t for t in seen if t.startswith("fxfuse.")}
    backward_ops = {"fxfuse.rms_norm_backward.default", "fxfuse.rope_bwd.default", "fxfuse.swiglu_backward.default",
                    "fxfuse.linear_cross_entropy_bwd.default"}
    assert backward_ops <= fused, sorted(fused)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    assert rel_err(loss, ref_loss) < 1e-5
    assert max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < 1e-5
