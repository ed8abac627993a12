"""bench/autocast_scan.py on CPU: a real subprocess per model, its line and exit status."""
import torch

from helpers import load_script


def test_scan_one_counts_fp32_and_autocast_sites():
    scan = load_script("bench", "autocast_scan")
    r = scan.scan_one("llama", "causal-lm", "cpu", "bfloat16")
    assert r["fp32"] == r["autocast"] and r["fp32"]["rms_norm"] > 0 and r["reasons"] == {}, r
    assert scan.line("llama", r).startswith("llama: same (rms_norm ")


def test_main_runs_each_model_in_a_subprocess(capsys):
    """llama scans the same under CPU autocast; a type transformers does not know is a line that says it
    could not run (not a crash of the scan), and the scan exits 0: no model fused fewer sites, none failed
    with fxfuse alone."""
    scan = load_script("bench", "autocast_scan")
    rc = scan.main(["llama", "no_such_model_type", "--device", "cpu", "--jobs", "2", "--timeout", "300"])
    out = capsys.readouterr().out.splitlines()
    assert rc == 0, out
    assert out[1].startswith("llama: same (rms_norm "), out
    assert out[2].startswith("no_such_model_type: ERROR"), out
    assert out[-1].startswith("1 same, 0 fewer under autocast, 1 could not run (0 of them only with fxfuse)"), out


def test_line_names_the_fewer_patterns_and_whose_error():
    scan = load_script("bench", "autocast_scan")
    fewer = {"fp32": {"rms_norm": 2, "swiglu": 1}, "autocast": {"rms_norm": 2, "swiglu": 0},
             "reasons": {"swiglu": ["mixed dtypes"]}}
    assert scan.line("m", fewer) == "m: FEWER under autocast (rms_norm 2/2 swiglu 1/0) -- swiglu: mixed dtypes"
    assert scan.line("m", {"error": "E", "fails_in": "eager"}) == "m: ERROR (fails without fxfuse too: eager) E"
    assert scan.line("m", {"error": "E", "fails_in": "fxfuse"}) == "m: ERROR E"
    assert torch.bfloat16 in scan.DTYPES.values()
