"""Backend options: ``torch.compile(model, backend="fxfuse", options={...})``."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .kernels._dispatch import torch_version
from .report import PATTERN_NAMES

# The oldest torch fxfuse is tested on end to end: CPU CI runs 2.13, the H200 runs 2.11. Below it
# the in-place gated-MLP backward (fxfuse/reinplace.py) is off (on 2.6 Inductor gave a wrong
# tied-embedding gradient with it: tests/test_opaque.py's ReversedMLP, dynamic shapes) and fused
# calls carry a checkpoint region id (rewrite._tag_recompute). Versions 2.7-2.10 were not tried.
TESTED_TORCH = (2, 11)


def tested_torch() -> bool:
    return torch_version() >= TESTED_TORCH

INNER = ("inductor", "aot_eager", "eager")
DOC = {
    "inner": f"inner compiler for the rewritten graph, one of {INNER} (default 'inductor')",
    "patterns": f"iterable of pattern names to fuse, subset of {PATTERN_NAMES} (default: all)",
    "debug_dir": "folder for one report dump per compiled graph (default: $FXFUSE_DEBUG_DIR, else none)",
    "inductor_config": "dict of torch._inductor.config overrides for the inner Inductor compile",
    "logits": "'exact' (default): logits a fused loss head returns are computed exactly (no gradient flows "
              "through them: a backward that reaches them raises); 'skip': not computed, any use raises",
    "loss_head": "'auto' (default): 'fast' when the inner compiler is Inductor (it scales the saved "
                 "gradients in place), else 'lean'; 'lean': the fused loss head recomputes logits in "
                 "backward (4 matmuls, ~100 MiB above dW + dx); 'fast': gradients formed in the forward "
                 "(3 matmuls, + an [N/8, V] logits block)",
    "recompute": "True (default): fused RMSNorm and SwiGLU outputs are recomputed in backward from the "
                 "inputs their backward keeps anyway, not saved for the next matmul; False: saved",
    "inplace_backward": "True (default from torch 2.11 on): under Inductor, a fused gated MLP's backward "
                        "writes its gradients over buffers the backward no longer reads (recomputed gate "
                        "under checkpointing, down_proj's input gradient) instead of fresh ones, and a "
                        "fused RMSNorm's backward adds the residual stream's gradient in its own pass "
                        "(fxfuse/fold_add.py); False (default, and the only value, before torch 2.11): "
                        "fresh buffers and a separate add",
    "causal_attention": "True (default): an SDPA call whose mask is a constant causal mask gets "
                        "is_causal=True instead (and enable_gqa for repeated k/v); False: left as is",
    "numerics": "'eager' (default): in bf16/fp16 graphs the fused ops round where eager's ops store "
                "a low-precision result (the loss head's logit ops and their gradients, a gated MLP's "
                "activation, RoPE's products, Llama RMSNorm's backward products) and Inductor keeps "
                "eager's casts (emulate_precision_casts), so losses "
                "follow eager's; 'fp32': fused ops keep fp32 between the graph's ops (one rounding per "
                "output: closer to the exact value, not to eager) and Inductor fuses casts away",
}
NUMERICS = ("eager", "fp32")


@dataclass(frozen=True)
class Options:
    inner: str = "inductor"
    patterns: tuple[str, ...] = PATTERN_NAMES
    debug_dir: str | None = None
    inductor_config: dict = field(default_factory=dict)
    logits: str = "exact"
    causal_attention: bool = True
    loss_head: str = "auto"
    recompute: bool = True
    numerics: str = "eager"
    inplace_backward: bool = True

    @classmethod
    def parse(cls, options: dict | None) -> Options:
        options = dict(options or {})
        unknown = sorted(set(options) - set(DOC))
        if unknown:
            valid = "\n".join(f"  {k}: {v}" for k, v in DOC.items())
            raise ValueError(f"fxfuse: unknown option(s) {unknown}; valid options:\n{valid}")
        inner = options.get("inner", "inductor")
        if inner not in INNER:
            raise ValueError(f"fxfuse: option 'inner' must be one of {INNER}, got {inner!r}")
        pats = options.get("patterns", PATTERN_NAMES)
        pats = (pats,) if isinstance(pats, str) else tuple(pats)
        bad = [p for p in pats if p not in PATTERN_NAMES]
        if bad:
            raise ValueError(f"fxfuse: unknown pattern(s) {bad}; valid: {PATTERN_NAMES}")
        debug_dir = options.get("debug_dir", os.environ.get("FXFUSE_DEBUG_DIR") or None)
        logits = options.get("logits", "exact")
        if logits not in ("exact", "skip"):
            raise ValueError(f"fxfuse: option 'logits' must be 'exact' or 'skip', got {logits!r}")
        causal = options.get("causal_attention", True)
        if not isinstance(causal, bool):
            raise ValueError(f"fxfuse: option 'causal_attention' must be True or False, got {causal!r}")
        loss_head = options.get("loss_head", "auto")
        if loss_head not in ("auto", "lean", "fast"):
            raise ValueError(f"fxfuse: option 'loss_head' must be 'auto', 'lean' or 'fast', got {loss_head!r}")
        recompute = options.get("recompute", True)
        if not isinstance(recompute, bool):
            raise ValueError(f"fxfuse: option 'recompute' must be True or False, got {recompute!r}")
        numerics = options.get("numerics", "eager")
        if numerics not in NUMERICS:
            raise ValueError(f"fxfuse: option 'numerics' must be one of {NUMERICS}, got {numerics!r}")
        tested = tested_torch()
        inplace = options.get("inplace_backward", tested)
        if not isinstance(inplace, bool):
            raise ValueError(f"fxfuse: option 'inplace_backward' must be True or False, got {inplace!r}")
        if inplace and not tested:
            this = ".".join(map(str, torch_version()))
            raise ValueError(f"fxfuse: option 'inplace_backward' needs torch >= {TESTED_TORCH[0]}.{TESTED_TORCH[1]} "
                             f"(this is {this}): on torch 2.6 Inductor ran the in-place gated-MLP backward into "
                             "wrong gradients; leave it unset or False")
        return cls(inner, pats, debug_dir, dict(options.get("inductor_config") or {}), logits, causal,
                   loss_head, recompute, numerics, inplace)

    @property
    def eager_rounding(self) -> bool:
        """Fused ops reproduce eager's low-precision roundings (numerics='eager')."""
        return self.numerics == "eager"

    def inductor_patches(self) -> dict:
        """torch._inductor.config overrides for the inner compile: numerics='eager' keeps eager's
        downcasts between fused pointwise ops (emulate_precision_casts); the user's inductor_config
        wins over it; inplace_backward adds fxfuse.reinplace as a post-grad pass."""
        from torch._inductor import config

        eager = {"emulate_precision_casts": True} if self.eager_rounding and hasattr(
            config, "emulate_precision_casts") else {}
        patches = {**eager, **self.inductor_config}
        if self.inplace_backward:  # fxfuse's post-grad pass first, then a user's own
            from .reinplace import post_grad_passes

            patches["post_grad_custom_post_pass"] = post_grad_passes(
                patches.get("post_grad_custom_post_pass", config.post_grad_custom_post_pass))
        return patches

    def loss_head_algorithm(self) -> str:
        """The fused loss head's algorithm: 'auto' is 'fast' under Inductor, whose compiled backward
        scales the forward's gradients in place (same peak as 'lean' in the H200 training runs, a
        third less head time); elsewhere autograd scales them out of place (dx + dW held twice)."""
        if self.loss_head != "auto":
            return self.loss_head
        return "fast" if self.inner == "inductor" else "lean"
