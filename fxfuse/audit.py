"""``fxfuse audit``: the user's own before/after, measured the way a careful practitioner would.

  fxfuse audit --model llama-1b --batch 4 --seq 2048 --steps 200 --compare eager,inductor,liger,fxfuse

Each mode trains the same model (same seed or checkpoint, same batches in the same order, same AdamW,
same dtype) in its own process (fxfuse/audit_worker.py), so no mode inherits another's allocator
state, compiled code or warm caches. The parent prints one table and writes ``audit.json`` (everything),
``audit.txt`` (the table) and ``audit.png`` (loss and memory curves; needs matplotlib) to ``--out``:

- peak allocated and reserved memory (CUDA allocator), or peak RSS of the process on CPU;
- step time at fixed batch and sequence length, median over the steps after ``--warmup``, tokens/s;
- the largest batch (and with ``--fit both|seq`` the largest sequence length) that trains, found by
  doubling from the run's own ``--batch`` (``--seq``) then bisection (below it if it does not fit),
  up to ``--max-batch-search`` (``--max-seq-search``). The batch search runs in one
  worker process per mode (job "fit_batch"): model, compiled code and AdamW are built once and the
  batch dimension of input_ids is dynamic, so a compiled mode compiles once, not once per probe; an OOM
  fails a probe and is cleaned up in-process, a killed worker is reported as died (with the probes
  done so far). Dynamic-shape graphs can differ from the run's static ones (the table says what
  fused in them): ``--fit-shapes static`` compiles
  once per probed batch instead, still in one process. The sequence search runs every
  probe in its own process (each recompiles);
- the share of step time in the target ops (torch.profiler; attribution rule in audit_profile.py);
- the loss curve of every mode, its largest divergence from eager's, and between the other modes;
  mode ``eager-rerun`` trains eager again (eager is not bit-reproducible on CUDA: its own spread is
  the noise floor of "within X of eager"), ``--reference AUDIT_JSON`` compares every curve to an
  earlier run's eager one at another precision (fxfuse/audit_compare.py); mode ``eager-fp32-head``
  is eager with the lm_head output upcast to fp32 before the model's logit ops (the fused heads'
  numerics: tells a loss-head rounding difference from the rest);
- fxfuse's report and the saved activations it removed, per pattern, largest first.

Data: synthetic tokens by default, ``--synthetic uniform`` (nothing to learn: near ln(vocab) the
steps follow gradient noise, and bf16 rounding differences between modes grow into loss spikes at
different steps) or ``--synthetic zipf`` (token frequencies ~ 1/rank, as in text: a loss that keeps
falling); ``--tokens FILE`` for real data. ``--lr-warmup N``: linear warm-up over the first N steps.
``--autocast bfloat16``: fp32 master weights, forward under bf16 autocast (HF Trainer's bf16=True).
``--checkpointing``: activation checkpointing of every decoder layer, in every mode.
Inputs as a collator passes them: ``--attention-mask ones|padded`` (all ones, or right-padded rows
with labels -100 on the padding), ``--seq-lengths`` (steps cycle through these lengths), ``--dynamic``
(torch.compile(dynamic=True)); the table counts each compiled mode's graphs and the paths fxfuse's
run-time mask checks took.

``--fxfuse-option KEY=VALUE`` (repeatable) passes more backend options to the fxfuse mode, e.g.
``--fxfuse-option loss_head=fast``; the table's header and audit.json's args show them.

Model: a preset (llama-1b, qwen2-1.5b, gemma2-2b: the shapes of DESIGN.md's table), an HF model type,
a config.json or a local checkpoint folder; ``--tiny`` shrinks it for a CPU smoke run.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time

from .audit_compare import divergence, load_reference, pairwise_divergence, reference_divergence
from .audit_plot import plot_png
from .audit_render import render
from .audit_fit import search_largest
from .audit_data import MASKS, SYNTHETIC
from .audit_worker import MODES, PRESETS
from .options import INNER


def run_worker(spec: dict, timeout: float | None = None, cold: bool = False) -> dict:
    """Run one worker process on ``spec`` and return its result dict (an error dict if it died).
    ``cold``: the worker gets empty Inductor and Triton cache folders, so it compiles from scratch."""
    with tempfile.TemporaryDirectory(prefix="fxfuse_audit_") as tmp:
        env = None
        if cold:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
                   "TRITON_CACHE_DIR": os.path.join(tmp, "triton")}
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", "fxfuse.audit_worker", spec_path, out_path]
        try:  # the worker's output (progress bar) goes to our stderr, keeping stdout for the table
            err = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            err = None
        try:
            proc = subprocess.run(cmd, timeout=timeout, stdout=err, env=env)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if os.path.exists(out_path):
            with open(out_path) as f:
                result = json.load(f)
            if result.get("status") == "running":  # fit_batch killed mid-search: its probes so far
                result["status"] = f"error: worker process died (rc {rc}) during the search"
            return result
    return {"mode": spec["mode"], "status": f"error: worker process died (rc {rc})", "fits": False,
            "reason": f"worker process died (rc {rc}; an OOM kill looks like this)"}


def _base_spec(args) -> dict:
    return dict(model=args.model, config=args.config, tiny=args.tiny, dtype=args.dtype, device=args.device,
                batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup, lr=args.lr, seed=args.seed,
                lr_warmup=args.lr_warmup, tokens=args.tokens, synthetic=args.synthetic, autocast=args.autocast,
                checkpointing=args.checkpointing, attention_mask=args.attention_mask,
                seq_lengths=args.seq_lengths, dynamic=args.dynamic,
                profile_steps=args.profile_steps, fxfuse_inner=args.fxfuse_inner,
                fxfuse_logits=args.fxfuse_logits, fxfuse_options=args.fxfuse_options,
                memory_peak=args.memory_peak, mem_limit_gib=args.mem_limit_gib, fit_shapes=args.fit_shapes)


def batch_search(args, mode: str) -> dict:
    """Largest batch at --seq for one mode: one worker process (job fit_batch) builds and compiles the
    model once and probes every batch in-process, batch dimension dynamic (audit_fit.fit_batch)."""
    cap = args.max_batch_search
    spec = {**_base_spec(args), "job": "fit_batch", "mode": mode, "max_batch_search": cap}
    r = run_worker(spec, args.timeout)
    probes = r.get("probes", [])
    return {"largest": r.get("largest") if r.get("status") == "ok" else None, "cap": cap, "granule": 1,
            "status": r.get("status", ""), "trials": [[p["batch"], p["fits"]] for p in probes],
            "probes": probes, "failures": {p["batch"]: p["reason"] for p in probes if p.get("reason")},
            **({"report": r["report"]} if r.get("report") else {})}


def fit_search(args, mode: str) -> dict:
    """Largest batch at --seq (batch_search: one process) and/or largest sequence (multiples of a
    granule) at --batch (one process per probe) for one mode; both start at the run's own shape."""
    out = {}
    for what in ("batch", "seq"):
        if args.fit not in (what, "both"):
            continue
        cap = args.max_batch_search if what == "batch" else args.max_seq_search
        if cap <= 0:
            continue
        if what == "batch":
            out["batch"] = batch_search(args, mode)
            continue
        granule = min(128, args.seq)
        reasons = {}

        def fits(n: int) -> bool:
            spec = {**_base_spec(args), "job": "fit", "mode": mode, "seq": n * granule}
            r = run_worker(spec, args.timeout)
            if not r.get("fits"):
                reasons[n * granule] = r.get("reason") or r.get("status", "")
            return bool(r.get("fits"))

        best, trials = search_largest(fits, cap // granule, args.seq // granule)
        out["seq"] = {"largest": best * granule, "cap": cap, "granule": granule,
                      "trials": [[n * granule, ok] for n, ok in trials], "failures": reasons}
    return out


def run_audit(args) -> dict:
    """Every requested mode in its own process, then the fit searches; writes the outputs; returns the audit."""
    import torch

    modes = [m.strip() for m in args.compare.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"fxfuse audit: unknown mode(s) {bad}; valid: {MODES}")
    reference = load_reference(args.reference, vars(args)) if args.reference else None  # fail before the runs
    os.makedirs(args.out, exist_ok=True)
    env = {"torch": torch.__version__, "python": sys.version.split()[0], "device": args.device,
           "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.device.startswith("cuda") and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
    results, fit = {}, {}
    for mode in modes:
        print(f"fxfuse audit: running {mode} ...", file=sys.stderr, flush=True)
        results[mode] = run_worker({**_base_spec(args), "job": "run", "mode": mode}, args.timeout, args.cold_compile)
    for mode in modes:
        if args.fit != "none" and results[mode].get("status") == "ok":
            print(f"fxfuse audit: largest {args.fit} search for {mode} ...", file=sys.stderr, flush=True)
            fit[mode] = fit_search(args, mode)
    audit = {"args": vars(args) | {"fn": None}, "env": env, "modes": results, "divergence": divergence(results),
             "pairwise": pairwise_divergence(results),
             "fit": fit}
    if reference:
        audit["reference"] = {**reference, "divergence": reference_divergence(results, reference)}
    audit["table"] = render(audit)
    mem_label = "peak allocated MiB per step" if args.device.startswith("cuda") else "RSS MiB after each step"
    audit["png"] = plot_png(results, os.path.join(args.out, "audit.png"), mem_label)
    with open(os.path.join(args.out, "audit.json"), "w") as f:
        json.dump(audit, f, indent=1)
    with open(os.path.join(args.out, "audit.txt"), "w") as f:
        f.write(audit["table"] + "\n")
    return audit


def _ints(s: str) -> list[int]:
    try:
        return [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _kv(s: str):
    """KEY=VALUE -> (key, value): VALUE as a Python literal (4, 1e-5, False, 'x', [..], {..}), else as
    JSON (true, null), else the string itself."""
    key, eq, val = s.partition("=")
    if not key or not eq:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    try:
        return key, ast.literal_eval(val)
    except (ValueError, SyntaxError):
        pass
    try:
        return key, json.loads(val)
    except json.JSONDecodeError:
        return key, val


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-1b",
                   help=f"preset ({', '.join(PRESETS)}), HF model type, config.json or checkpoint folder")
    p.add_argument("--config", type=_kv, action="append", default=[], metavar="KEY=VALUE",
                   help="config override (repeatable), e.g. --config num_hidden_layers=4")
    p.add_argument("--tiny", action="store_true", help="small config for a CPU smoke run")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    p.add_argument("--compare", default="eager,inductor,liger,fxfuse", help=f"comma-separated, of {MODES}")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--autocast", default=None, choices=["bfloat16"],
                   help="mixed precision: weights, grads and AdamW states in --dtype (give float32), the "
                        "forward under torch.autocast(bfloat16), as HF Trainer's bf16=True")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every decoder layer (non-reentrant), in every mode")
    p.add_argument("--attention-mask", default="none", choices=MASKS,
                   help="what the batches pass as attention_mask: none (default: the model builds its causal "
                        "mask), ones (all ones, as a collator when nothing is padded), padded (right-padded "
                        "rows of seeded lengths in [seq/2, seq], labels -100 on the padding)")
    p.add_argument("--seq-lengths", type=_ints, default=None, metavar="L1,L2,...",
                   help="step i trains at sequence length L[i %% k] instead of --seq (batches padded to "
                        "their longest sample); the compiled modes recompile once for a dynamic length")
    p.add_argument("--dynamic", action="store_true",
                   help="torch.compile(dynamic=True) in the compiled modes (default: Dynamo's automatic "
                        "dynamic shapes)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--lr-warmup", type=int, default=0, metavar="STEPS",
                   help="linear learning-rate warm-up over the first STEPS steps (default 0: constant lr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--synthetic", default="uniform", choices=SYNTHETIC,
                   help="synthetic tokens without --tokens: uniform (nothing to learn) or zipf (p ~ 1/rank)")
    p.add_argument("--tokens", default=None, help="token file (.npy, .pt, raw uint16 .bin); default synthetic")
    p.add_argument("--profile-steps", type=int, default=2, help="extra profiled steps (0: no profile)")
    p.add_argument("--fxfuse-inner", default="inductor", choices=INNER)
    p.add_argument("--memory-peak", action="store_true",
                   help="CUDA: one extra step with the allocator history on; prints what is alive at the "
                        "memory peak, by allocating source line, per mode")
    p.add_argument("--fxfuse-logits", default="skip", choices=["skip", "exact"],
                   help="fxfuse's logits option: the step reads only the loss, so by default the logits the "
                        "model returns are not computed (Liger returns none in training either)")
    p.add_argument("--fxfuse-option", dest="fxfuse_options", type=_kv, action="append", default=[],
                   metavar="KEY=VALUE", help="more fxfuse backend options (repeatable; Python literals), e.g. "
                   "--fxfuse-option loss_head=fast --fxfuse-option causal_attention=False")
    p.add_argument("--fit", default=None, choices=["none", "batch", "seq", "both"],
                   help="search the largest batch at --seq and/or the largest seq at --batch "
                        "(default: batch on cuda, none on cpu)")
    p.add_argument("--fit-shapes", default="dynamic", choices=["dynamic", "static"],
                   help="batch search: dynamic batch dimension, compiled once (default), or static shapes, "
                        "one compile per trial (the run's exact graphs: under a dynamic batch fxfuse checks "
                        "the causal mask at run time instead of proving it at compile time)")
    p.add_argument("--max-batch-search", type=int, default=256, help="batch search cap (0: skip)")
    p.add_argument("--max-seq-search", type=int, default=32768, help="sequence search cap (0: skip)")
    p.add_argument("--mem-limit-gib", type=float, default=None, help="CUDA memory cap for every mode")
    p.add_argument("--timeout", type=float, default=None, help="seconds per worker process")
    p.add_argument("--cold-compile", action="store_true",
                   help="every mode compiles with empty Inductor / Triton caches: the first step's time is a "
                        "cold compile, not a cache hit of an earlier mode or run")
    p.add_argument("--reference", default=None, metavar="AUDIT_JSON",
                   help="an earlier audit.json of the same run (model, seed, data, lr) at another precision, e.g. "
                        "--dtype float32 --compare eager: every mode's loss curve is also compared to its eager one")
    p.add_argument("--show-losses", type=int, default=10, help="loss-curve steps printed in the table")
    p.add_argument("--out", default="fxfuse_audit", help="folder for audit.json, audit.txt, audit.png")


def _finish(args) -> argparse.Namespace:
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 weights on CUDA by default; fp32 master weights under --autocast and on CPU
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") and not args.autocast else "float32")
    args.fit = args.fit or ("batch" if args.device.startswith("cuda") else "none")
    args.config = dict(args.config)
    args.fxfuse_options = dict(args.fxfuse_options)
    return args


def audit_cmd(args) -> int:
    audit = run_audit(_finish(args))
    print(audit["table"])
    print(audit["png"])
    print(f"wrote {os.path.join(args.out, 'audit.json')}")
    failed = [m for m, r in audit["modes"].items() if str(r.get("status", "")).startswith("error")]
    return 1 if failed else 0


def register(sub) -> None:
    p = sub.add_parser("audit", help="before/after training audit: eager / inductor / liger / fxfuse",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(fn=audit_cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxfuse.audit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return audit_cmd(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
