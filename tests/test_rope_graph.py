"""RoPE end to end: each attention layer's q+k rotation becomes one fused call, in HF models
(rotate_half, partial rotary), Meta/torchtitan complex RoPE and gpt-fast's real pairs; parity."""
import pytest
import torch
import torch.nn as nn

import fxfuse
from fxfuse.zoo import MLA_TINY
from helpers import batch, bf16_errors, compiled_parity, count_calls, hf_model, loss_and_grads, rel_err
from models import GptFastBlock, GptFastLM, TitanBlock, TitanLM
from probe_spellings import halves

FP32_TOL = 1e-5


def is_attention(m: nn.Module) -> bool:
    names = {n for n, _ in m.named_children()}
    return ({"q_proj", "k_proj"} <= names or "query_key_value" in names or "qkv_proj" in names
            or "kv_a_proj_with_mqa" in names or isinstance(m, (GptFastBlock, TitanBlock)))


@pytest.mark.parametrize("model_type,overrides,variant", [
    ("llama", {}, "rope_rotate_half"), ("mistral", {}, "rope_rotate_half"), ("qwen2", {}, "rope_rotate_half"),
    ("phi3", {}, "rope_rotate_half"), ("gemma", {}, "rope_rotate_half"),
    ("llama", {"num_key_value_heads": 1}, "rope_rotate_half"),  # MQA
    ("gpt_neox", {"rotary_pct": 0.5}, "rope_rotate_half"),  # partial rotary: the rotated slice binds as the input
    # q rotated and transposed before k is projected: the transpose follows the one fused call
    ("gemma4_text", {}, "rope_rotate_half"),
    ("gpt_oss", {}, "rope_halves"),  # the halves from torch.chunk: read as slices
    ("nanochat", {}, "rope_rotate_half_flipped"),  # rotate_half as cat(x2, -x1)
    ("deepseek_v3", MLA_TINY, "rope_halves_pairs_deepseek"),  # MLA: even / odd channels in, halves out
    ("deepseek_v2", MLA_TINY, "rope_complex_meta"),
    # each apply_rotary_pos_emb call repeat_interleaves its own sin / cos: q and k still pair
    ("gptj", {"rotary_dim": 4}, "rope_interleaved"), ("codegen", {"rotary_dim": 4}, "rope_interleaved"),
], ids=["llama", "mistral", "qwen2", "phi3", "gemma", "llama_mqa", "gpt_neox_partial", "gemma4", "gpt_oss",
        "nanochat", "deepseek_v3", "deepseek_v2", "gptj", "codegen"])
def test_hf_rotations_fused(model_type, overrides, variant):
    model = hf_model(model_type, **overrides)
    inputs = batch()
    expected = count_calls(model, is_attention, **inputs)
    # Gemma 4's q/k-norm weight grads (norm ~3e-2) sum 72 rows that cancel: the fused RMSNorm's dW
    # summation order alone moves them ~2e-5 relative; RoPE is what this test isolates (the zoo
    # checks the whole model, with its tolerance for such near-zero gradients)
    options = {"patterns": ("rope",)} if model_type == "gemma4_text" else None
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, options=options)
    sites = [s for s in report.matched if s.pattern == "rope"]
    assert len(sites) == expected, str(report)
    assert all(s.variant == variant for s in sites)
    assert not [s for s in report.unmatched if s.pattern == "rope"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.parametrize("cls,variant", [(GptFastLM, "rope_pairs_gptfast"), (TitanLM, "rope_complex_meta")])
def test_hand_written_interleaved_rope(cls, variant):
    torch.manual_seed(0)
    model = cls()
    inputs = batch()
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, loss_fn=lambda out: out)
    sites = [s for s in report.matched if s.pattern == "rope"]
    assert len(sites) == count_calls(model, is_attention, **inputs) == len(model.layers)
    assert {s.variant for s in sites} == {variant}
    assert report.counts()["rms_norm"] == 2 * len(model.layers) + 1
    assert report.counts()["swiglu"] == len(model.layers)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_packed_sequences_position_ids_restart():
    model = hf_model("llama")
    ids = batch(t=12)["input_ids"]
    position_ids = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1)  # two packed documents
    inputs = {"input_ids": ids, "labels": ids, "position_ids": position_ids}
    loss_err, grad_err, report, _ = compiled_parity(model, inputs)
    assert report.counts()["rope"] == model.config.num_hidden_layers
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


@pytest.mark.parametrize("make", [lambda: hf_model("qwen2"), GptFastLM], ids=["qwen2", "gptfast"])
def test_dynamic_lengths_without_recompile(make):
    torch.manual_seed(0)
    model = make()
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}, dynamic=True)
    call_loss = (lambda out: out) if isinstance(model, GptFastLM) else None
    seen = []
    for t in (9, 14, 23):
        inputs = batch(t=t)
        ref_loss, ref_grads = loss_and_grads(model, inputs, call_loss)
        loss, grads = loss_and_grads(model, inputs, call_loss, call=compiled)
        assert rel_err(loss, ref_loss) < FP32_TOL
        assert max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < FP32_TOL
        seen.append(len(fxfuse.compiled_reports()))
    assert seen[0] == seen[1] == seen[2], "compiled again for a new sequence length"
    assert fxfuse.last_report().counts()["rope"] == 2


def test_bf16_rotation_within_twice_eager_error():
    inputs = batch()
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(lambda dt: hf_model("llama", dtype=dt), inputs,
                                                      patterns=["rope"])
    assert fxfuse.last_report().counts()["rope"] == 2
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


def test_cos_requiring_grad_is_not_fused():
    class Learned(nn.Module):
        def __init__(self):
            super().__init__()
            self.cos = nn.Parameter(torch.randn(1, 1, 5, 8))
            self.sin = nn.Parameter(torch.randn(1, 1, 5, 8))

        def forward(self, q, k):
            rot = lambda x: torch.cat((-x[..., 4:], x[..., :4]), dim=-1)  # noqa: E731
            return ((q * self.cos + rot(q) * self.sin) + (k * self.cos + rot(k) * self.sin)).sum()

    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    report = fxfuse.explain(Learned(), q, k)
    assert report.counts()["rope"] == 0
    assert any("require grad" in s.reason for s in report.unmatched if s.pattern == "rope"), str(report)


def test_autocast_rotation_in_fp32_is_fused():
    """Under bf16 autocast q/k come from the linears in bf16 while HF's cos/sin stay fp32: eager's
    rotation is fp32. The fused call rotates q/k upcast to fp32; its gradients round once where
    eager rounds each path's: errors against fp32 within 2x eager's."""
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(lambda dt: hf_model("llama", dtype=dt), batch(),
                                                      autocast=True, patterns=["rope"])
    assert fxfuse.last_report().counts()["rope"] == 2, str(fxfuse.last_report())
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


def test_attention_output_needs_no_copy_before_o_proj():
    """The fused rotation keeps q's [B, T, H, D] memory layout, so SDPA's output (allocated in q's
    layout) transposed back to [B, T, H*D] is a view: no clone of it is written and saved for
    o_proj's backward (a contiguous rope output cost one per layer: +32 MiB/layer on Llama-1B)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from fxfuse.backend import transform
    from fxfuse.options import Options

    model = hf_model("llama", num_hidden_layers=2, attn_implementation="sdpa")
    graphs = []

    def fw(gm, ex):
        graphs.append(gm)
        return gm

    def backend(gm, ex):
        aten_gm, report = transform(gm, ex, Options.parse({"inner": "aot_eager"}))
        assert report.counts()["rope"] == 2
        return aot_module_simplified(aten_gm, ex, fw_compiler=fw, bw_compiler=lambda g, e: g)

    torch.compile(model, backend=backend)(**batch()).loss.backward()
    (fwd,) = graphs
    sdpa_outs = {n for n in fwd.graph.nodes if "scaled_dot_product" in str(n.target)}
    assert len(sdpa_outs) == 2

    def from_sdpa(n):
        while n.op == "call_function" and n not in sdpa_outs:
            n = n.args[0]
        return n in sdpa_outs

    copies = [n for n in fwd.graph.nodes if n.target == torch.ops.aten.clone.default and from_sdpa(n.args[0])]
    assert copies == [], fwd.code


class _ViewAfterAttention(nn.Module):
    """JetMoE's attention shape: q, k, v viewed [B, T, H, D] and transposed, HF RoPE, SDPA, then the
    output transposed back, ``.contiguous()`` and viewed. In eager SDPA's output follows q's layout,
    so the traced graph drops the no-op contiguous and keeps a bare view: the fused op must give
    eager's (transposed) layout or that view fails."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        freqs = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, T, D]
        q, k, v = (y.view(b, t, self.heads, self.head_dim).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).contiguous().view(b, t, -1).square().mean()


def test_layout_of_rotated_q_is_eagers():
    torch.manual_seed(0)
    model = _ViewAfterAttention()
    inputs = {"x": torch.randn(2, 9, 32)}
    loss_err, grad_err, report, _ = compiled_parity(model, inputs, loss_fn=lambda out: out)
    assert report.counts()["rope"] == 1 and not report.errors, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


class _TablesPerRotation(nn.Module):
    """One attention's q and k, each rotated (rotate_half) with its own copy of the tables, made by
    ``make`` from the shared cos / sin: equal values when ``make`` is deterministic."""

    def __init__(self, make):
        super().__init__()
        self.q, self.k, self.make = nn.Linear(16, 16), nn.Linear(16, 16), make

    def forward(self, x, cos, sin):  # x [B, T, 16] -> 2 heads of 8; cos, sin [T, 8]
        b, t, _ = x.shape
        out = []
        for proj in (self.q, self.k):
            h = proj(x).view(b, t, 2, 8).transpose(1, 2)
            c, s = self.make(cos), self.make(sin)
            rot = torch.cat((-h[..., 4:], h[..., :4]), dim=-1)
            out.append(h * c + rot * s)
        return (out[0] * out[1]).sum()


def test_rotations_pair_only_when_their_tables_are_equal_values():
    """q and k whose tables are computed twice by the same deterministic ops pair into one fused
    call (with parity); tables drawn through dropout twice differ, so each rotation is its own call."""
    t = 6
    pos = torch.arange(t, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, 4)
    cos, sin = torch.cat([pos.cos()] * 2, -1), torch.cat([pos.sin()] * 2, -1)
    x = torch.randn(2, t, 16)
    torch.manual_seed(0)
    twice = _TablesPerRotation(lambda c: (c * 1.5).unsqueeze(0).repeat_interleave(1, dim=0))
    loss_err, grad_err, report, _ = compiled_parity(twice, {"x": x, "cos": cos, "sin": sin},
                                                    loss_fn=lambda out: out)
    assert report.counts()["rope"] == 1, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    random = _TablesPerRotation(lambda c: nn.functional.dropout(c, 0.5, training=True))
    assert fxfuse.explain(random, x, cos, sin).counts()["rope"] == 2


class _RotateHalf(nn.Module):
    """Projections, then HF's rotate_half with the halves taken another way and -x2 spelled x2 * -1."""

    def __init__(self, how, d=16, heads=2):
        super().__init__()
        self.how, self.heads = how, heads
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def rotated(self, y):
        x1, x2 = halves(y, self.how)
        return torch.cat((x2 * -1, x1), dim=-1)

    def forward(self, x, cos, sin):
        b, t, d = x.shape

        def rope(y):
            y = y.view(b, t, self.heads, -1).transpose(1, 2)
            return y * cos + self.rotated(y) * sin

        return (rope(self.q(x)) * rope(self.k(x))).sum()


@pytest.mark.parametrize("how", ["chunk", "split", "split_sizes", "narrow"])
def test_rotate_half_halves_spelled_otherwise(how):
    """chunk / split / split_with_sizes / narrow halves and x * -1 read as HF's slices and negation:
    one fused site (q and k), loss and every gradient equal to eager's."""
    torch.manual_seed(0)
    t = 5
    ang = torch.arange(t, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, 4)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    inputs = {"x": torch.randn(2, t, 16), "cos": cos, "sin": sin}
    loss_err, grad_err, report, _ = compiled_parity(_RotateHalf(how), inputs, loss_fn=lambda out: out)
    assert report.counts()["rope"] == 1 and [s.variant for s in report.matched] == ["rope_rotate_half"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


@pytest.mark.parametrize("shape", [(7, 3, 8), (7, 8)], ids=["unbatched_heads", "rows"])
def test_rope_on_fewer_than_four_dims(shape):
    """Qwen2-VL's vision tower rotates unbatched [T, H, D] q / k with cos [T, 1, D]: lifted to rank 4
    for the kernel and back (it was unmatched: "input has 3 dims"); [T, D] rows too."""
    torch.manual_seed(0)
    x, k = (torch.randn(*shape, requires_grad=True) for _ in range(2))
    ang = torch.randn(shape[0], shape[-1] // 2).repeat(1, 2).view(shape[0], *([1] * (len(shape) - 2)), shape[-1])

    def rot(t):
        a, b = t.chunk(2, -1)
        return torch.cat((-b, a), -1)

    def fn(x, k):
        return ((x * ang.cos() + rot(x) * ang.sin()) * (k * ang.cos() + rot(k) * ang.sin()).flip(-1)).sum()

    ref = fn(x, k)
    ref_grads = torch.autograd.grad(ref, (x, k))
    torch._dynamo.reset()
    out = torch.compile(fn, backend="fxfuse", options={"inner": "aot_eager"})(x, k)
    grads = torch.autograd.grad(out, (x, k))
    assert fxfuse.last_report().counts()["rope"] == 1, str(fxfuse.last_report())  # q and k: one site
    assert rel_err(out, ref) < 1e-5 and max(rel_err(g, r) for g, r in zip(grads, ref_grads)) < 1e-5


def test_roformer_rotation_with_reshape_as_fused():
    """RoFormer rotates pairs with ``stack([-x[..., 1::2], x[..., ::2]], -1).reshape_as(x)`` (Cohere's
    spelling ends in flatten(-2)): reshape_as, view and flatten read as one reshape, so it is
    rope_interleaved, one site per layer, with the harness's count (a static rotary method)."""
    from transformers import AutoConfig, AutoModelForMaskedLM

    from fxfuse.sites import expected_sites

    cfg = AutoConfig.for_model("roformer", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(cfg)
    inputs = batch()
    assert expected_sites(model, inputs, True)["rope"] == 2
    loss_err, grad_err, report, _ = compiled_parity(model, inputs)
    assert [s.variant for s in report.matched if s.pattern == "rope"] == ["rope_interleaved"] * 2, str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


class _PairsReshaped(_RotateHalf):
    """Interleaved pairs rotated as RoFormer writes them, the merge spelled by `how`."""

    def rotated(self, y):
        pairs = torch.stack([-y[..., 1::2], y[..., ::2]], dim=-1)
        merged = {"reshape_as": lambda: pairs.reshape_as(y), "view": lambda: pairs.view(y.shape),
                  "reshape": lambda: pairs.reshape(*y.shape[:-1], -1), "flatten": lambda: pairs.flatten(-2)}
        return merged[self.how]()


@pytest.mark.parametrize("how", ["reshape_as", "view", "reshape", "flatten"])
def test_interleaved_pairs_merged_by_any_reshape(how):
    torch.manual_seed(0)
    t = 5
    ang = (torch.arange(t, dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, 4)).repeat_interleave(2, -1)
    inputs = {"x": torch.randn(2, t, 16), "cos": ang.cos(), "sin": ang.sin()}
    loss_err, grad_err, report, _ = compiled_parity(_PairsReshaped(how), inputs, loss_fn=lambda out: out)
    assert [s.variant for s in report.matched] == ["rope_interleaved"], str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def _modernbert(dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForMaskedLM

    cfg = AutoConfig.for_model("modernbert", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                               cls_token_id=1, sep_token_id=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForMaskedLM.from_config(cfg).to(dtype)


def test_modernbert_under_autocast_fuses_rotation_and_head():
    """ModernBERT rotates ``q.float()`` read twice (one cast to the patterns: normalize.canonical_casts)
    and its MLM head's decoder takes bf16 hidden states with an fp32 weight under autocast (cast to bf16
    as autocast does); both were unfused in bf16 autocast only. bf16 within 2x eager's error."""
    inputs = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fxfuse.explain(_modernbert(), **inputs)
    assert report.counts()["rope"] == 2 and report.counts()["linear_cross_entropy"] == 1, str(report)
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(_modernbert, inputs, autocast=True,
                                                      patterns=["rope", "linear_cross_entropy"])
    assert fxfuse.last_report().counts()["rope"] == 2
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))


def test_ernie_rotation_upcast_after_rotating_under_autocast():
    """ERNIE 4.5 writes ``(q.float() * cos) + (rotate_half(q).float() * sin)``: under bf16 autocast the
    rotated copy is cast on its own (in fp32 both casts vanish and it was rope_interleaved already)."""
    inputs = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = fxfuse.explain(hf_model("ernie4_5"), **inputs)
    sites = [s for s in report.matched if s.pattern == "rope"]
    assert [s.variant for s in sites] == ["rope_interleaved_ernie"] * 2, str(report)
    (e_loss, e_grad), (f_loss, f_grad) = bf16_errors(lambda dt: hf_model("ernie4_5", dtype=dt), inputs,
                                                      autocast=True, patterns=["rope"])
    assert fxfuse.last_report().counts()["rope"] == 2
    assert f_loss <= 2 * e_loss and f_grad <= 2 * e_grad, ((e_loss, e_grad), (f_loss, f_grad))
