"""FSDP2 training step on 2 GPUs, bf16, Llama-3.2-1B-like, eager vs Inductor vs Liger (eager) vs
fxfuse: peak memory per GPU and median step time (results: bench/RESULTS.md).

    torchrun --nproc_per_node 2 examples/fsdp2_bench.py --impl eager|inductor|liger|fxfuse [--batch 4 --seq 2048] [--checkpointing]
    bash bench/run_all.sh fsdp2      # all four, one after the other (on the 2-GPU device kind)
    torchrun --nproc_per_node 2 examples/fsdp2_bench.py --impl fxfuse --smoke   # CPU, gloo, tiny model

Each rank shards every decoder layer and the root with ``fully_shard`` (bf16 params, fp32 reduce),
runs --warmup + --steps AdamW steps on random tokens and prints, on rank 0, one line
``impl, step ms (median), peak GiB per GPU (max over ranks), loss``. Liger runs eagerly
(``apply_liger_kernel_to_llama`` before building the model; its kernels under torch.compile gave a
wrong loss or crashed in DESIGN.md's runs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
                rope_theta=500000.0, tie_word_embeddings=True, use_cache=False)


SMOKE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)  # --smoke: the same script on CPU (tests/test_distributed.py)


def build(impl: str, device: torch.device, smoke: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    if impl == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of ~20 s on the CPU
        cfg = AutoConfig.for_model("llama", **{**LLAMA_1B, **(SMOKE if smoke else {})})
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model if smoke else model.to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=["eager", "fxfuse", "inductor", "liger"], required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny fp32 model, aot_eager: checks the script")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every decoder layer")
    args = ap.parse_args()
    dist.init_process_group("gloo" if args.smoke else "nccl")
    rank = dist.get_rank()
    if args.smoke:
        device = torch.device("cpu")
        args.batch, args.seq, args.warmup, args.steps = 2, 16, 1, 2
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(args.impl, device, args.smoke)
    if args.checkpointing:
        from fxfuse.audit_worker import enable_checkpointing

        enable_checkpointing(model)
    low = torch.float32 if args.smoke else torch.bfloat16
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if args.impl == "fxfuse":
        import fxfuse

        # the step reads only the loss: returned logits are not computed (Liger returns none in training)
        fxfuse.patch(model, logits="skip", **({"inner": "aot_eager"} if args.smoke else {}))
    elif args.impl == "inductor":
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=not args.smoke)
    g = torch.Generator(device=device).manual_seed(rank)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times, loss = [], None
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device, generator=g)
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if i == args.warmup - 1 and not args.smoke:
            torch.cuda.reset_peak_memory_stats()
    peak = torch.tensor(0.0 if args.smoke else torch.cuda.max_memory_allocated() / 2**30, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"{args.impl}{' + AC' if args.checkpointing else ''}, {1e3 * statistics.median(times):.1f} ms/step, "
              f"{peak.item():.2f} GiB/GPU, loss {loss.item():.4f}")
        if args.impl == "fxfuse":
            print(fxfuse.patch_report(model))
    # both ranks at the end before the group goes: a rank tearing gloo down while its peer was still
    # printing aborted once in CI under load ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
