"""tests/triton_specs.py, the GPU compile check of what the suite launched: the recorder writes a
launch's specialization, the compiler accepts a good kernel and reports a kernel the interpreter
runs but the GPU compiler rejects, and the CLI fails on it (and on an empty record)."""
import json
import os
import subprocess
import sys

import pytest
import torch

import triton_spec_cases as cases
import triton_specs

pytestmark = pytest.mark.interpreter
HERE = os.path.dirname(os.path.abspath(__file__))


def _record(tmp_path, kernel, monkeypatch, modules=()):
    from triton.runtime.interpreter import InterpretedFunction

    # below the suite's own recorder, if any (.ci/run's, which must not see the rejected kernel)
    monkeypatch.setattr(InterpretedFunction, "run", getattr(InterpretedFunction.run, "__wrapped__",
                                                            InterpretedFunction.run))
    path = tmp_path / "w.jsonl"
    triton_specs.install_recorder(str(path), modules)
    x = torch.ones(3, 10)
    for _ in range(2):  # the same launch twice: recorded once
        kernel[(3,)](x, 2.0, 10, BLOCK=4, num_warps=2)
    torch.testing.assert_close(x, torch.full((3, 10), 4.0))  # the interpreter ran it, twice
    return path


def _compile(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, os.path.join(HERE, "triton_specs.py"), str(tmp_path), "--jobs", "1", *args],
                          env=env, capture_output=True, text=True, timeout=600)


def test_recorder_writes_each_specialization_once(tmp_path, monkeypatch):
    path = _record(tmp_path, cases.scale_rows_kernel, monkeypatch)
    (line,) = path.read_text().splitlines()
    assert json.loads(line) == {
        "module": "triton_spec_cases", "name": "scale_rows_kernel",
        "signature": {"x_ptr": "*fp32", "factor": "fp32", "N": "i32", "BLOCK": "constexpr"},
        "constexprs": {"BLOCK": 4}, "options": {"num_warps": 2}}


def test_recorder_keeps_to_the_named_modules(tmp_path, monkeypatch):
    """CI records fxfuse's kernels only: a kernel from elsewhere (a bench probe loaded by path) runs,
    unrecorded, where the compile step could not import it."""
    path = _record(tmp_path, cases.scale_rows_kernel, monkeypatch, modules=("fxfuse.",))
    assert not path.exists()


def test_cli_reports_a_kernel_it_cannot_import(tmp_path):
    spec = {"module": "no_such_module", "name": "k", "signature": {}, "constexprs": {}, "options": {}}
    (tmp_path / "w.jsonl").write_text(json.dumps(spec) + "\n")
    done = _compile(tmp_path)
    assert done.returncode == 1 and "FAILED no_such_module.k" in done.stdout and "ModuleNotFoundError" in done.stdout


def test_largest_tiles_kept_per_shape_free_key(tmp_path):
    spec = {"module": "m", "name": "k", "signature": {"BLOCK": "constexpr", "F": "constexpr"}, "options": {}}
    lines = [dict(spec, constexprs={"BLOCK": b, "F": f}) for b, f in ((4, 0), (64, 0), (16, 0), (8, 1))]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines[:2]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines[1:]))
    specs, launches = triton_specs.load_specs([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    assert launches == 4
    assert sorted((s["constexprs"]["F"], s["constexprs"]["BLOCK"]) for s in specs) == [(0, 64), (1, 8)]


def test_cli_compiles_a_good_kernel(tmp_path, monkeypatch):
    _record(tmp_path, cases.scale_rows_kernel, monkeypatch)
    done = _compile(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 specializations of 1 kernels (1 distinct launches) compiled for sm_90" in done.stdout
    assert "0 failed" in done.stdout


def test_cli_fails_on_what_only_the_gpu_compiler_rejects(tmp_path, monkeypatch):
    _record(tmp_path, cases.loop_carried_shape_kernel, monkeypatch)
    done = _compile(tmp_path)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout + done.stderr
    assert "FAILED triton_spec_cases.loop_carried_shape_kernel" in done.stdout
    assert "Loop-carried variable _" in done.stdout


def test_cli_fails_on_an_empty_record(tmp_path):
    done = _compile(tmp_path)
    assert done.returncode == 1 and "no specializations recorded" in done.stderr
