"""DDP and FSDP2 with fxfuse: patch the model, then wrap it (or shard it) as usual.

    torchrun --nproc_per_node 2 examples/distributed.py --wrap ddp   [--inner inductor] [--check]
    torchrun --nproc_per_node 2 examples/distributed.py --wrap fsdp2 [--inner inductor] [--check] [--checkpointing]

Runs on CPU with gloo (no GPU needed) or on CUDA with NCCL (one GPU per rank). Each rank takes its
slice of one global batch; DDP and FSDP2 average the gradients over ranks, so every rank ends with
the gradients of the whole batch. ``--check`` compares the loss and every gradient with one eager,
single-process step on the whole batch (fp32 relative error < 1e-5; under FSDP2 each rank compares
its own shard) and prints the fxfuse report of rank 0.

DDP: ``DDP(fxfuse.patch(model), bucket_cap_mb=...)``. Dynamo's DDPOptimizer splits the graph at
bucket boundaries so gradient all-reduces overlap the backward; fxfuse compiles each piece (one
report per piece; a site cut by a boundary stays unfused, with the reason in the report).
FSDP2: ``fully_shard`` each decoder layer and the root, then ``fxfuse.patch(model)``. Dynamo skips
FSDP2's unshard / reshard hooks (``torch._dynamo.config.skip_fsdp_hooks``), so each layer's forward
sees whole (unsharded) parameters and is fused like an unsharded model.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import fxfuse
from fxfuse.audit_worker import enable_checkpointing

# ~2 MB of fp32 parameters: more than DDP's first bucket (1 MiB), so 1 MB buckets split the graph
CONFIG = dict(vocab_size=96, hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=64, use_cache=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model(model_type: str = "llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **CONFIG))


def global_batch(world: int, per_rank: int = 2, seq: int = 9) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CONFIG["vocab_size"], (world * per_rank, seq), generator=g)
    return {"input_ids": ids, "labels": ids}


def wrap(model, how: str, device: torch.device, inner: str, find_unused: bool = False):
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        fxfuse.patch(model, inner=inner)
        # 1 MB buckets (Dynamo needs them >= DDP's 1 MiB first bucket): this small model is split into
        # several graphs, as a large one is at the default 25 MB. find_unused_parameters: DDP passes
        # every output (the returned logits too) through its sink, whose backward reaches them
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=1,
                   find_unused_parameters=find_unused)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return fxfuse.patch(model, inner=inner)


def full_grads(model) -> dict:
    """name -> gradient; FSDP2's DTensor shards become this rank's local shard."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[n] = (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
    return out


def local_shard(ref: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The rows of a full reference tensor this rank holds under FSDP2's dim-0 sharding."""
    if ref.shape == like.shape:
        return ref
    rows = -(-ref.shape[0] // dist.get_world_size())
    start = dist.get_rank() * rows
    return ref[start:start + like.shape[0]]


def rel_err(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wrap", choices=["ddp", "fsdp2"], required=True)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--inner", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every decoder layer")
    ap.add_argument("--find-unused", action="store_true", help="DDP with find_unused_parameters=True")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = build_model(args.model).to(device)
    reference = copy.deepcopy(model) if args.check else None
    if args.checkpointing:
        enable_checkpointing(model)
    batch = {k: v.to(device) for k, v in global_batch(world).items()}
    mine = {k: v.chunk(world)[rank] for k, v in batch.items()}

    wrapped = wrap(model, args.wrap, device, args.inner, args.find_unused)
    loss = wrapped(**mine).loss
    loss.backward()
    report = fxfuse.patch_report(model)
    if rank == 0:
        print(report)
    if not args.check:
        dist.destroy_process_group()
        return
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    grads = full_grads(model)
    losses = [torch.zeros((), device=device) for _ in range(world)]
    dist.all_gather(losses, loss.detach())
    # equal-size slices with no ignored labels: the global mean loss is the mean of the rank losses
    loss_err = rel_err(torch.stack(losses).mean(), ref_loss)
    assert grads.keys() == ref_grads.keys(), sorted(set(ref_grads) ^ set(grads))
    grad_err = max(rel_err(g, local_shard(ref_grads[n], g)) for n, g in grads.items())
    counts = report.counts()
    print(f"rank {rank}: loss rel err {loss_err:.2e}, worst grad rel err {grad_err:.2e}, "
          f"graphs {len(model.__dict__['_fxfuse_patch'].reports)}, counts {counts}", flush=True)
    assert loss_err < 1e-5 and grad_err < 1e-5, (loss_err, grad_err)
    assert counts["rms_norm"] > 0, counts
    dist.barrier()  # both ranks done before either closes its gloo pairs: a rank that tore down while
    dist.destroy_process_group()  # the other still used them aborted once under a loaded CI machine


if __name__ == "__main__":
    main()
