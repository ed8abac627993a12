"""What transformers >= 5.25's checkpointed-layer graph break costs, and what Dynamo's remedy gives back:
Llama-3.2-1B-like (16 layers, hidden 2048, vocab 128256), every decoder layer checkpointed
(non-reentrant), bf16 weights, AdamW, one mode per process.

  python bench/bench_ckpt_side_effects.py fxfuse             # layers run eagerly (graph break)
  python bench/bench_ckpt_side_effects.py fxfuse --remedy    # skip_fwd_side_effects_in_bwd_under_checkpoint
  for m in eager liger inductor fxfuse; do ...; done          # one process each (Liger patches classes)

Prints one JSON line per run: median step ms after two warm-up steps, tokens/s, peak allocated MiB
(from step 2 on), the first three losses; for fxfuse also the report's counts (summed over every graph
compiled, the census's recompile included), the eager site modules fxfuse.explain's census found in
the first step and Dynamo's graph breaks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

MODES = ("eager", "inductor", "liger", "fxfuse")
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, tie_word_embeddings=True)


def tokens(batch: int, seq: int) -> int:
    return batch * seq


def build(mode: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if mode == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **LLAMA_1B)).to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def main(argv=None) -> dict:
    import transformers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--remedy", action="store_true", help="torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    if args.remedy:
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    model = build(args.mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (args.batch, args.seq), device="cuda")
    call, census = model, None
    if args.mode == "fxfuse":
        from fxfuse.outside import Census

        call, census = torch.compile(model, backend="fxfuse"), Census(model)
    elif args.mode == "inductor":
        call = torch.compile(model)
    times, losses = [], []
    for i in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = (census.around(call) if census is not None and i == 0 else call)(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        losses.append(round(loss.item(), 4))
        if i == 1:  # the census's hooks come off after step 0: step 1 recompiles
            torch.cuda.reset_peak_memory_stats()
    ms = 1e3 * statistics.median(times[2:])
    out = {"mode": args.mode, "remedy": args.remedy, "transformers": transformers.__version__, "torch": torch.__version__,
           "first_s": round(times[0], 1), "step_ms": round(ms, 1), "tokens_per_s": round(tokens(args.batch, args.seq) / ms * 1e3),
           "peak_alloc_mib": torch.cuda.max_memory_allocated() >> 20, "losses": losses[:3]}
    if census is not None:
        import fxfuse

        report = census.apply(fxfuse.Report.merge(fxfuse.compiled_reports()))
        out |= {"counts": report.counts(), "outside_sites": sum(s.graph == -1 for s in report.unmatched),
                "graph_breaks": [b[:100] for b in report.graph_breaks]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
