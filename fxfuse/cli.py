"""``fxfuse`` command line.

  fxfuse demo [--model llama] [--device cpu|cuda] [--dtype float32|bfloat16]
      build a small HF model from config, compile it with backend="fxfuse", print the match report
      and an eager-vs-fxfuse parity line for the loss and every gradient.
  fxfuse explain MODEL [--json]
      the report only (MODEL: an HF model type such as "qwen2", or a config.json path).
  fxfuse check MODEL / fxfuse sweep [TYPES...]
      the harness on one architecture / on every causal-LM type of the installed transformers.
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch

from .options import INNER

# sizes on top of fxfuse.zoo.TINY: large enough to show the saved bytes, small enough for a CPU
DEMO_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, head_dim=16, max_position_embeddings=128)


def build_model(spec: str, dtype: torch.dtype, device: str):
    """An HF causal LM with random weights from a model type ("llama", DEMO_CONFIG sizes on top of the
    zoo's per-architecture settings) or a config.json path."""
    from transformers import AutoModelForCausalLM

    from .zoo import hf_config

    cfg = hf_config(spec) if spec.endswith(".json") else hf_config(spec, **DEMO_CONFIG)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype)


def _inputs(model, device: str, batch: int = 2, seq: int = 32) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def demo(args) -> int:
    import fxfuse

    from .harness import grad_error, rel_err, step
    from .outside import Census

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, dtype, device)
    inputs = _inputs(model, device)
    ref_loss, ref_grads = step(model, model, inputs)
    mine = copy.deepcopy(model)
    n0 = len(fxfuse.compiled_reports())
    compiled = torch.compile(mine, backend="fxfuse", options={"inner": args.inner})
    census = Census(mine)
    loss, grads = step(mine, census.around(compiled), inputs)
    report = census.apply(fxfuse.Report.merge(fxfuse.compiled_reports()[n0:]))
    print(report)
    worst = grad_error(grads, ref_grads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ok = rel_err(loss, ref_loss) < tol and worst < tol
    print(f"parity ({args.model}, {device}, {args.dtype}, inner={args.inner}): loss eager {ref_loss.item():.6f} "
          f"fxfuse {loss.item():.6f} rel err {rel_err(loss, ref_loss):.2e}; worst of {len(ref_grads)} gradients "
          f"rel err {worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


def explain_cmd(args) -> int:
    import fxfuse

    model = build_model(args.model, torch.float32, "cpu")
    report = fxfuse.explain(model, **_inputs(model, "cpu"))
    print(report.to_json() if args.json else report)
    return 0


def register(sub) -> None:
    d = sub.add_parser("demo", help="compile a small HF model with fxfuse: report + parity")
    d.add_argument("--model", default="llama", help="HF model type or config.json path (default llama)")
    d.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    d.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    d.add_argument("--inner", choices=INNER, default="inductor")
    d.set_defaults(fn=demo)
    e = sub.add_parser("explain", help="print what fxfuse would fuse in a model")
    e.add_argument("model", help="HF model type or config.json path")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=explain_cmd)


# modules whose register(subparsers) adds their subcommands
COMMANDS = ("fxfuse.cli", "fxfuse.zoo", "fxfuse.sweep", "fxfuse.audit")


def main(argv=None) -> int:
    import importlib

    p = argparse.ArgumentParser(prog="fxfuse", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).register(sub)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
