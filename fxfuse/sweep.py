"""``fxfuse sweep``: ``fxfuse check --no-train`` over every causal-LM type the installed transformers
maps, one subprocess per type, so a crash or a hang costs that type alone. transformers adds
architectures every month; this tells which of them fxfuse fuses with parity, which it does not and
why, and which could not run from the zoo's tiny config (fxfuse.zoo.TINY, with HF_ZOO's overrides
where the zoo has the type). One line per type, then the counts; exit 1 if any type ran and did not
pass (a gap, a false match or a parity miss), not for types that could not run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from .options import INNER
from .report import PATTERN_NAMES


def causal_lm_types() -> list[str]:
    """Model types with an AutoModelForCausalLM class in the installed transformers, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_one(model_type: str, inner: str = "aot_eager", timeout: float = 600.0) -> dict:
    """``fxfuse check MODEL_TYPE --no-train --json`` in a subprocess: its result dict, or
    {"error": why} when it printed none (an exception: its last line; a timeout; a crash)."""
    cmd = [sys.executable, "-m", "fxfuse", "check", model_type, "--no-train", "--inner", inner, "--json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    start = done.stdout.rfind('{\n  "name"')  # the result (Result.to_dict, indented), after any other output
    try:
        return json.loads(done.stdout[start:] if start >= 0 else "")
    except json.JSONDecodeError:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        return {"error": lines[-1].strip() if lines else f"exit {done.returncode}, no output"}


def status(result: dict) -> str:
    """PASS, NOT PASSED (with what failed) or ERROR (could not run)."""
    if "error" in result:
        return "ERROR"
    failed = ([f"gap in {p}" for p in result["gaps"]] + [f"false match in {p}" for p in result["false_matches"]]
              + ([] if result["parity_ok"] else ["fp32 parity"]))
    return "NOT PASSED: " + ", ".join(failed) if failed else "PASS"


def line(model_type: str, result: dict) -> str:
    """One line: the type, its status and its a/b site cells (or the error)."""
    if "error" in result:
        return f"{model_type:28s} ERROR  {result['error'][:160]}"
    from .zoo import cell

    counts = SimpleNamespace(expected=result["expected"], matched=result["matched"])
    cells = [f"{p} {cell(counts, p)}" for p in PATTERN_NAMES]
    why = result["reasons"].get("graph_breaks", [])[:1] if result["gaps"] else []
    note = f"  (graph break: {why[0][:80]})" if why else ""
    return f"{model_type:28s} {status(result)}  " + ", ".join(cells) + note


def sweep(types: list[str], inner: str = "aot_eager", jobs: int = 2, timeout: float = 600.0, out=sys.stdout) -> int:
    """Print a line per type as each finishes (in types' order), then the counts; the exit code."""
    counts = {"PASS": 0, "NOT PASSED": 0, "ERROR": 0}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for t, result in zip(types, pool.map(lambda t: run_one(t, inner, timeout), types)):
            print(line(t, result), file=out, flush=True)
            counts[status(result).split(":")[0]] += 1
    print(f"{len(types)} types: {counts['PASS']} passed, {counts['NOT PASSED']} not passed, "
          f"{counts['ERROR']} could not run (inner={inner}, fp32 parity, no bf16 training)", file=out)
    return 1 if counts["NOT PASSED"] else 0


def sweep_cmd(args) -> int:
    types = args.types or causal_lm_types()
    return sweep(types, args.inner, args.jobs, args.timeout)


def register(sub) -> None:
    s = sub.add_parser("sweep", help="fxfuse check --no-train on every causal-LM type of the installed transformers")
    s.add_argument("types", nargs="*", help="model types (default: every one AutoModelForCausalLM maps)")
    s.add_argument("--inner", choices=INNER, default="aot_eager")
    s.add_argument("--jobs", type=int, default=2, help="types checked at once (default 2)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per type (default 600)")
    s.set_defaults(fn=sweep_cmd)
