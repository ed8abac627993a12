"""fxfuse sweep: fxfuse check --no-train per causal-LM type, each in its own process."""
import io

import fxfuse.sweep as sweep_mod
from fxfuse.report import PATTERN_NAMES
from fxfuse.sweep import line, status, sweep
from fxfuse.zoo import task_types


def _result(matched, expected, parity_ok=True, reasons=None):
    gaps = [p for p in PATTERN_NAMES if matched[p] < expected[p]]
    false = [p for p in PATTERN_NAMES if matched[p] > expected[p]]
    return {"matched": matched, "expected": expected, "gaps": gaps, "false_matches": false,
            "parity_ok": parity_ok, "reasons": reasons or {}}


def test_status_and_line():
    ok = _result({"rms_norm": 5, "rope": 2, "swiglu": 0, "linear_cross_entropy": 1},
                 {"rms_norm": 5, "rope": 2, "swiglu": 0, "linear_cross_entropy": 1})
    assert status(ok) == "PASS"
    assert line("llama", ok).split() == ["llama", "PASS", "rms_norm", "5/5,", "rope", "2/2,", "swiglu", "-,",
                                         "linear_cross_entropy", "1/1"]
    gap = _result({"rms_norm": 0, "rope": 0, "swiglu": 0, "linear_cross_entropy": 0},
                  {"rms_norm": 0, "rope": 0, "swiglu": 0, "linear_cross_entropy": 1}, parity_ok=False,
                  reasons={"graph_breaks": ["logging.Logger method not supported"]})
    assert status(gap) == "NOT PASSED: gap in linear_cross_entropy, fp32 parity"
    assert line("ctrl", gap).endswith("(graph break: logging.Logger method not supported)")
    assert status({"error": "KeyError: 'x'"}) == "ERROR" and "KeyError" in line("x", {"error": "KeyError: 'x'"})


def test_every_causal_lm_type_is_swept_and_a_failure_sets_the_exit_code(monkeypatch):
    types = task_types("causal-lm")
    assert {"llama", "qwen2", "gpt2"} <= set(types) and types == sorted(types)
    assert {"t5", "bart"} <= set(task_types("seq2seq-lm")) and {"bert", "roformer"} <= set(task_types("masked-lm"))
    full = {p: 1 for p in PATTERN_NAMES}
    results = {"a": _result(full, full), "b": _result(full, full, parity_ok=False), "c": {"error": "boom"}}
    monkeypatch.setattr(sweep_mod, "run_one", lambda t, inner, timeout, task: results[t])
    out = io.StringIO()
    assert sweep(["a", "b", "c"], out=out) == 1
    assert out.getvalue().splitlines()[-1].startswith("3 types: 1 passed, 1 not passed, 1 could not run")
    assert sweep(["a", "c"], out=io.StringIO()) == 0  # a type that could not run is no failure of fxfuse


def test_each_type_runs_in_its_own_process():
    """A real subprocess per type: llama passes; an unknown type is an error line, not a crash."""
    out = io.StringIO()
    assert sweep(["llama", "not_a_model_type"], out=out, timeout=600) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split()[:2] == ["llama", "PASS"] and "rms_norm 5/5" in lines[0], lines
    assert lines[1].split()[:2] == ["not_a_model_type", "ERROR"] and "KeyError" in lines[1], lines


def test_encoder_decoder_and_encoder_tasks():
    """--task seq2seq-lm / masked-lm build the model with that LM head: mT5 (T5's LayerNorm, gelu_new
    GeGLU), BART (its separate final_logits_bias) and RoFormer (rotation merged by reshape_as) fuse
    every site with parity."""
    out = io.StringIO()
    assert sweep(["mt5", "bart"], out=out, task="seq2seq-lm") == 0
    mt5, bart = out.getvalue().splitlines()[:2]
    assert mt5.split()[:2] == ["mt5", "PASS"] and "rms_norm 12/12" in mt5 and "swiglu 4/4" in mt5, mt5
    assert bart.split()[:2] == ["bart", "PASS"] and "linear_cross_entropy 1/1" in bart, bart
    out = io.StringIO()
    assert sweep(["roformer"], out=out, task="masked-lm") == 0
    assert "rope 2/2" in out.getvalue().splitlines()[0], out.getvalue()
