"""Where the CUDA soundness twin's round-trip cases leave eager's value: each case compiled five ways,
the error of every output and gradient against eager's printed side by side.

The cases feed a bf16 round trip into (or next to) a fused op: an fp32 input rounded to bf16 and back
before a norm, bf16 rotary tables applied to an fp32 q, fp32 logits rounded to bf16 and back before
the loss. fxfuse with aot_eager isolates the fused kernels from Inductor; "precise" runs Inductor with
emulate_precision_casts and without its pattern passes (older joint-graph passes drop an
fp32 -> bf16 -> fp32 round trip whatever emulate_precision_casts says).

    python bench/probe_round_trips.py --device cuda     # from the repo root; tests/ goes on the path
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

def ways(precise: dict) -> list:
    """(label, backend, options) of each way to compile a case; precise: soundness.PRECISE_CASTS."""
    return [("fxfuse aot_eager", "fxfuse", {"inner": "aot_eager"}),
            ("fxfuse inductor", "fxfuse", {"inner": "inductor"}),
            ("plain inductor", "inductor", None),
            ("plain inductor precise", "inductor", precise),
            ("fxfuse inductor precise", "fxfuse", {"inner": "inductor", "inductor_config": precise})]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("names", nargs="*", help="soundness case names (default: soundness.ROUND_TRIPS)")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import fxfuse
    from soundness import PRECISE_CASTS, ROUND_TRIPS, _err, _fwd_bwd, all_cases

    cases = {c.name: c for c in all_cases()}
    for name in args.names or ROUND_TRIPS:
        case = cases[name]
        inputs = tuple(t.to(args.device) if isinstance(t, torch.Tensor) else t for t in case.inputs())
        ref_outs, ref_grads = _fwd_bwd(case.fn, inputs)
        for label, backend, options in ways(PRECISE_CASTS):
            torch._dynamo.reset()
            n0 = len(fxfuse.compiled_reports())
            try:
                outs, grads = _fwd_bwd(torch.compile(case.fn, backend=backend, options=options, fullgraph=True), inputs)
            except Exception as e:  # noqa: BLE001 - a way that fails is a line of the table
                print(f"{name:36s} {label:24s} {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            fused = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:]).counts()[case.op]
            errs = " ".join(f"{_err(a, b):.2e}" for a, b in zip(outs, ref_outs))
            gerrs = " ".join(f"{_err(a, b):.2e}" for a, b in zip(grads, ref_grads))
            print(f"{name:36s} {label:24s} fused {fused}  outputs {errs}  gradients {gerrs}", flush=True)


if __name__ == "__main__":
    main()
