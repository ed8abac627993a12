"""End-to-end training benchmark: eager / inductor / liger / fxfuse side by side on the model shapes of
DESIGN.md's table (Llama-3.2-1B-like 4x2048, Qwen2-1.5B-like 4x2048, Gemma2-2B-like 2x2048, bf16,
random weights, synthetic tokens, AdamW), through ``fxfuse audit`` (every mode in its own process).

  python bench/e2e.py                                   # all three models on the GPU
  python bench/e2e.py --models llama-1b --steps 30      # one model (fits one 10-minute device call)
  python bench/e2e.py --models llama --tiny --device cpu --compare eager,fxfuse --steps 3   # CPU check
  python bench/e2e.py --models llama-1b --fxfuse-option loss_head=fast   # more fxfuse backend options
  python bench/e2e.py --models llama-1b --fit batch    # + largest batch per mode (one process per mode)

Prints one markdown section per model (the bench/RESULTS.md format; the model line names the fxfuse
options used) and writes it, with each model's audit.json / audit.txt / audit.png, under --out. bench/run_all.sh runs it as the ``e2e`` entry.
"""
from __future__ import annotations

import argparse
import os
import sys

from fxfuse.audit import _finish, add_arguments, run_audit
from fxfuse.audit_render import graphs_text, inputs_text, options_text, post_grad_text, seq_text
from fxfuse.audit_compare import render_lines

CASES = {"llama-1b": (4, 2048), "qwen2-1.5b": (4, 2048), "gemma2-2b": (2, 2048)}  # batch, seq (DESIGN.md)
GIB = 2**30 / 2**20  # MiB per GiB


def markdown(audit: dict) -> str:
    a, env = audit["args"], audit["env"]
    cuda = a["device"].startswith("cuda")
    mem = "peak alloc GiB | peak reserved GiB" if cuda else "peak RSS GiB | -"
    lines = [f"### {a['model']}{' (tiny)' if a['tiny'] else ''}, batch {a['batch']} x {seq_text(a)}, {a['dtype']}"
             + (f" weights + {a['autocast']} autocast" if a.get("autocast") else "")
             + (", activation checkpointing" if a.get("checkpointing") else "") + inputs_text(a) + ", "
             f"{a['steps']} steps (median after {a['warmup']}), {env['device']}, torch {env['torch']}, "
             f"{'tokens ' + a['tokens'] if a['tokens'] else a.get('synthetic', 'uniform') + ' synthetic tokens'}, "
             f"AdamW lr {a['lr']}" + (f" warm-up {a['lr_warmup']} steps" if a.get("lr_warmup") else "")
             + (f", fxfuse options: {options_text(a)}" if "fxfuse" in audit["modes"] else ""),
             "",
             f"| mode | first step s | step ms | tokens/s | {mem} | max batch | target-op % "
             "| max abs loss diff vs eager | status |"]
    lines.append("|---" * (lines[-1].count("|") - 1) + "|")  # one cell per header column
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for mode, r in audit["modes"].items():
        prof = r.get("profile") or {}
        reserved = r.get("peak_reserved_mib")
        lines.append(
            f"| {mode} | {f(r['step_times_s'][0] if r.get('step_times_s') else None, '.1f')} | "
            f"{f(r.get('step_time_ms'), '.1f')} | {f(r.get('tokens_per_s'), '.0f')} | "
            f"{f(r['peak_allocated_mib'] / GIB if r.get('peak_allocated_mib') else None, '.2f')} | "
            f"{f(reserved / GIB if reserved else None, '.2f')} | "
            f"{f(audit['fit'].get(mode, {}).get('batch', {}).get('largest'), 'd')} | "
            f"{f(prof['target_share'] * 100 if prof else None, '.1f')} | "
            f"{f(audit['divergence'].get(mode, {}).get('max_abs'), '.2e')} | {r.get('status', '')} |")
    if graphs_text(audit["modes"]):
        lines += ["", graphs_text(audit["modes"])]
    compared = render_lines(audit)  # between modes, eager's own spread (eager-rerun), --reference
    if compared:
        lines += ["", *compared]
    fx = audit["modes"].get("fxfuse") or {}
    if fx.get("removed") is not None:
        lines += ["", f"fxfuse fused {fx['report']['counts']}, {len(fx['report']['unmatched'])} unmatched; "
                      "activations no longer written per step: "
                  + ", ".join(f"{p} {agg['bytes_per_step'] / 2**30:.2f} GiB ({agg['sites']} sites)"
                              for p, agg in fx["removed"].items())
                  + "; fused outputs recomputed in backward instead of kept: "
                  + (", ".join(f"{p} {agg['recomputed_bytes_per_step'] / 2**30:.2f} GiB"
                               for p, agg in fx["removed"].items() if agg.get("recomputed_bytes_per_step"))
                     or "none")]
        if fx.get("post_grad"):
            lines.append(post_grad_text(fx["post_grad"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.add_argument("--models", default=",".join(CASES), help="comma-separated presets or model types")
    p.set_defaults(batch=None, seq=None, steps=50, warmup=10, fit="none", memory_peak=True,
                   out=os.path.join(os.environ.get("OUT", "."), "e2e"))
    args = p.parse_args(argv)
    sections, rc = [], 0
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        one = argparse.Namespace(**vars(args))
        one.model = model
        batch, seq = CASES.get(model, (4, 2048))  # --batch / --seq override the table's shape
        one.batch, one.seq = args.batch or batch, args.seq or seq
        one.out = os.path.join(args.out, model.replace("/", "_"))
        audit = run_audit(_finish(one))
        print(audit["table"], file=sys.stderr)
        sections.append(markdown(audit))
        print(sections[-1] + "\n", flush=True)
        rc |= any(str(r.get("status", "")).startswith("error") for r in audit["modes"].values())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "e2e.md"), "w") as fh:
        fh.write("\n\n".join(sections) + "\n")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
