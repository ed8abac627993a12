"""The model zoo: HF causal LMs built from tiny configs (random weights), checked by the harness;
``fxfuse check MODEL`` runs the harness on one architecture (an HF model type or a config.json; with
``--task seq2seq-lm`` or ``masked-lm`` an encoder-decoder or encoder model trained on its LM head),
``python -m fxfuse.zoo --markdown`` prints the README coverage table from harness results.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from .harness import Result, check
from .options import INNER
from .report import PATTERN_NAMES

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)

# encoder-decoder configs name their sizes otherwise: T5's d_model / d_ff / num_layers, BART's encoder_* /
# decoder_*; the decoder starts from token 0 (some configs leave decoder_start_token_id unset)
SEQ2SEQ_TINY = dict(d_model=32, d_ff=48, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
                    relative_attention_num_buckets=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, decoder_start_token_id=0)

# task -> (the transformers mapping of model types to classes, its Auto class, the tiny config's extra keys)
TASKS = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM", {}),
    "seq2seq-lm": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM", SEQ2SEQ_TINY),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM", {}),
}

# DeepSeek's multi-head latent attention at TINY's scale: rope on 4 of each head's 8 q/k channels,
# as many kv heads as heads, low-rank q and kv; 4 routed experts after one dense layer
MLA_TINY = dict(head_dim=4, num_key_value_heads=4, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
            kv_lora_rank=16, q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1)

# model type -> config overrides on top of TINY (where the architecture needs them, or where its
# defaults keep full-size tensors: tests/test_zoo.py keeps every entry below 250K parameters)
HF_ZOO: dict[str, dict] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {}, "gemma": {}, "gemma2": {}, "gemma3_text": {},
    "phi3": {}, "phi": {}, "gpt_neox": {"rotary_pct": 0.5}, "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    "olmo": {}, "olmo2": {}, "stablelm": {}, "cohere": {}, "starcoder2": {}, "granite": {}, "glm": {},
    "helium": {}, "smollm3": {}, "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "opt": {"ffn_dim": 48, "word_embed_proj_dim": 32, "dropout": 0.0}, "bloom": {},
    "llama4_text": {}, "qwen3_moe": {"num_experts": 4, "moe_intermediate_size": 16, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2}, "nanochat": {}, "lfm2": {},
    # Gemma 4's defaults hold a 262144 x 256 per-layer embedding per layer (134M parameters at TINY)
    # and 512-wide heads in its full-attention layers
    "gemma4_text": {"vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 8, "global_head_dim": 16},
    "olmo3": {}, "glm4": {}, "jetmoe": {}, "ernie4_5": {}, "exaone4": {}, "seed_oss": {}, "cohere2": {},
    "apertus": {}, "bitnet": {}, "minimax": {}, "deepseek_v2": MLA_TINY, "deepseek_v3": MLA_TINY,
    # GPT-J / CodeGen rotate the first rotary_dim (default 64) channels of each head, in pairs
    "gptj": {"rotary_dim": 4}, "codegen": {"rotary_dim": 4}, "falcon": {},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 8},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 1,
              "n_group": 1, "topk_group": 1, "n_shared_experts": 1},
    "lfm2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "num_dense_layers": 1,
                 "layer_types": ["full_attention", "conv"]},
    "minicpm3": {**{k: MLA_TINY[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank",
                                             "q_lora_rank", "num_key_value_heads")}},
    "youtu": {**{k: MLA_TINY[k] for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank",
                                          "q_lora_rank", "num_key_value_heads", "head_dim")}},
    # Gemma 3n: per-layer lists sized to 2 layers, the second reusing the first's keys and values (as
    # its last 15 of 35 do), the first with the 0.95 Gaussian top-k gate sparsity of its first 10;
    # AltUp over 2 streams; per-layer embeddings and LAuReL at TINY's scale
    "gemma3n_text": {"layer_types": ["sliding_attention"] * 2, "sliding_window": 8, "num_kv_shared_layers": 1,
                     "intermediate_size": [48] * 2, "activation_sparsity_pattern": [0.95, 0.0], "altup_num_inputs": 2,
                     "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 8, "laurel_rank": 4},
    # Qwen3.5: a gated-delta-net linear attention layer (its gated RMSNorm: an RMSNorm and a SiLU-gate
    # site; its q / k l2norm: two more RMSNorm sites) then a full attention layer, linear-attention heads
    # at TINY's scale
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 8,
                     "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    # AXK2: MLA with DeepSeek sparse attention (an indexer that rotates its own q / k: a second RoPE
    # site per layer) and a sigmoid-gated wrapper around some of its RMSNorms
    "axk2": MLA_TINY,
    # Bailing hybrid: a delta-rule linear attention layer (no rotation; its q / k l2norm: two RMSNorm sites)
    # then an MLA layer (DeepSeek's interleaved pairs written out on even / odd slices)
    "bailing_hybrid": {"layer_group_size": 2, **{k: MLA_TINY[k] for k in (
        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank", "q_lora_rank", "num_key_value_heads")}},
    # Mamba-1 mixers (their scan output times silu(gate) is a gated site); on CPU the selective scan is
    # torch's associative_scan in generic mode, traced through torch.vmap (kept as written, opaque.py)
    "mamba": {}, "falcon_mamba": {}, "jamba": {},
    # Dory (nGPT-style): L2-normed hidden states and q / k (x * rsqrt(sum(x^2) + eps): RMSNorm sites), a
    # learned per-vocabulary logit scale folded into the lm_head's rows
    "dory": {},
    # RecurrentGemma (Griffin): a recurrent block (gelu(linear_y(x)) times its RG-LRU output: a gated site)
    # then a local-attention block; its weight-normed parameters refuse deepcopy (harness._copy rebuilds)
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Zamba: Mamba-1 mixers with per-head projections in every layer, one attention + MLP block shared by
    # the two hybrid layers (tied weights); Zamba 2: Mamba-2 mixers with a gated RMSNorm, its shared
    # block with rotary q / k (use_mem_rope)
    "zamba": {"layer_types": ["hybrid", "linear_attention", "hybrid"], "num_hidden_layers": 3, "mamba_d_state": 8,
              "mamba_dt_rank": 4, "n_mamba_heads": 2},
    "zamba2": {"layer_types": ["linear_attention", "hybrid"], "hybrid_layer_ids": [1], "mamba_headdim": 8,
               "mamba_d_state": 8, "n_mamba_heads": 8, "mamba_ngroups": 1, "chunk_size": 16, "use_mem_rope": True},
    # Kolibri 1.1: a sliding-window layer (RoPE) then a NoPE indexed-attention layer whose weightless indexer
    # picks each query's keys (data-dependent: graph breaks, run eagerly) from a pool it selects, attending
    # to NVFP4-rounded keys and values; a dense MLP then a MoE layer with a shared expert. NVFP4 rounding
    # needs 16-wide heads; index budgets small enough that the 9-token batch's later queries select
    "kolibri1_1": {"head_dim": 16, "layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1],
                   "kv_source_layers": [0, 1], "mlp_only_layers": [0], "mlp_only_intermediate_size": 48,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16, "sliding_window": 8, "index_num_heads": 2, "index_topk": 2,
                   "index_pool_size": 4, "index_compression": 2, "index_num_local_tokens": 2,
                   "index_num_sink_tokens": 1},
    # BLT (byte latent transformer): an entropy patcher, a local byte encoder, a global transformer over
    # patches and a local byte decoder (one layer each, cross-attention between bytes and patches: no
    # rotation), its byte vocabulary; patching reads tensors on the host (graph breaks, run eagerly)
    "blt": {"vocab_size": 260, "encoder_hash_byte_group_vocab": 64, "encoder_hash_byte_group_size": [3, 4],
            "local_attention_window_len": 16, **{f"{part}_config": {
                "hidden_size": 64 if part == "global" else 32, "head_dim": 16 if part == "global" else 8,
                "hidden_size_global": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
                "num_hidden_layers": 1, "intermediate_size": 48}
                for part in ("patcher", "encoder", "decoder", "global")}},
    # Zaya: compressed convolutional attention (q / k mixed by causal convolutions inside a projection block
    # of its own, L2-normed q / k with a clamp, no site), 4 experts behind an MLP router at TINY's scale
    "zaya": {"num_experts": 4, "moe_intermediate_size": 16, "router_hidden_size": 16},
    # Beam and Gemma 4 unified: as their defaults build them at TINY's scale
    "beam": {}, "gemma4_unified_text": {},
    # Inkling 2: softcapped SwiGLU experts (fxfuse::softcapped_swiglu); 4 experts, an lm_head of TINY's
    # vocabulary (its default pads the logits to 200058), relative-position heads at TINY's scale
    "inkling2_text": {"n_routed_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
                      "moe_intermediate_size": 16, "swa_head_dim": 8, "unpadded_vocab_size": 96},
    # PhiMoE: sparsemixer routing, a custom autograd.Function whose backward writes in place (kept as
    # written: normalize.eliminate_dead_code); LayerNorm, no RMSNorm site
    "phimoe": {"num_local_experts": 4},
    # Flint: only sliding-window layers rotate; its default layer_types are all full attention (NoPE)
    "flint": {},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "glm4_moe": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                 "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
    "glm4_moe_lite": MLA_TINY,
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 8,
                   "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                   "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "shared_expert_intermediate_size": 16},
}

# (architecture, pattern) -> why the site is not fused; the harness records these as gaps
KNOWN_GAPS: dict[tuple[str, str], str] = {
    # transformers logs a warning (loss_type=None) between lm_head and loss: a graph break;
    # model.loss_type = "ForCausalLM" (the model's attribute, not the config's) avoids it
    ("gpt2", "linear_cross_entropy"): "graph break",
}

# (architecture, pattern) -> why fewer sites fuse under bf16 autocast than in fp32 (Result.autocast_gaps).
# None now: the mixed-dtype gated MLPs (Gemma 3n / 4's per-layer input gate, the Mamba-style mixers'
# scan output times act(gate)) fuse since fxfuse::swiglu takes a bf16 gate with an fp32 up
KNOWN_AUTOCAST_GAPS: dict[tuple[str, str], str] = {}


def hf_config(spec: str, **overrides):
    from transformers import AutoConfig

    if spec.endswith(".json"):
        cfg = AutoConfig.from_pretrained(spec)
        for k, v in overrides.items():
            setattr(cfg, k, v)
        return cfg
    from transformers import CONFIG_MAPPING

    # TINY keys the architecture derives itself (Falcon's head_dim: a read-only property) stay its own
    cls = CONFIG_MAPPING[spec]
    tiny = {k: v for k, v in TINY.items()
            if not (isinstance(getattr(cls, k, None), property) and getattr(cls, k).fset is None)}
    return AutoConfig.for_model(spec, **{**tiny, **HF_ZOO.get(spec, {}), **overrides})


def hf_inputs(vocab: int, b: int = 2, t: int = 9, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, t), generator=g)
    return {"input_ids": ids, "labels": ids}


def without_randomness(cfg):
    """cfg with its dropout probabilities, LayerDrop (M2M-100's ``encoder_layerdrop``: training skips
    random layers) and router jitter at 0 (Phi-MoE's ``router_jitter_noise``): functional dropout reads
    them from the config, not from nn.Dropout modules the harness zeroes, and random masks differ
    between the eager and compiled runs."""
    for key, value in cfg.to_dict().items():
        random = any(w in key for w in ("dropout", "pdrop", "layerdrop", "jitter"))
        if random and isinstance(value, float) and value > 0:
            setattr(cfg, key, 0.0)
    return cfg


def task_types(task: str) -> list[str]:
    """Model types with a class for task (TASKS) in the installed transformers, sorted."""
    from transformers.models.auto import modeling_auto

    return sorted(getattr(modeling_auto, TASKS[task][0]))


def builder(spec: str, task: str = "causal-lm", **overrides):
    """(name, build, inputs) of the zoo's model for spec: build() makes it from its tiny config with random
    weights (seed 0), fp32, no dropout; for causal-lm a VLM of fxfuse.zoo_vlm comes with its image batch.
    overrides set config fields (a VLM's top-level ones)."""
    import transformers

    from .zoo_vlm import VLMS

    if spec in VLMS and task == "causal-lm":
        cfg, inputs = VLMS[spec]()
        for k, v in overrides.items():
            setattr(cfg, k, v)
        auto, name = "AutoModelForImageTextToText", spec
    else:
        _, auto, extra = TASKS[task]
        cfg = hf_config(spec, **{**extra, **overrides})
        inputs = hf_inputs(cfg.vocab_size)
        name = spec if not spec.endswith(".json") else cfg.model_type
    cfg = without_randomness(cfg)

    def build():
        torch.manual_seed(0)
        return getattr(transformers, auto).from_config(cfg)

    return name, build, inputs


def check_hf(spec: str, bf16_steps: int = 20, inner: str = "aot_eager", device: str = "cpu",
             task: str = "causal-lm", **overrides) -> Result:
    name, build, inputs = builder(spec, task, **overrides)
    return check(name, build, inputs, bf16_steps=bf16_steps, inner=inner, device=device)


def check_vlm(spec: str, bf16_steps: int = 20, inner: str = "aot_eager", device: str = "cpu", **overrides) -> Result:
    """A vision-language model of fxfuse.zoo_vlm trained on its batch with an image; overrides set
    fields of its top-level config."""
    return check_hf(spec, bf16_steps, inner, device, "causal-lm", **overrides)


def cell(r: Result, pattern: str) -> str:
    exp, got = r.expected[pattern], r.matched[pattern]
    if exp == 0 and got == 0:
        return "-"
    mark = "" if got == exp else (" (gap)" if got < exp else " (FALSE MATCH)")
    return f"{got}/{exp}{mark}"


def markdown(results: list[Result]) -> str:
    head = "| architecture | " + " | ".join(PATTERN_NAMES) + " | fp32 parity | bf16 20 steps |"
    rows = [head, "|" + "---|" * (len(PATTERN_NAMES) + 3)]
    for r in sorted(results, key=lambda r: r.name):
        cells = [cell(r, p) for p in PATTERN_NAMES]
        rows.append(f"| {r.name} | " + " | ".join(cells) + f" | {'ok' if r.parity_ok else 'FAIL'} | "
                    f"{'ok' if r.bf16_ok else 'FAIL'} |")
    return "\n".join(rows)


def summary(r: Result) -> str:
    lines = [f"{r.name}: " + ", ".join(f"{p} {cell(r, p)}" for p in PATTERN_NAMES)]
    lines.append(f"  fp32 parity: loss rel err {r.loss_err:.2e}, worst gradient rel err {r.grad_err:.2e} -> "
                 f"{'ok' if r.parity_ok else 'FAIL'}")
    lines += [f"    judged against an fp64 run: {line}" for line in r.fp64]
    if r.bf16_max_rel is not None:
        lines.append(f"  bf16 autocast, 20 AdamW steps: largest loss divergence {r.bf16_max_rel:.2e} -> "
                     f"{'ok' if r.bf16_ok else 'FAIL'}")
        lines += [f"    judged {r.bf16_fp32}"] if r.bf16_fp32 else []
    for p in r.autocast_gaps:  # informational: the loss curve does not see a site left unfused
        why = "; ".join(dict.fromkeys(r.bf16_reasons.get(p, [])))
        lines.append(f"  under bf16 autocast {p} fuses {r.bf16_fused[p]} of the {r.fp32_fused[p]} sites fp32 fuses"
                     + (f": {why}" if why else ""))
    for p, reasons in r.reasons.items():
        for reason in dict.fromkeys(reasons):
            lines.append(f"  {'graph break' if p == 'graph_breaks' else 'unfused ' + p}: {reason}")
    if r.bf16_max_rel is None and not (r.gaps or r.false_matches) and r.parity_ok:
        lines.append("  PASS (the bf16 training check was not run)")
        return "\n".join(lines)
    lines.append("  PASS" if r.passed else "  NOT PASSED: " + ", ".join(
        [f"gap in {p}" for p in r.gaps] + [f"false match in {p}" for p in r.false_matches]
        + ([] if r.parity_ok else ["fp32 parity"]) + ([] if r.bf16_ok or r.bf16_max_rel is None else ["bf16"])))
    return "\n".join(lines)


def _override(text: str) -> tuple[str, object]:
    """KEY=VALUE, the value read as JSON where it parses (8, 0.5, true, [..]), else as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def check_cmd(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("fxfuse check: --device cuda, but torch sees no CUDA device "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda})", file=sys.stderr)
        return 2
    r = check_hf(args.model, bf16_steps=0 if args.no_train else 20, inner=args.inner, device=args.device,
                 task=args.task, **dict(args.set))
    print(json.dumps(r.to_dict(), indent=2) if args.json else summary(r))
    return 0 if r.passed or (args.no_train and not r.gaps and not r.false_matches and r.parity_ok) else 1


def register(sub) -> None:
    c = sub.add_parser("check", help="does fxfuse fuse every site of this architecture, with parity?")
    c.add_argument("model", help="HF model type (llama, qwen2, ...; a vision-language one of fxfuse.zoo_vlm: "
                                 "qwen2_5_vl, gemma3, ..., trained with an image) or a config.json path")
    c.add_argument("--no-train", action="store_true", help="skip the 20 bf16 AdamW steps")
    c.add_argument("--task", choices=list(TASKS), default="causal-lm",
                   help="which LM head the model is built with (default causal-lm; seq2seq-lm: T5, BART, ...; "
                        "masked-lm: BERT, ModernBERT, RoFormer, ...)")
    c.add_argument("--inner", choices=INNER, default="aot_eager")
    c.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model runs (cuda: the fused ops run their Triton kernels; default cpu)")
    c.add_argument("--json", action="store_true")
    c.add_argument("--set", nargs="+", type=_override, default=[], metavar="KEY=VALUE",
                   help="config overrides on top of the tiny config (a value is read as JSON where it parses), "
                        "e.g. --set layer_group_size=2 q_lora_rank=16")
    c.set_defaults(fn=check_cmd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="run the HF zoo through the harness")
    p.add_argument("--markdown", action="store_true", help="print the coverage table")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--inner", choices=INNER, default="aot_eager")
    p.add_argument("models", nargs="*", default=list(HF_ZOO))
    args = p.parse_args(argv)
    results = []
    for m in args.models:
        torch._dynamo.reset()
        results.append(check_hf(m, inner=args.inner, device=args.device))
        print(summary(results[-1]), file=sys.stderr, flush=True)
    if args.markdown:
        print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
