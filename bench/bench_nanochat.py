"""A hand-written model end to end: training steps of tests/models.py's NanoChatLM (nanochat's
structure: functional weightless RMSNorm, q / k norms after RoPE by -angle on halves, relu^2 MLP, a
padded lm_head sliced to the vocabulary, .float() then softcap 15), bf16 weights, AdamW.

Providers side by side in one process, each on a fresh copy of the same weights and the same
batches: eager, inductor, fxfuse (torch.compile(backend="fxfuse"), its defaults), and
fxfuse:P1,P2 (only those patterns fused, e.g. fxfuse:linear_cross_entropy). Liger has no
entry: its patches target HF model classes by name, and a hand-written model has none
(``liger_kernel.transformers`` would leave it untouched), so its column would be eager's.

    python3 bench/bench_nanochat.py                     # d12-like: 768 wide, 12 layers, 8 x 2048 tokens
    python3 bench/bench_nanochat.py --dim 64 --layers 2 --heads 2 --kv-heads 2 --vocab 1000 \
        --batch 2 --seq 64 --steps 3 --warmup 1 --device cpu     # a smoke run

Columns: median step time after warmup (ms) and tokens/s; MiB+ is the peak allocated during the
steps above the parameters (optimizer states included, the same in every mode); loss is the first
and the last step's, and the largest relative difference from eager's loss over the steps.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from models import NanoChatLM  # noqa: E402

PROVIDERS = ("eager", "inductor", "fxfuse")


def provider(name: str) -> str:
    """eager, inductor, fxfuse, or fxfuse:P1,P2 (a subset of fxfuse's patterns)."""
    from fxfuse.options import PATTERN_NAMES

    base, _, pats = name.partition(":")
    if base not in PROVIDERS or (pats and (base != "fxfuse" or not set(pats.split(",")) <= set(PATTERN_NAMES))):
        raise argparse.ArgumentTypeError(f"{name!r}: expected one of {PROVIDERS} or fxfuse:P1,P2 of {PATTERN_NAMES}")
    return name


def compiled(model, name: str, mode: str | None):
    if name == "eager":
        return model
    if name == "inductor":
        return torch.compile(model, mode=mode)
    from torch._inductor import list_mode_options

    pats = name.partition(":")[2]
    # torch.compile takes a mode or options, not both: the mode's Inductor settings go in as options
    options = {"inductor_config": list_mode_options(mode)} if mode not in (None, "default") else {}
    return torch.compile(model, backend="fxfuse", options=options | ({"patterns": pats.split(",")} if pats else {}))


def top_kernels(step, n: int) -> str:
    """The n kernels with the most GPU time in one step, with their share."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events)
    events.sort(key=lambda e: -e.device_time_total)
    share = lambda e: 100 * e.device_time_total / total  # noqa: E731
    return "\n".join(f"    {e.device_time_total / 1e3:8.2f} ms {share(e):5.1f}%  {e.count:4d}x  "
                     f"{e.key[:90]}" for e in events[:n]) + f"\n    {total / 1e3:8.2f} ms in all"


def model_flops_per_token(model: NanoChatLM, seq: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters (the embedding is a gather) plus attention's
    12 x layers x dim x seq (causal halves the score and value products of fwd + bwd)."""
    params = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("wte"))
    dim, layers = model.lm_head.in_features, len(model.blocks)
    return 6 * params + 12 * layers * dim * seq / 2


def batches(vocab: int, batch: int, seq: int, steps: int, device: str) -> list[dict]:
    out = []
    for i in range(steps):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(i))
        out.append({"input_ids": ids[:, :-1].to(device), "labels": ids[:, 1:].contiguous().to(device)})
    return out


def run(provider: str, args, data: list[dict]) -> dict:
    gc.collect()  # the previous provider's model, optimizer and compiled code
    if args.device == "cuda":
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = NanoChatLM(vocab=args.vocab, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads,
                       layers=args.layers, max_seq=args.seq).to(args.device, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=args.device == "cuda")
    step_fn = compiled(model, provider, args.mode)
    import fxfuse

    n0 = len(fxfuse.compiled_reports())
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    losses, times = [], []

    def step(batch):
        loss = step_fn(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # a sync: the step is done

    for batch in data:
        t0 = time.perf_counter()
        losses.append(step(batch))
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    profile = top_kernels(lambda: step(data[-1]), args.profile) if args.profile and cuda else ""
    report = ""
    if provider.startswith("fxfuse"):
        counts = fxfuse.Report.merge(fxfuse.compiled_reports()[n0:]).counts()
        report = ", ".join(f"{k} {v}" for k, v in counts.items())
    ms = 1e3 * statistics.median(times[args.warmup:])
    flops = model_flops_per_token(model, args.seq)
    torch._dynamo.reset()
    return {"ms": ms, "peak": peak, "losses": losses, "report": report, "flops": flops, "profile": profile}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=65000, help="padded to a multiple of 64 in the lm_head")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median (compile included)")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), type=provider)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the steps, profile one more and print its N costliest GPU kernels (CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default=None, choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"],
                   help="torch.compile mode of the compiled providers (reduce-overhead: CUDA graphs)")
    args = p.parse_args()
    data = batches(args.vocab, args.batch, args.seq, args.steps, args.device)
    tokens = args.batch * args.seq
    results = {name: run(name, args, data) for name in args.providers}
    ref = results.get("eager")
    print(f"NanoChatLM dim {args.dim} layers {args.layers} heads {args.heads}/{args.kv_heads} vocab {args.vocab} "
          f"batch {args.batch} x {args.seq}, bf16, AdamW, {args.steps} steps (median after {args.warmup})"
          f"{', mode ' + args.mode if args.mode else ''}")
    print("| provider | step ms | tokens/s | TFLOP/s | MiB+ | loss step 0 | loss last | max rel diff vs eager |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])) if ref else float("nan")
        tflops = r["flops"] * tokens / (r["ms"] / 1e3) / 1e12
        print(f"| {name} | {r['ms']:.1f} | {tokens / (r['ms'] / 1e3):,.0f} | {tflops:.0f} | {r['peak']:.0f} | "
              f"{r['losses'][0]:.4f} | {r['losses'][-1]:.4f} | {diff:.2e} |")
    print("| liger | n/a: no patch for a hand-written model |  |  |  |  |  |  |")
    for name, r in results.items():
        if r["report"]:
            print(f"{name} sites: {r['report']}")
        if r["profile"]:
            print(f"{name}, one step's costliest GPU kernels:\n{r['profile']}")


if __name__ == "__main__":
    main()
