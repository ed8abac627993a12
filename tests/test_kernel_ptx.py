"""fxfuse's elementwise and row kernels (RMSNorm, SwiGLU in its four forms, RoPE) as a 132-SM GPU
(H100 / H200) launches them at training shapes, compiled for sm_90 on CPU (tests/triton_specs.py
--ptx): every global load and store of their tensors is a 16-byte vector. A mask or stride the
compiler cannot see in 16-byte runs moves 2 bytes at a time: a select between two store masks
doubled RMSNorm's fwd+bwd on the H200 (bench/RESULTS.md, 2026-12-06)."""
import importlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import triton_specs

pytestmark = pytest.mark.interpreter
HERE = os.path.dirname(os.path.abspath(__file__))
BF = torch.bfloat16
E = torch.empty


def sm90_ptx(tmp_path, fn, names, args, kwargs) -> str:
    """PTX of one launch, specialized as on a GPU, compiled in a process without the interpreter."""
    spec = triton_specs.gpu_spec(fn, names, args, kwargs)
    path = tmp_path / f"{spec['name']}.json"
    path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, os.path.join(HERE, "triton_specs.py"), str(path), "--ptx"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.fixture
def gpu_launches(monkeypatch):
    """launches(step) -> {kernel name: (fn, arg names, args, kwargs)} of the kernels step() launches
    on CPU tensors as on 132 SMs, recorded and not run (the tensors' values never matter)."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxfuse.kernels import _rms_norm_launch as launch

    cached = (launch.fwd_launch, launch.bwd_launch, launch.bwd_split_launch)

    def launches(step) -> dict:
        seen = {}
        monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, grid, warmup, **kwargs:
                            seen.setdefault(self.fn.__name__, (self.fn, self.arg_names, args, kwargs)))
        monkeypatch.setattr(launch, "num_sms", lambda device: 132)
        for f in cached:
            f.cache_clear()
        step()
        return seen

    yield launches
    monkeypatch.undo()
    for f in cached:
        f.cache_clear()


def _rms(m, d, pdl=True, folded=False):
    """pdl: the dw reduction a programmatic dependent launch, as on sm_90+ (launch.dw_pdl); False: as
    before. folded: the backward with the residual-gradient add and a three-way dy sum folded in
    (fxfuse/fold_add.py: five staged loads per row)."""
    from fxfuse.kernels import _rms_norm_launch as launch
    from fxfuse.kernels import rms_norm as k

    x, w = E(m, d, dtype=BF), E(d, dtype=BF)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launch, "dw_pdl", lambda device: pdl)
        k._rms_norm(x, w, 1e-6, 0.0, True, BF)
        k._rms_norm_backward(x, x, w, 1e-6, 0.0, True, residual=x if folded else None, dy_more=(x, x) * folded)


def _ops(module: str):
    """torch.ops.fxfuse with the ops of fxfuse.kernels.<module> registered."""
    importlib.import_module("fxfuse.kernels." + module)
    return torch.ops.fxfuse


def _swiglu(m, i):
    g = E(m, i, dtype=BF)
    _ops("swiglu").swiglu(g, g, "silu")
    _ops("swiglu").swiglu_backward(g, g, g, "silu", True, True)


def _swiglu_packed(m, i):
    gu = E(m, 2 * i, dtype=BF)
    _ops("swiglu_packed").swiglu_packed(gu, "silu", False, False)
    _ops("swiglu_packed").swiglu_packed_backward(E(m, i, dtype=BF), gu, "silu", False, False)


def _softcapped(m, i):
    g = E(m, i, dtype=BF)
    _ops("softcapped_swiglu").softcapped_swiglu(g, g, 30.0, 30.0)
    _ops("softcapped_swiglu").softcapped_swiglu_backward(g, g, g, 30.0, 30.0, True, True)


def _clamped(m, i, at_bounds=None):
    """at_bounds: clamp's gradient at a bound as torch <= 2.13 (True) or >= 2.14 (False) gives it;
    None: as the installed torch does."""
    from fxfuse.kernels import clamped_swiglu

    g = E(m, i, dtype=BF)
    with pytest.MonkeyPatch.context() as mp:
        if at_bounds is not None:
            mp.setattr(clamped_swiglu, "clamp_grad_at_bounds", lambda: at_bounds)
        _ops("clamped_swiglu").clamped_swiglu(g, g, 1.702, 7.0)
        _ops("clamped_swiglu").clamped_swiglu_backward(g, g, g, 1.702, 7.0, True, True)


def _rope(b, t):
    q, k, cos = E(b, 32, t, 128, dtype=BF), E(b, 8, t, 128, dtype=BF), E(b, 1, t, 128, dtype=BF)
    _ops("rope").rope(q, k, cos, cos, False, 128)


CASES = {  # step on training shapes, the kernels it launches
    "rms_norm 4096x8192": (lambda: _rms(4096, 8192),
                           ["_rms_norm_fwd_rows_kernel", "_rms_norm_bwd_kernel", "_dw_reduce_kernel"]),
    "rms_norm 4096x8192 no pdl": (lambda: _rms(4096, 8192, pdl=False), ["_rms_norm_bwd_kernel", "_dw_reduce_kernel"]),
    "rms_norm 16384x4096": (lambda: _rms(16384, 4096),
                            ["_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_dw_reduce_kernel"]),
    "rms_norm_backward_add 8192x2048": (lambda: _rms(8192, 2048, folded=True),
                                        ["_rms_norm_bwd_kernel", "_dw_reduce_kernel"]),
    "swiglu 8192x14336": (lambda: _swiglu(8192, 14336), ["_swiglu_fwd_kernel", "_swiglu_bwd_kernel"]),
    "swiglu_packed 8192x14336": (lambda: _swiglu_packed(8192, 14336), ["_swiglu_fwd_kernel", "_swiglu_bwd_kernel"]),
    "softcapped_swiglu 65536x1024": (lambda: _softcapped(65536, 1024),
                                     ["_softcapped_swiglu_fwd_kernel", "_softcapped_swiglu_bwd_kernel"]),
    "clamped_swiglu 8192x2880": (lambda: _clamped(8192, 2880),
                                 ["_clamped_swiglu_fwd_kernel", "_clamped_swiglu_bwd_kernel"]),
    # both clamp-bound rules compiled whatever torch runs the tests (torch 2.14 changed it)
    "clamped_swiglu bounds of torch <= 2.13": (lambda: _clamped(8192, 2880, True), ["_clamped_swiglu_bwd_kernel"]),
    "clamped_swiglu bounds of torch >= 2.14": (lambda: _clamped(8192, 2880, False), ["_clamped_swiglu_bwd_kernel"]),
    "rope 4x4096": (lambda: _rope(4, 4096), ["_rope_kernel"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_global_accesses_are_16_byte_vectors(tmp_path, gpu_launches, case):
    """Every ld.global / st.global of the kernels' PTX is a .v4 (8 bf16, or 4 fp32 of RMSNorm's dw
    partials); a scalar .b16 access is what a hidden run looks like. RMSNorm's backward kernels hold
    griddepcontrol exactly where the dw reduction is a programmatic dependent launch."""
    step, kernels = CASES[case]
    launches = gpu_launches(step)
    pdl = {}  # kernel name -> the griddepcontrol instruction its PTX must hold
    if "_dw_reduce_kernel" in kernels:
        on = "no pdl" not in case
        assert launches["_dw_reduce_kernel"][3].get("launch_pdl", False) == on, case
        pdl = {"_rms_norm_bwd_kernel": "launch_dependents", "_dw_reduce_kernel": "wait"} if on else {}
    for name in kernels:
        ptx = sm90_ptx(tmp_path, *launches[name])
        accesses = re.findall(r"\b(?:ld|st)\.global[.\w]*", ptx)
        assert any(a.startswith("st") for a in accesses), name
        if name == "_dw_reduce_kernel":  # its store is dw [D] (16 KB), one column a thread after the reduction
            accesses = [a for a in accesses if a.startswith("ld")]
        assert all(".v4." in a for a in accesses), (name, sorted(set(accesses)))
        assert ("griddepcontrol." + pdl[name] in ptx if name in pdl else "griddepcontrol" not in ptx), name


def test_fp32_sums_are_never_an_fma(tmp_path, gpu_launches):
    """rms_norm_backward_add on CUDA (ADD_RN, which x.is_cuda sets) sums dx and the residual, and dy's
    addends, with add.rn.f32, which ptxas does not contract with a product into an fma: in fp32 each
    sum is then eager's add bit for bit (the contracted fma was 1 ulp off on the H100, fortieth
    session). dy's two adds bring more add.rn than the residual's alone."""
    from fxfuse.kernels import rms_norm as k

    x, w = E(64, 2048), E(2048)
    fn, names, args, kwargs = gpu_launches(lambda: k._rms_norm_backward_add(x, x, w, x, 1e-6, 0.0, True, False,
                                                                           x, x))["_rms_norm_bwd_kernel"]
    assert kwargs["HAS_RES"] and not kwargs["ADD_RN"] and kwargs["NUM_DY"] == 3  # CPU: numpy adds
    count = lambda **kw: sm90_ptx(tmp_path, fn, names, args, {**kwargs, **kw}).count("add.rn.f32")  # noqa: E731
    residual_only = count(ADD_RN=True, NUM_DY=1, dy2_ptr=None, dy3_ptr=None)
    assert count(ADD_RN=False) < count(ADD_RN=True)
    assert count(ADD_RN=False, NUM_DY=1, dy2_ptr=None, dy3_ptr=None) < residual_only < count(ADD_RN=True)


def test_clamp_bound_rules_compile_apart(tmp_path, gpu_launches):
    """The clamped SwiGLU backward under each clamp-bound rule is its own sm_90 kernel: the
    launches carry AT_BOUNDS as asked and the PTX differs (inclusive against strict comparisons)."""
    ptx = {}
    for rule in (True, False):
        fn, names, args, kwargs = gpu_launches(lambda: _clamped(64, 2880, rule))["_clamped_swiglu_bwd_kernel"]
        assert kwargs["AT_BOUNDS"] is rule
        ptx[rule] = sm90_ptx(tmp_path, fn, names, args, kwargs)
    assert ptx[True] != ptx[False]
