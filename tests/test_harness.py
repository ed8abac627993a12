"""The harness's parity rule: fxfuse vs eager fp32 within FP32_TOL, or, for a tensor that misses it,
at least as accurate as eager fp32 against an fp64 run (fp64_verdict). Exact errors are built in by
construction here so each case sits on a known side of the rule. Then the name rules that count a
model's sites (fxfuse.sites: is_rms_norm, is_gated_mlp, is_attention) on stand-in modules."""
import pytest
import torch
import torch.nn as nn

from fxfuse.harness import FP32_TOL, as_accurate_as_eager, exact_fp32, fp64_run, fp64_verdict, grad_errors, rel_err
from fxfuse.sites import expected_sites, is_attention, is_gated_mlp, is_rms_norm, uses_rope


def _noisy(exact: torch.Tensor, rel: float, seed: int) -> torch.Tensor:
    """exact + noise of relative norm rel; noises of different seeds are made orthogonal to seed 0's."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(exact.shape, generator=g, dtype=torch.float64)
    if seed:
        e0 = torch.randn(exact.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        e = e - (e * e0).sum() / (e0 * e0).sum() * e0
    return exact + e * (rel * exact.norm() / e.norm())


def _case(got_rel: float):
    exact = torch.randn(1000, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    eager = _noisy(exact, 1e-5, 0)  # eager fp32's own error: right at FP32_TOL
    return _noisy(exact, got_rel, 1), eager, exact


def test_equal_accuracy_passes_though_it_misses_eager_by_more_than_the_tolerance():
    got, eager, exact = _case(1e-5)
    assert rel_err(got, eager) > FP32_TOL  # sqrt(2) * 1e-5: the plain comparison fails
    assert as_accurate_as_eager(got, eager, exact)


def test_less_accurate_than_eager_fails():
    got, eager, exact = _case(3e-5)
    assert not as_accurate_as_eager(got, eager, exact)


def test_verdict_judges_only_the_tensors_that_missed():
    got, eager, exact = _case(1e-5)
    bad, _, _ = _case(3e-5)
    loss = torch.tensor(2.0, dtype=torch.float64)
    grads, ref = {"a": got, "b": exact.clone()}, {"a": eager, "b": exact.clone()}
    ok, lines = fp64_verdict(loss, grads, loss, ref, (loss, {"a": exact, "b": exact}))
    assert ok and len(lines) == 1 and lines[0].startswith("a:") and "as accurate as eager" in lines[0]
    ok, lines = fp64_verdict(loss, {"a": bad, "b": exact}, loss, ref, (loss, {"a": exact, "b": exact}))
    assert not ok and "LESS ACCURATE" in lines[0]
    ok, lines = fp64_verdict(loss * (1 + 1e-3), grads, loss, ref, (loss, {"a": exact, "b": exact}))
    assert not ok and lines[0].startswith("loss:")  # eager's loss is exact here: 1e-3 off is wrong


def test_an_all_zero_gradient_where_eager_has_none_is_no_difference():
    """torch.compile (any backend) gives zeros to parameters that enter its graph without reaching the
    loss, where eager leaves None; a nonzero one, or one missing, still differs."""
    from fxfuse.harness import grad_error

    ref = {"w": torch.ones(3)}
    assert grad_error({"w": torch.ones(3), "head": torch.zeros(2)}, ref) == 0.0
    assert grad_error({"w": torch.ones(3), "head": torch.tensor([0.0, 1e-9])}, ref) == float("inf")
    assert grad_error({"head": torch.zeros(2)}, ref) == float("inf")


def test_verdict_fails_without_an_fp64_run():
    got, eager, exact = _case(1e-5)
    loss = torch.tensor(1.0)
    ok, lines = fp64_verdict(loss, {"a": got}, loss, {"a": eager}, None)
    assert not ok and "no fp64 run" in lines[0]


def test_nonzero_where_eager_is_zero_is_never_rescued():
    big = torch.randn(100, dtype=torch.float64)
    ref = {"w": big, "bias": torch.zeros(8, dtype=torch.float64)}
    grads = {"w": big.clone(), "bias": torch.full((8,), 1e-2, dtype=torch.float64)}
    assert grad_errors(grads, ref)["bias"] == float("inf")
    loss = torch.tensor(1.0)
    ok, lines = fp64_verdict(loss, grads, loss, ref, (loss, {"w": big, "bias": grads["bias"]}))
    assert not ok and lines[0].startswith("bias:")


def test_fp64_run_gives_double_gradients_and_none_for_an_fp32_only_model():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    loss, grads = fp64_run(lin, {"input": x}, lambda out: out.square().sum())
    assert loss.dtype == torch.float64 and grads["weight"].dtype == torch.float64
    assert rel_err(grads["weight"], 2 * ((x.double() @ lin.weight.double().T + lin.bias.double()).T @ x.double())) < 1e-12

    class Fp32Only(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, input):
            return input.float() @ self.w  # an fp32 input against an fp64 weight: a dtype error

    assert fp64_run(Fp32Only(), {"input": x}, lambda out: out.sum()) is None


def test_fp64_run_takes_the_experts_loop_where_grouped_mm_has_no_fp64_kernel():
    """An HF MoE built with transformers' default experts implementation (grouped_mm: no fp64 kernel)
    still gets its fp64 reference; the model itself keeps its implementation."""
    from transformers import AutoModelForCausalLM

    from fxfuse.zoo import HF_ZOO, hf_config, hf_inputs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("olmoe", **HF_ZOO["olmoe"]))
    assert model.config._experts_implementation == "grouped_mm"
    exact = fp64_run(model, hf_inputs(96), lambda out: out.loss)
    assert exact is not None and exact[1]["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float64
    assert model.config._experts_implementation == "grouped_mm"


def _module(cls_name: str, children=(), params=(), **attrs) -> nn.Module:
    m = type(cls_name, (nn.Module,), {})()
    for c in children:
        m.add_module(c, nn.Identity())
    for p in params:
        m.register_parameter(p, nn.Parameter(torch.zeros(1)))
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


@pytest.mark.parametrize("mod, rms, gated, attention", [
    (_module("JetMoeMoE", ["activation", "input_linear", "output_linear", "router"]), False, True, False),
    (_module("JetMoeMoA", ["input_linear", "output_linear", "router"]), False, False, False),  # attention experts
    (_module("JetMoeAttention", ["experts", "kv_proj"]), False, False, True),
    (_module("DbrxAttention", ["Wqkv", "out_proj"]), False, False, True),  # names compared lower-cased
    (_module("DbrxExpertGLU", ["activation_fn"], ["w1", "v1", "w2"]), False, True, False),
    (_module("Qwen3NextRMSNormGated", params=["weight"], activation="silu"), True, True, False),
    (_module("MambaRMSNormGated", params=["weight"]), True, True, False),  # silu, no attribute
    (_module("KimiRMSNormGated", params=["weight"], activation="sigmoid"), True, False, False),  # a GLU: no site
    (_module("LlamaRMSNorm", params=["weight"]), True, False, False),
    (_module("ErgoExpertNorm", params=["weight"]), True, False, False),  # F.rms_norm, then the expert's weight
    (_module("BailingHybridDeltaAttention", ["q_proj", "k_proj", "v_proj", "conv1d", "o_proj"]), False, False, False),
    (_module("AXK2Indexer", ["wq_b", "wk", "k_norm", "weights_proj"]), False, False, True),  # rotates its q, k
    (_module("MiniCPM5MoeAttention", ["q_gate_proj", "k_proj", "v_proj", "o_proj"]), False, False, True),
    (_module("xLSTMFeedForward", ["proj_up_gate", "proj_up", "proj_down", "act_fn"]), False, True, False),
    (_module("MambaMixer", ["in_proj", "conv1d", "x_proj", "dt_proj", "out_proj"], ["A_log", "D"]), False, True, False),
    (_module("FalconH1Mixer", ["in_proj", "conv1d", "out_proj", "norm"], ["A_log", "D"]), False, True, False),
    (_module("Qwen2_5_VLVisionAttention", ["qkv", "proj"]), False, False, True),
    (_module("ZambaMambaMixer", ["in_proj", "conv1d", "out_proj"], ["x_proj_weight", "dt_proj_weight"]), False, True,
     False),
    (_module("RecurrentGemmaRecurrentBlock", ["linear_y", "linear_x", "linear_out", "conv_1d", "rg_lru"]), False,
     True, False),
    (_module("DoryL2Norm"), True, False, False),
    (_module("BltCrossAttention", ["q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"]), False, False, False),
    (_module("BltSelfAttention", ["q_proj", "k_proj", "v_proj", "o_proj"]), False, False, True),
    (_module("LayerNorm", params=["weight", "bias"]), False, False, False),
    (_module("CpmAntDenseGatedACT", ["w_0", "w_1", "act"]), False, True, False),
])
def test_site_rules_by_name(mod, rms, gated, attention):
    assert (is_rms_norm(mod), is_gated_mlp(mod), is_attention(mod)) == (rms, gated, attention)


@pytest.mark.parametrize("module, cls, rms", [
    ("t5", "T5LayerNorm", True), ("mt5", "MT5LayerNorm", True), ("longt5", "LongT5LayerNorm", True),
    ("switch_transformers", "SwitchTransformersLayerNorm", True), ("cpmant", "CpmAntLayerNorm", True),
    ("pix2struct", "Pix2StructLayerNorm", True), ("cohere", "CohereLayerNorm", False),  # subtracts the mean
    ("deberta", "DebertaLayerNorm", False),
])
def test_an_rms_norm_named_layer_norm_is_a_site_by_its_docstring(module, cls, rms):
    """T5's LayerNorm (and its copies) is an RMSNorm: no mean, no bias; it says so in its docstring."""
    import importlib

    norm_cls = getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls)
    norm = norm_cls.__new__(norm_cls)
    nn.Module.__init__(norm)  # no config needed: the rule reads the class
    assert is_rms_norm(norm) == rms


class HyUnweightedRMSNorm(nn.Module):
    """HY-V4's: returns only the inverse RMS [..., 1], which scales another tensor."""

    def forward(self, x):
        return torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)


class TwoNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(8)
        self.inverse = HyUnweightedRMSNorm()

    def forward(self, x):
        return self.norm(x) * self.inverse(x)


def test_an_rms_norm_class_returning_the_inverse_rms_is_no_site():
    assert is_rms_norm(TwoNorms().inverse)  # by its class name: only its output tells
    assert expected_sites(TwoNorms(), {"x": torch.randn(2, 8)}, False)["rms_norm"] == 1


@pytest.mark.parametrize("names", [("Wi", "Wo"), ("linear_1", "linear_2"), ("fc1", "fc2")])
@pytest.mark.parametrize("packed", [True, False])
def test_packed_in_out_is_a_gated_mlp_only_when_the_first_holds_both_halves(packed, names):
    """ModernBERT's Wi, Aya Vision's projector linear_1 and Moshi's fc1 pack gate and up (twice the
    second's input); T5's wi / wo, LLaVA's projector and GPT-2-style fc1 / fc2 are plain MLPs."""
    mlp = _module("Mlp")
    setattr(mlp, names[0], nn.Linear(8, 32 if packed else 16))
    setattr(mlp, names[1], nn.Linear(16, 8))
    assert is_gated_mlp(mlp) == packed


def test_a_wrapper_around_an_rms_norm_is_not_a_site_of_its_own():
    """AXK2's GatedRMSNorm holds an RMSNorm and gates its output: one site (the inner norm), not two."""
    wrapper = _module("AXK2GatedRMSNorm")
    wrapper.add_module("norm", _module("AXK2RMSNorm", params=["weight"]))
    assert not is_rms_norm(wrapper) and is_rms_norm(wrapper.norm)


def test_a_mamba2_mixer_with_a_gated_norm_is_not_a_second_site():
    """Mamba-2 / Bamba gate their scan output inside a gated RMSNorm: the norm is the site, not the mixer."""
    mixer = _module("Mamba2Mixer", ["in_proj", "conv1d", "out_proj"], ["A_log", "D"])
    mixer.norm = _module("MambaRMSNormGated", params=["weight"])
    assert not is_gated_mlp(mixer)


class ZambaLike(nn.Module):
    """A mixer gating each head's output in a call of its own, and a q / k l2norm function of its file."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.x_proj_weight, self.dt_proj_weight = nn.Parameter(torch.ones(1)), nn.Parameter(torch.ones(1))
        self.n_mamba_heads = 3

    def forward(self, x):
        q, k = l2norm(self.in_proj(x)), l2norm(x)
        return self.out_proj(q * k)


def l2norm(x, eps=1e-6):  # as HF's linear-attention files define it, at module level
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


_L2NORM = l2norm


def test_per_head_gated_mixer_and_l2norm_function_calls_are_counted():
    sites = expected_sites(ZambaLike(), {"x": torch.randn(2, 8)}, False)
    assert sites["swiglu"] == 3 and sites["rms_norm"] == 2
    assert globals()["l2norm"] is _L2NORM  # the counting wrapper is gone after the forward


def test_rope_sites_per_tower():
    """An attention module is a RoPE site only when its own tower (the innermost HF PreTrainedModel
    holding it) has a rotary embedding: a VLM's CLIP attention is none, its language model's is."""
    from transformers import AutoModelForImageTextToText

    from fxfuse.zoo_vlm import llava

    cfg, inputs = llava()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg)
    assert sum(is_attention(m) for m in model.modules()) == 4  # 2 CLIP + 2 Llama layers
    assert expected_sites(model, inputs, True)["rope"] == 2


@pytest.mark.parametrize("model_type", ["smollm3", "llama4_text"])
def test_a_nope_layer_is_no_rope_site(model_type):
    """SmolLM3 and Llama 4 skip RoPE in their no_rope_layers (every 4th layer in the released
    configs): the attention that ran without calling its file's apply_rotary_pos_emb (Llama 4:
    apply_rotary_emb) is no site, and
    fxfuse, which fuses the rotating layer, reports no gap."""
    from transformers import AutoModelForCausalLM

    from fxfuse.harness import check
    from fxfuse.zoo import hf_config, hf_inputs

    cfg = hf_config(model_type, no_rope_layers=[1, 0])  # 1: the layer rotates

    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg)

    assert expected_sites(build(), hf_inputs(cfg.vocab_size), True)["rope"] == 1
    assert expected_sites(AutoModelForCausalLM.from_config(hf_config(model_type)), hf_inputs(96), True)["rope"] == 2
    r = check(model_type, build, hf_inputs(cfg.vocab_size), bf16_steps=0)
    assert r.matched["rope"] == 1 and not (r.gaps or r.false_matches) and r.parity_ok, r


@pytest.mark.parametrize("model_type, sites", [("zaya", 2), ("axk2", 4)])
def test_an_attention_nested_in_another_is_a_rope_site_only_where_it_rotates(model_type, sites):
    """Zaya's convolutional q / k / v projection (q_proj, k_proj) sits inside its attention and rotates
    nothing: 1 site per layer; AXK2's sparse-attention indexer rotates its own q / k: 2 per layer."""
    from transformers import AutoModelForCausalLM

    from fxfuse.zoo import hf_config, hf_inputs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(model_type))
    assert sum(is_attention(m) for m in model.modules()) == 4
    assert expected_sites(model, hf_inputs(96), True)["rope"] == sites


class RotatingElsewhere(nn.Module):
    """An attention of a file that has apply_rotary_pos_emb but rotates through another function."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.ones(4))

    def forward(self, x):
        return self.q_proj(x) + self.k_proj(x)


def apply_rotary_pos_emb(q, k, cos, sin):  # as HF's modeling files define it, at module level
    return q * cos, k * cos


_APPLY_ROTARY = apply_rotary_pos_emb


def test_an_attention_class_that_never_calls_apply_rotary_pos_emb_counts_every_call():
    """The NoPE rule applies only to a class some of whose calls rotated through the function; a class
    none of whose calls did (its rotation spelled another way) keeps one site per call."""
    model = nn.Sequential(RotatingElsewhere(), RotatingElsewhere())
    assert expected_sites(model, {"input": torch.randn(2, 8)}, False)["rope"] == 2
    assert globals()["apply_rotary_pos_emb"] is _APPLY_ROTARY  # the counting wrapper is gone after the forward


class RotatingSometimes(RotatingElsewhere):
    """Rotates through apply_rotary_pos_emb only in some layers (Flint: its sliding-window ones)."""

    def __init__(self, rotate: bool):
        super().__init__()
        self.rotate = rotate

    def forward(self, x):
        q, k = self.q_proj(x), self.k_proj(x)
        if self.rotate:
            q, k = apply_rotary_pos_emb(q, k, 1.0, 1.0)
        return q + k


@pytest.mark.parametrize("rotate, sites", [((True, False), 1), ((False, False), 0)])
def test_an_attention_class_naming_apply_rotary_pos_emb_is_nope_where_it_skips_it(rotate, sites):
    """A class whose forward names the function is a site only in the calls that ran it, even where no
    call of this forward did (Flint's default layer_types: every layer full attention, no rotation)."""
    model = nn.Sequential(*(RotatingSometimes(r) for r in rotate))
    assert expected_sites(model, {"input": torch.randn(2, 8)}, False)["rope"] == sites


@pytest.mark.parametrize("rotary_dim", [None, 8])
def test_an_attention_with_its_own_sin_cos_table_uses_rope(rotary_dim):
    """GPT-J / CodeGen in transformers <= 5.17: no rotary module, no inv_freq buffer; the attention
    holds an embed_positions sin / cos buffer and rotary_dim (None: every channel rotates)."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(16, 16), nn.Linear(16, 16)
            self.rotary_dim = rotary_dim
            self.register_buffer("embed_positions", torch.zeros(32, 16))

    assert uses_rope(nn.Sequential(Attention()))
    assert not uses_rope(nn.Sequential(nn.Linear(16, 16)))


def test_copy_rebuilds_a_model_that_refuses_deepcopy():
    """torch.nn.utils.weight_norm's weight is a non-leaf tensor after a forward, and deepcopy refuses
    it (RecurrentGemma): the harness builds a fresh model and loads the original's state instead."""
    import copy

    from fxfuse.harness import _copy

    def build():
        torch.manual_seed(0)
        return torch.nn.utils.weight_norm(torch.nn.Linear(4, 3))

    model = build()
    with torch.no_grad():
        model.weight_g.mul_(2.0)  # differs from a fresh build: the copy must carry the state
    model(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.deepcopy(model)
    twin = _copy(model, build)
    x = torch.randn(5, 4)
    torch.testing.assert_close(twin(x), model(x), rtol=0, atol=0)
    assert twin is not model and twin.weight_g.data_ptr() != model.weight_g.data_ptr()


def test_exact_fp32_turns_tf32_off_and_restores_it():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        with exact_fp32():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_exact_fp32_fixture(exact_fp32):
    """conftest's fixture, which the GPU parity tests use instead of setting the flags for good."""
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
