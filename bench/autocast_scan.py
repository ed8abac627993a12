"""Which sites stop fusing under autocast: ``fxfuse.explain``'s counts in fp32 and under autocast.

Autocast changes a graph's dtypes, and on CUDA it runs more ops in fp32 than on CPU (``pow``,
``rsqrt``, ``exp``, ``sum`` ... are on CUDA's fp32 list, not on CPU's): a gated MLP whose GELU is
written out with ``torch.pow`` (T5's ``gelu_new``) meets its up projection in fp32 on a GPU only. So
this scan runs on the device the user trains on. Each model is built from its tiny zoo config
(fxfuse.zoo, fxfuse.zoo_vlm) with fp32 weights, explained once in fp32 and once under
``torch.autocast(device, dtype)``; a line per model says whether every pattern fused as many sites,
and for a pattern that fused fewer, the unmatched reasons of the autocast run. One subprocess per
model (a crash or hang costs that model only). A model the scan cannot explain is run without
fxfuse to say whose failure it is (its own code in eager, or torch.compile with backend="eager").
Exit 1 if any model fused fewer sites under autocast or failed only with fxfuse.

    python bench/autocast_scan.py --device cuda                       # the causal-LM zoo and the VLMs
    python bench/autocast_scan.py --device cuda --task seq2seq-lm     # every encoder-decoder LM type
    python bench/autocast_scan.py --device cuda --dtype float16 mt5 llama
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def build(spec: str, task: str):
    """(model, inputs) of the zoo's tiny config for spec: random weights, fp32, no dropout."""
    from fxfuse.zoo import builder

    _, make, inputs = builder(spec, task)
    return make(), inputs


def scan_one(spec: str, task: str, device: str, dtype: str) -> dict:
    """{"fp32": counts, "autocast": counts, "reasons": {pattern: [why]}} for one model; reasons only
    for the patterns that fused fewer sites under autocast."""
    import fxfuse

    model, inputs = build(spec, task)
    model.to(device).train()
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    # autocast first: the process's first compile traces fxfuse's patterns (once), and they must not
    # depend on the caller's autocast (fp32 first had hidden that CPU fp16 autocast broke them)
    with torch.autocast(device, dtype=DTYPES[dtype]):
        mixed = fxfuse.explain(model, **inputs)
    torch._dynamo.reset()
    fp32 = fxfuse.explain(model, **inputs)
    a, b = fp32.counts(), mixed.counts()
    fewer = [p for p in a if b[p] < a[p]]
    reasons = {p: sorted({s.reason for s in mixed.unmatched if s.pattern == p}) for p in fewer}
    return {"fp32": a, "autocast": b, "reasons": reasons}


def whose_error(spec: str, task: str, device: str, dtype: str) -> str:
    """Where a model the scan could not explain fails without fxfuse: "eager" (its own code, in fp32 or
    under autocast: DeBERTa's bf16 mask fill), "backend='eager'" (torch.compile alone), or "fxfuse"."""
    model, inputs = build(spec, task)
    model.to(device).train()
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    for call, who in ((model, "eager"), (torch.compile(model, backend="eager"), "backend='eager'")):
        for ctx in (torch.autocast(device, enabled=False), torch.autocast(device, dtype=DTYPES[dtype])):
            try:
                with ctx:
                    call(**inputs)
            except Exception:  # noqa: BLE001  any failure of the model itself
                return who
        torch._dynamo.reset()
    return "fxfuse"


def run_one(spec: str, args) -> dict:
    from fxfuse.sweep import json_of

    cmd = [sys.executable, __file__, "--one", spec, "--task", args.task, "--device", args.device,
           "--dtype", args.dtype]
    return json_of(cmd, args.timeout, '{"spec"')


def line(spec: str, r: dict) -> str:
    if "error" in r:
        where = f" (fails without fxfuse too: {r['fails_in']})" if r.get("fails_in", "fxfuse") != "fxfuse" else ""
        return f"{spec}: ERROR{where} {r['error']}"
    counts = " ".join(f"{p} {r['fp32'][p]}/{r['autocast'][p]}" for p in r["fp32"] if r["fp32"][p] or r["autocast"][p])
    if not r["reasons"]:
        return f"{spec}: same ({counts or 'no sites'})"
    why = "; ".join(f"{p}: {' | '.join(rs)}" for p, rs in r["reasons"].items())
    return f"{spec}: FEWER under autocast ({counts}) -- {why}"


def default_models(task: str) -> list[str]:
    from fxfuse.zoo import HF_ZOO, task_types
    from fxfuse.zoo_vlm import VLMS

    return [*HF_ZOO, *VLMS] if task == "causal-lm" else task_types(task)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*", help="model types (default: the zoo of the task)")
    p.add_argument("--task", choices=("causal-lm", "seq2seq-lm", "masked-lm"), default="causal-lm")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--jobs", type=int, default=4, help="models scanned at once")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per model")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the subprocess: scan this model, print its JSON
    args = p.parse_args(argv)
    if args.one:
        try:
            print(json.dumps({"spec": args.one, **scan_one(args.one, args.task, args.device, args.dtype)}))
        except Exception as e:  # noqa: BLE001  reported with where it fails without fxfuse
            torch._dynamo.reset()
            who = whose_error(args.one, args.task, args.device, args.dtype)
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(json.dumps({"spec": args.one, "error": error, "fails_in": who}))
        return 0
    models = args.models or default_models(args.task)
    print(f"autocast scan: {args.task}, {args.device}, {args.dtype}, torch {torch.__version__}, "
          f"{len(models)} models (fp32 / autocast sites fused)", flush=True)
    fewer = errors = ours = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        for spec, r in zip(models, pool.map(lambda s: run_one(s, args), models)):
            print(line(spec, r), flush=True)
            fewer += bool(r.get("reasons"))
            errors += "error" in r
            ours += r.get("fails_in") == "fxfuse"
    print(f"{len(models) - fewer - errors} same, {fewer} fewer under autocast, {errors} could not run "
          f"({ours} of them only with fxfuse)")
    return 1 if fewer or ours else 0


if __name__ == "__main__":
    sys.exit(main())
