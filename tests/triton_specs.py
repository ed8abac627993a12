"""Compile for a GPU, on a CPU, every Triton kernel specialization the test suite launched.

Triton's interpreter runs the kernels on CPU but never compiles them, so what only the GPU
compiler checks (a loop-carried variable changing type, branches that return different types,
code the interpreter's numpy semantics accept) first fails on the device machine. This closes that
gap: with FXFUSE_TRITON_SPECS=DIR, tests/conftest.py records each interpreter launch's
specialization (kernel, argument types, constexpr values, num_warps) to DIR/<worker>.jsonl; then

    python tests/triton_specs.py DIR [--arch 90] [--jobs 2]

compiles each one (down to a cubin, with the ptxas that ships in Triton's wheel) for an NVIDIA
target without a GPU and fails on any error. .ci/run does both. Launches that differ only in
BLOCK* sizes compile once, at the largest tiles recorded (the GPU's tiles are larger than the
tests'; a size-only error would show at the device's tiles, not these).

    python tests/triton_specs.py SPEC.json --ptx

prints one spec's PTX (a spec_of dict, or gpu_spec's with its "divisible" list), for tests of
what the compiler makes of a launch (tests/test_kernel_ptx.py: 16-byte vector accesses).
"""
from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import sys
import time

_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int64": "i64",
           "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


def _arg_type(value) -> str:
    """Triton signature type of a runtime argument, as the JIT specializes it."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a {type(value).__name__} argument")


def spec_of(fn, names: list[str], args: tuple, kwargs: dict) -> dict:
    """{"module", "name", "signature", "constexprs", "options"} of one launch of the kernel whose
    Python function is fn and parameters names; constexpr parameters (and None arguments, which
    the JIT treats as constexpr None) keep their values."""
    annotated = {p for p, prm in inspect.signature(fn).parameters.items() if "constexpr" in str(prm.annotation)}
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    signature, constexprs = {}, {}
    for name in names:
        value = values.get(name)
        if name in annotated or value is None:
            signature[name], constexprs[name] = "constexpr", getattr(value, "value", value)
        else:
            signature[name] = _arg_type(value)
    options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
    return {"module": fn.__module__, "name": fn.__qualname__, "signature": signature, "constexprs": constexprs,
            "options": options}


def install_recorder(path: str, modules: tuple[str, ...] = ()) -> None:
    """Appends each new specialization the interpreter launches to path (one JSON object a line);
    modules: record only kernels defined in modules whose names start so (empty: all)."""
    from triton.runtime.interpreter import InterpretedFunction

    seen = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if modules and not self.fn.__module__.startswith(modules):
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        line = json.dumps(spec_of(self.fn, self.arg_names, args, kwargs), sort_keys=True)
        if line not in seen:
            seen.add(line)
            with open(path, "a") as out:
                out.write(line + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run.__wrapped__ = run  # tests record on their own, under the suite's recorder
    InterpretedFunction.run = recording_run


def _shape_free_key(spec: dict) -> str:
    constexprs = {k: v for k, v in spec["constexprs"].items() if not k.startswith("BLOCK")}
    return json.dumps([spec["module"], spec["name"], spec["signature"], constexprs], sort_keys=True)


def _tile(spec: dict) -> int:
    size = 1
    for k, v in spec["constexprs"].items():
        if k.startswith("BLOCK") and isinstance(v, int):
            size *= v
    return size


def load_specs(paths: list[str]) -> tuple[list[dict], int]:
    """(one spec per kernel, types and non-BLOCK constexprs: the largest tiles; distinct launches)."""
    distinct, best = set(), {}
    for path in paths:
        with open(path) as f:
            for line in f:
                distinct.add(line.strip())
    for line in sorted(distinct):
        spec = json.loads(line)
        key = _shape_free_key(spec)
        if key not in best or _tile(spec) > _tile(best[key]):
            best[key] = spec
    return list(best.values()), len(distinct)


def gpu_spec(fn, names: list[str], args: tuple, kwargs: dict) -> dict:
    """spec_of one launch as the JIT specializes it on a GPU: integers equal to 1 become constexprs,
    and "divisible" lists the 16-byte aligned tensors and the integers that are multiples of 16 (marked
    divisible by 16: what lets the compiler see 16-byte runs and vectorize loads and stores)."""
    import torch

    spec = spec_of(fn, names, args, kwargs)
    values = dict(zip(names, args)) | kwargs
    spec["divisible"] = []
    for name in names:
        value = values.get(name)
        if spec["signature"][name] == "constexpr":
            continue
        integer = isinstance(value, int) and not isinstance(value, bool)
        if integer and value == 1:
            spec["signature"][name], spec["constexprs"][name] = "constexpr", 1
        elif (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (integer and value % 16 == 0):
            spec["divisible"].append(name)
    return spec


def _compiled(spec: dict, arch: int):
    """spec compiled for sm_<arch>; spec["divisible"] (optional): divisibility-16 parameters."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    names = fn.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec.get("divisible", [])}
    src = ASTSource(fn=fn, signature={n: spec["signature"][n] for n in names},
                    constexprs={(names.index(n),): v for n, v in spec["constexprs"].items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(spec["options"]))


def compile_spec(spec: dict, arch: int = 90) -> str | None:
    """None when the kernel compiles to a cubin for sm_<arch>, else the error (its last lines)."""
    try:
        _compiled(spec, arch)
    except Exception as exc:  # any compiler error is the finding
        return f"{type(exc).__name__}: {str(exc)[-600:]}"
    return None


def _compile_one(job: tuple[dict, int]) -> tuple[dict, str | None]:
    spec, arch = job
    return spec, compile_spec(spec, arch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="FXFUSE_TRITON_SPECS folder of the test run (with --ptx: one spec's JSON file)")
    p.add_argument("--arch", type=int, default=90, help="NVIDIA compute capability x 10 (90: H100 / H200)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--ptx", action="store_true", help="print the PTX of the one spec in the file dir")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: kernels imported under the interpreter cannot be compiled")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as the device's Triton 3.6 compiles (and quiet)
    if args.ptx:
        with open(args.dir) as f:
            print(_compiled(json.load(f), args.arch).asm["ptx"])
        return 0
    specs, launches = load_specs(sorted(glob.glob(os.path.join(args.dir, "*.jsonl"))))
    if not specs:  # a recorder that never ran must not pass as "nothing failed"
        print(f"triton_specs: no specializations recorded in {args.dir}", file=sys.stderr)
        return 1
    start = time.time()
    jobs = [(spec, args.arch) for spec in specs]
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(_compile_one, jobs, chunksize=4)
    else:
        results = [_compile_one(job) for job in jobs]
    failed = [(spec, err) for spec, err in results if err is not None]
    kernels = len({(s["module"], s["name"]) for s in specs})
    print(f"triton_specs: {len(specs)} specializations of {kernels} kernels ({launches} distinct launches) "
          f"compiled for sm_{args.arch} in {time.time() - start:.0f} s: {len(failed)} failed")
    for spec, err in failed:
        print(f"FAILED {spec['module']}.{spec['name']} constexprs={spec['constexprs']} "
              f"options={spec['options']}\n  {err}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
