"""``fxfuse sweep``: ``fxfuse check --no-train`` over every causal-LM type the installed transformers
maps (``--task seq2seq-lm`` / ``masked-lm``: every encoder-decoder / encoder LM type), one subprocess
per type, so a crash or a hang costs that type alone. transformers adds architectures every month;
this tells which of them fxfuse fuses with parity, which it does not and why, and which could not run
from the zoo's tiny config (fxfuse.zoo.TINY, with HF_ZOO's overrides where the zoo has the type).
One line per type, then the counts; exit 1 if any type ran and did not pass (a gap, a false match or
a parity miss), not for types that could not run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from .options import INNER
from .report import PATTERN_NAMES
from .zoo import TASKS, task_types


def run_one(model_type: str, inner: str = "aot_eager", timeout: float = 600.0, task: str = "causal-lm") -> dict:
    """``fxfuse check MODEL_TYPE --no-train --json`` in a subprocess: its result dict, or
    {"error": why} when it printed none (an exception: its last line; a timeout; a crash)."""
    cmd = [sys.executable, "-m", "fxfuse", "check", model_type, "--no-train", "--inner", inner, "--json",
           "--task", task]
    return json_of(cmd, timeout, '{\n  "name"')  # the result (Result.to_dict, indented), after any other output


def json_of(cmd: list[str], timeout: float, opening: str) -> dict:
    """The JSON object cmd prints on stdout, from the last place its opening text appears (after any
    other output), or {"error": why} when it printed none: its stderr's last line (an exception), a
    timeout or a crash."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    start = done.stdout.rfind(opening)
    try:
        return json.loads(done.stdout[start:] if start >= 0 else "")
    except json.JSONDecodeError:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        return {"error": lines[-1].strip()[:300] if lines else f"exit {done.returncode}, no output"}


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


def sweep(types: list[str], inner: str = "aot_eager", jobs: int = 2, timeout: float = 600.0, out=sys.stdout,
          task: str = "causal-lm") -> int:
    """Print a line per type as each finishes (in types' order), then the counts; the exit code."""
    counts = {"PASS": 0, "NOT PASSED": 0, "ERROR": 0}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for t, result in zip(types, pool.map(lambda t: run_one(t, inner, timeout, task), types)):
            print(line(t, result), file=out, flush=True)
            counts[status(result).split(":")[0]] += 1
    print(f"{len(types)} types: {counts['PASS']} passed, {counts['NOT PASSED']} not passed, "
          f"{counts['ERROR']} could not run (inner={inner}, fp32 parity, no bf16 training)", file=out)
    return 1 if counts["NOT PASSED"] else 0


def sweep_cmd(args) -> int:
    types = args.types or task_types(args.task)
    return sweep(types, args.inner, args.jobs, args.timeout, task=args.task)


def register(sub) -> None:
    s = sub.add_parser("sweep", help="fxfuse check --no-train on every causal-LM (or --task) type of the installed "
                                     "transformers")
    s.add_argument("types", nargs="*", help="model types (default: every one the task's Auto class maps)")
    s.add_argument("--task", choices=list(TASKS), default="causal-lm",
                   help="causal-lm (default), seq2seq-lm (AutoModelForSeq2SeqLM) or masked-lm (AutoModelForMaskedLM)")
    s.add_argument("--inner", choices=INNER, default="aot_eager")
    s.add_argument("--jobs", type=int, default=2, help="types checked at once (default 2)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per type (default 600)")
    s.set_defaults(fn=sweep_cmd)
