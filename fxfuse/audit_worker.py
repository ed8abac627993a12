"""One mode of ``fxfuse audit`` in its own process: ``python -m fxfuse.audit_worker SPEC.json OUT.json``.

SPEC is a dict written by the parent (fxfuse/audit.py): ``job`` ("run": the timed training run;
"fit": does one (batch, seq) train at all; "fit_batch": the whole largest-batch search in this one
process, see fxfuse/audit_fit.py), ``mode`` (one of MODES), the model spec and config
overrides, dtype, device, batch, seq, steps, warmup, lr, seed, token file, attention_mask, seq_lengths,
dynamic, profile_steps, fxfuse_inner, fxfuse_logits, fxfuse_options (more backend options),
mem_limit_gib, max_batch_search and fit_shapes (fit_batch). Every mode builds the same model from the same seed, sees
the same batches in the same order and trains with the same AdamW; only the way the model is run
differs. The result dict is written to OUT as JSON; an error is written there too (the parent shows
it in the mode's row), so only a hard crash (OOM killer, segfault) leaves OUT missing, or, for
fit_batch, holding the probes done so far with status "running".
"""
from __future__ import annotations

import json
import os
import re
import resource
import statistics
import sys
import time
import traceback

import torch

from .audit_data import Batches
from .audit_plot import Progress
from .audit_profile import profile_shares, removed_tensors

# Shapes of the end-to-end table in DESIGN.md (HF configs of the public checkpoints, random weights).
PRESETS = {
    "llama-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                               rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)),
    "qwen2-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                                 rope_theta=1000000.0, max_position_embeddings=8192, rms_norm_eps=1e-6)),
    "gemma2-2b": ("gemma2", dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                 query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                                 attn_logit_softcapping=50.0, max_position_embeddings=8192)),
}
# eager-rerun: eager again (its own run-to-run spread); eager-fp32-head: eager with the lm_head output
# upcast to fp32 before the model's softcap / scale / loss (the numerics of fused loss heads)
MODES = ("eager", "inductor", "liger", "fxfuse", "eager-rerun", "eager-fp32-head")


def device_index(device: str, current) -> int:
    """Index of a "cuda[:N]" device; plain "cuda" is current() (set_per_process_memory_fraction
    refuses a device without an index: the first H200 run of --mem-limit-gib failed on that)."""
    index = torch.device(device).index
    return current() if index is None else index


def build_model(spec: str, overrides: dict, tiny: bool, dtype: torch.dtype, device: str, seed: int):
    """HF causal LM from a preset name, an HF model type, a config.json path or a local checkpoint folder.

    A checkpoint folder with weights loads them (same weights in every mode); everything else gets
    random weights from ``seed``. ``tiny`` applies the demo's small config (CPU smoke runs), then
    ``overrides`` apply on top.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from .cli import DEMO_CONFIG

    extra = {**(DEMO_CONFIG if tiny else {}), **overrides, "use_cache": False}
    torch.manual_seed(seed)
    if os.path.isdir(spec):
        weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(spec))
        if weights:
            model = AutoModelForCausalLM.from_pretrained(spec, torch_dtype=dtype, **extra)
            return model.to(device)
        cfg = AutoConfig.from_pretrained(spec, **extra)
    elif spec.endswith(".json"):
        cfg = AutoConfig.from_pretrained(spec, **extra)
    elif spec in PRESETS:
        model_type, preset = PRESETS[spec]
        cfg = AutoConfig.for_model(model_type, **{**preset, **extra})
    else:
        cfg = AutoConfig.for_model(spec, **extra)
    with torch.device(device):  # random init on the device: a 1B model takes seconds, not ~20 s on the CPU
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype=dtype)


def lr_schedule(opt, warmup_steps: int):
    """Linear warm-up of every group's lr over the first ``warmup_steps`` steps (step i trains at
    lr * (i + 1) / warmup_steps), constant after; None when warmup_steps is 0 (constant lr)."""
    if warmup_steps <= 0:
        return None
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup_steps))


def fxfuse_options(spec: dict) -> dict:
    """The backend options the fxfuse mode compiles with, from a spec (or the audit's args as a dict):
    --fxfuse-inner, --fxfuse-logits, then every --fxfuse-option on top. The training step reads only
    the loss, so logits default to "skip", as Liger in training (its forward returns no logits then);
    the backend checks the options when it first compiles (an unknown one raises, listing the valid ones)."""
    return {"inner": spec.get("fxfuse_inner", "inductor"), "logits": spec.get("fxfuse_logits", "skip"),
            **(spec.get("fxfuse_options") or {})}


def prepare(mode: str, model, options: dict, dynamic: bool | None = None):
    """The callable that runs ``model`` in ``mode``; liger patches the model in place (eager);
    fxfuse compiles with ``options`` (fxfuse_options). ``dynamic`` is torch.compile's (None: Dynamo's
    default, static shapes until a second shape is seen, then dynamic ones)."""
    if mode in ("eager", "eager-rerun"):
        return model
    if mode == "eager-fp32-head":
        head = model.get_output_embeddings()
        if head is None:
            raise ModeUnavailable("the model has no lm_head (get_output_embeddings() is None)")
        head.register_forward_hook(_upcast_output)
        return model
    if mode == "inductor":
        return torch.compile(model, dynamic=dynamic)
    if mode == "fxfuse":
        return torch.compile(model, backend="fxfuse", options=options, dynamic=dynamic)
    if mode == "liger":
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance
        except ImportError as e:
            raise ModeUnavailable(f"not installed (pip install liger-kernel): {e}") from e
        _apply_liger_kernel_to_instance(model=model)
        return model
    raise ValueError(f"unknown mode {mode!r}; valid: {MODES}")


def _upcast_output(module, args, output):
    """lm_head hook of eager-fp32-head: the logits in fp32 from the matmul's output on, so the model's
    own logit ops (Gemma 2's softcap tanh(z / c) * c) run in fp32 instead of rounding to bf16 after
    each op. Fused heads (fxfuse's, Liger's) compute those ops in fp32; this mode tells that
    rounding difference apart from everything else when a bf16 curve leaves eager's."""
    return output.float()


class ModeUnavailable(RuntimeError):
    pass


def enable_checkpointing(model) -> None:
    """Activation checkpointing of every decoder layer, non-reentrant (transformers >= 5.2x names it
    activation_checkpointing_enable, earlier gradient_checkpointing_enable). Under transformers >= 5.25
    this process's Dynamo also traces checkpointed forwards with side effects (fxfuse/checkpoint.py),
    for every compiled mode alike: without it each checkpointed layer runs eagerly in all of them."""
    from .checkpoint import SKIP_REPLAY, remedy_applies

    if remedy_applies():
        setattr(torch._dynamo.config, SKIP_REPLAY, True)  # for the rest of this process (a worker, a script)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def with_autocast(call, device: str, dtype: str | None):
    """``call`` run under ``torch.autocast(device type, dtype)`` (mixed precision: the weights,
    gradients and AdamW states stay in --dtype, e.g. fp32 master weights with bf16 matmuls, as HF
    Trainer's bf16=True); ``call`` itself when dtype is None. Backward runs outside, as usual."""
    if not dtype:
        return call
    kind, cast = torch.device(device).type, getattr(torch, dtype)

    def run(**kwargs):
        with torch.autocast(kind, dtype=cast):
            return call(**kwargs)
    return run


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _rss_mib() -> float:
    """Current resident set size of this process (Linux /proc), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def train_step(call, opt, batch: dict) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = call(**batch).loss
    loss.backward()
    opt.step()
    return loss.detach()


def post_grad_counts() -> dict:
    """What fxfuse's Inductor post-grad passes did in this process so far (fxfuse/fold_add.py,
    fxfuse/reinplace.py), and Inductor / AOTAutograd cache hits: a hit reuses compiled code
    without running the passes, so their counts stay 0 for that graph."""
    from torch._dynamo.utils import counters

    keys = ("residual_adds_folded", "gradient_sums_folded", "fold_bytes_unwritten", "gradients_in_place")
    return {**{k: counters["fxfuse"][k] for k in keys},
            "cache_hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]}


def _setup(spec: dict):
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    if device.startswith("cuda") and spec.get("mem_limit_gib"):
        index = device_index(device, torch.cuda.current_device)
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["mem_limit_gib"] * 2**30 / total), index)
    model = build_model(spec["model"], spec.get("config", {}), spec.get("tiny", False), dtype, device, spec["seed"])
    model.train()
    if spec.get("checkpointing"):
        enable_checkpointing(model)
    call = with_autocast(prepare(spec["mode"], model, fxfuse_options(spec), spec.get("dynamic") or None),
                         device, spec.get("autocast"))
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
    data = Batches(model.config.vocab_size, spec["batch"], spec["seq"], spec["seed"], device, spec.get("tokens"),
                   spec.get("synthetic", "uniform"), spec.get("attention_mask", "none"), spec.get("seq_lengths"))
    return model, call, opt, data


def run(spec: dict) -> dict:
    """Train ``steps`` steps: loss curve, per-step time and memory, profiler shares, fxfuse's report."""
    import fxfuse

    device, cuda = spec["device"], spec["device"].startswith("cuda")
    from torch._dynamo.utils import counters

    from .attention_tags import RUNS
    from .backend import running_reports

    n_reports = len(fxfuse.compiled_reports())
    graphs_before, runs_before = counters["stats"]["unique_graphs"], RUNS.copy()
    passes_before = post_grad_counts()
    model, call, opt, data = _setup(spec)
    sched = lr_schedule(opt, spec.get("lr_warmup", 0))
    losses, times, mem = [], [], []
    peak_alloc = peak_reserved = 0.0
    bar = Progress(spec["steps"], f"{spec['mode']:>8}")
    for i in range(spec["steps"]):
        batch = data(i)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        loss = train_step(call, opt, batch).item()  # .item() syncs: every mode pays the same logging sync
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if sched is not None:
            sched.step()
        if cuda:
            mem.append(torch.cuda.max_memory_allocated(device) / 2**20)
            peak_alloc = max(peak_alloc, mem[-1])
            peak_reserved = max(peak_reserved, torch.cuda.max_memory_reserved(device) / 2**20)
        else:
            mem.append(_rss_mib())
        bar.update(i + 1, f"{times[-1] * 1e3:8.1f} ms  loss {loss:.4f}")
    if not cuda:
        peak_alloc = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    timed = times[spec["warmup"]:] or times[-1:]
    step_s = statistics.median(timed)
    # tokens per step (padding included: what the GPU computed); median of the per-step rate, which is
    # batch * seq / median step time when every batch has the same length
    first = len(times) - len(timed)
    rate = statistics.median(spec["batch"] * data.seq_len(first + k) / t for k, t in enumerate(timed))

    shares = profile_shares(call, opt, data, spec["steps"], spec.get("profile_steps", 2), cuda, train_step)
    peak = None
    if cuda and spec.get("memory_peak"):  # one more step, allocator history on: what is alive at the peak
        from .audit_memory import record_peak

        peak = record_peak(lambda: train_step(call, opt, data(spec["steps"])).item(), device)
    report = fxfuse.Report.merge(running_reports(n_reports)) if spec["mode"] == "fxfuse" else None
    return {
        "mode": spec["mode"], "status": "ok", "losses": losses, "step_times_s": times, "mem_curve_mib": mem,
        "step_time_ms": step_s * 1e3, "tokens_per_s": rate,
        "graphs_compiled": counters["stats"]["unique_graphs"] - graphs_before,
        "mask_checks": dict(RUNS - runs_before) if spec["mode"] == "fxfuse" else None,
        "post_grad": ({k: v - passes_before[k] for k, v in post_grad_counts().items()}
                      if spec["mode"] == "fxfuse" else None),
        "timed_steps": len(timed),
        "peak_allocated_mib": peak_alloc, "peak_reserved_mib": peak_reserved if cuda else None,
        "memory_source": "torch.cuda.max_memory_allocated/reserved" if cuda else "peak RSS (getrusage ru_maxrss)",
        "profile": shares,
        "memory_peak": peak,
        "report": json.loads(report.to_json()) if report is not None else None,
        "removed": removed_tensors(report) if report is not None else None,
        "params": sum(p.numel() for p in model.parameters()),
    }


def main(argv=None) -> int:
    spec_path, out_path = (argv or sys.argv[1:])[:2]
    with open(spec_path) as f:
        spec = json.load(f)

    def progress(partial: dict) -> None:
        with open(out_path, "w") as f:
            json.dump(partial, f)

    try:
        job = spec["job"]
        if job == "run":
            result = run(spec)
        else:  # the fit jobs (fxfuse/audit_fit.py) use this module's setup and step
            from .audit_fit import fit, fit_batch

            result = fit_batch(spec, progress) if job == "fit_batch" else fit(spec)
        rc = 0
    except ModeUnavailable as e:
        result, rc = {"mode": spec["mode"], "status": str(e)}, 0
    except Exception as e:  # noqa: BLE001 - reported in the mode's row, the other modes still run
        msg = re.sub(r"\s+", " ", str(e))[:300]
        result = {"mode": spec["mode"], "status": f"error: {type(e).__name__}: {msg}",
                  "traceback": traceback.format_exc()}
        if os.path.exists(out_path):  # fit_batch: keep the probes done before the error
            with open(out_path) as f:
                result = {**json.load(f), **result}
        rc = 1
    with open(out_path, "w") as f:
        json.dump(result, f)
    return rc


if __name__ == "__main__":
    sys.exit(main())
