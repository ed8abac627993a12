"""Causal attention (fxfuse/attention.py): an SDPA call with a constant causal mask becomes
is_causal=True (and repeat_kv becomes enable_gqa); every other mask is left alone, with a reason."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxfuse
from fxfuse.backend import transform
from fxfuse.options import Options
from helpers import batch, compiled_parity, hf_model

FP32_TOL = 1e-5


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF's repeat_kv: [B, Hkv, T, D] -> [B, Hkv * n_rep, T, D]."""
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def hf517_mask(b: int, t: int, device) -> torch.Tensor:
    """What transformers <= 5.17 builds under Dynamo: kv_idx <= q_idx, [B, 1, T, T] bool."""
    q_idx = torch.arange(t, device=device)[None, None, :, None]
    kv_idx = torch.arange(t, device=device)[None, None, None, :]
    return (kv_idx <= q_idx).expand(b, -1, t, t)


def float_mask(b: int, t: int, device) -> torch.Tensor:
    """Additive mask of older HF code: 0 where allowed, finfo.min above the diagonal."""
    keep = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    m = torch.zeros(t, t, device=device).masked_fill(~keep, torch.finfo(torch.float32).min)
    return m[None, None].expand(b, 1, t, t)


def window_mask(b: int, t: int, device) -> torch.Tensor:
    """Sliding window of 3: constant, but not the causal mask."""
    i = torch.arange(t, device=device)
    return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 3))[None, None].expand(b, 1, t, t)


def bias_mask(b: int, t: int, device) -> torch.Tensor:
    """ALiBi-like: causal, plus a distance bias: constant, but changes the result."""
    i = torch.arange(t, device=device)
    dist = (i[None, :] - i[:, None]).float() * 0.5
    return dist.masked_fill(i[None, :] > i[:, None], float("-inf"))[None, None].expand(b, 1, t, t)


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, mask=hf517_mask):
        super().__init__()
        self.heads, self.kv_heads, self.d, self.mask = heads, kv_heads, dim // heads, mask
        self.q = nn.Linear(dim, heads * self.d, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, padding=None):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2 * self.kv_heads, self.d).transpose(1, 2).chunk(2, dim=1)
        mask = self.mask(b, t, x.device)
        if padding is not None:  # HF: causal & padding, from the inputs
            mask = mask & padding[:, None, None, :].bool()
        n_rep = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), attn_mask=mask,
                                             scale=self.d ** -0.5)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Net(nn.Module):
    def __init__(self, layers=2, **kw):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(Attention(**kw) for _ in range(layers))
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, ids, padding=None):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + layer(h, padding)
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), ids.flatten())


def inputs(t=11, padding=False):
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (2, t))
    out = {"ids": ids}
    if padding:
        pad = torch.ones(2, t, dtype=torch.long)
        pad[0, :3] = 0
        out["padding"] = pad
    return out


def sdpa_calls(gm):
    return [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]


def rewritten_graph(model, options=None, **kw):
    gm, ex = None, None

    def capture(g, example_inputs):
        nonlocal gm, ex
        gm, ex = g, example_inputs
        return g

    torch.compile(model, backend=capture)(**kw)
    return transform(gm, ex, Options.parse({"inner": "aot_eager"} | (options or {})))


@pytest.mark.parametrize("mask,variant", [(hf517_mask, "sdpa_causal_gqa"), (float_mask, "sdpa_causal_gqa")])
def test_constant_causal_mask_becomes_is_causal(mask, variant):
    model = Net(mask=mask)
    loss_err, grad_err, report, names = compiled_parity(model, inputs(), loss_fn=lambda out: out)
    assert [s.variant for s in report.attention] == [variant] * 2, str(report)
    assert all(not s.reason and s.module.startswith("layers.") for s in report.attention)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)
    assert {"layers.0.kv.weight", "layers.1.q.weight"} <= set(names)
    assert "2 SDPA call(s) given is_causal=True" in str(report)
    assert all(s.saved.startswith("2 tensors") for s in report.attention)


def test_rewritten_sdpa_has_no_mask_and_no_repeat():
    gm, report = rewritten_graph(Net(), **inputs())
    calls = sdpa_calls(gm)
    assert len(calls) == 2
    for n in calls:
        assert n.kwargs["attn_mask"] is None and n.kwargs["is_causal"] and n.kwargs["enable_gqa"]
        assert n.args[1].meta["val"].shape[1] == 2  # k with its 2 kv heads, not repeated to 4
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.aten.expand.default], gm.code


def test_mha_mask_without_repeat_is_causal_only():
    model = Net(kv_heads=4)  # n_rep 1: repeat_kv still expands by 1; heads match
    loss_err, grad_err, report, _ = compiled_parity(model, inputs(), loss_fn=lambda out: out)
    assert len(report.attention) == 2 and all(not s.reason for s in report.attention), str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


@pytest.mark.parametrize("mask,why", [(window_mask, "not the causal"), (bias_mask, "adds a bias")])
def test_other_constant_masks_are_kept(mask, why):
    model = Net(mask=mask)
    loss_err, grad_err, report, _ = compiled_parity(model, inputs(), loss_fn=lambda out: out)
    assert len(report.attention) == 2 and all(why in s.reason for s in report.attention), str(report)
    assert loss_err < FP32_TOL and grad_err < FP32_TOL
    gm, _ = rewritten_graph(Net(mask=mask), **inputs())
    assert all(n.args[3] is not None or n.kwargs.get("attn_mask") is not None for n in sdpa_calls(gm))


def test_padding_mask_from_inputs_is_checked_and_kept_at_run_time(paths):
    """A mask computed from an input is compared with the causal mask before each call: with
    padding it is not causal, so the graph runs as traced, mask and all."""
    model = Net()
    loss_err, grad_err, report, _ = compiled_parity(model, inputs(padding=True), loss_fn=lambda out: out)
    assert [s.variant for s in report.attention] == ["sdpa_causal_gqa_checked"] * 2, str(report)
    assert paths == ["traced"], paths
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


def test_all_ones_padding_runs_causal(paths):
    """HF's collators pass attention_mask even when nothing is padded: causal at run time."""
    feed = inputs(padding=True)
    feed["padding"][:] = 1
    loss_err, grad_err, report, _ = compiled_parity(Net(), feed, loss_fn=lambda out: out)
    assert paths == ["causal"], paths
    assert loss_err < FP32_TOL and grad_err < FP32_TOL


def test_dynamic_shapes_check_the_mask_at_run_time(paths):
    """Under dynamic shapes the mask's producers read symbolic sizes (no compile-time value): the
    mask is compared at run time and found causal at every length."""
    model = Net()
    sites = []
    for t in (11, 13, 17):
        loss_err, grad_err, report, _ = compiled_parity(model, inputs(t=t), loss_fn=lambda out: out, dynamic=True)
        assert loss_err < FP32_TOL and grad_err < FP32_TOL, (t, loss_err, grad_err)
        sites += report.attention
    assert sites and all(s.variant.endswith("_checked") and not s.reason for s in sites), sites
    assert paths and set(paths) == {"causal"}, paths


def test_option_off_leaves_attention_alone():
    gm, report = rewritten_graph(Net(), options={"causal_attention": False}, **inputs())
    assert report.attention == []
    assert all(n.args[3] is not None for n in sdpa_calls(gm))
    with pytest.raises(ValueError, match="causal_attention"):
        Options.parse({"causal_attention": "yes"})


def test_report_json_and_explain_list_attention():
    report = fxfuse.explain(Net(), **inputs())
    assert len(report.attention) == 2
    assert '"attention"' in report.to_json() and "sdpa_causal_gqa" in report.to_json()


def test_bf16_causal_rewrite_error_within_eager():
    ids = inputs()

    def run(dtype, compiled):
        torch.manual_seed(0)
        model = Net().to(dtype)
        call = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}) if compiled else model
        loss = call(**ids)
        loss.backward()
        return loss.double(), torch.cat([p.grad.double().flatten() for p in model.parameters()])

    ref_loss, ref_g = run(torch.float32, False)
    e_loss, e_g = run(torch.bfloat16, False)
    f_loss, f_g = run(torch.bfloat16, True)
    e_err = (e_g - ref_g).norm() / ref_g.norm()
    f_err = (f_g - ref_g).norm() / ref_g.norm()
    assert f_err <= 2 * e_err + 1e-6, (f_err, e_err)
    assert abs(f_loss - ref_loss) <= 2 * abs(e_loss - ref_loss) + 1e-3


def test_hf_llama_gqa_mask_rewritten_with_parity():
    """HF builds a constant causal mask under Dynamo (transformers <= 5.17 always; later versions with
    use_cache=False): every such SDPA call is rewritten, GQA heads unrepeated, loss and grads as eager."""
    model = hf_model("llama", num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ids = batch()
    gm, _ = rewritten_graph(copy.deepcopy(model), options={"causal_attention": False}, **ids)
    masked = [n for n in sdpa_calls(gm) if len(n.args) > 3 and n.args[3] is not None]
    loss_err, grad_err, report, _ = compiled_parity(model, ids)
    assert len(report.attention) == len(masked), str(report)
    assert all(not s.reason for s in report.attention), str(report)
    assert {s.variant for s in report.attention} <= {"sdpa_causal_gqa"}
    assert loss_err < FP32_TOL and grad_err < FP32_TOL, (loss_err, grad_err)


def test_expanded_mask_is_checked_on_its_data_not_its_broadcast(monkeypatch):
    """The [B, 1, T, T] expand of a [T, T] mask is a view: only the [T, T] data counts against the
    evaluation cap (B x T^2 would reject 4 x 8192 tokens)."""
    import fxfuse.attention as attention

    monkeypatch.setattr(attention, "_MAX_ELEMENTS", 11 * 11)  # the [11, 11] mask fits, [2, 1, 11, 11] not
    _, report = rewritten_graph(Net(), **inputs(t=11))
    assert len(report.attention) == 2 and all(not s.reason for s in report.attention), str(report)
    monkeypatch.setattr(attention, "_MAX_ELEMENTS", 11 * 11 - 1)
    _, report = rewritten_graph(Net(), **inputs(t=11))  # too large for the CPU: checked at run time
    assert [s.variant for s in report.attention] == ["sdpa_causal_gqa_checked"] * 2, str(report)


@pytest.mark.parametrize("device,dtype,gqa", [("cpu", torch.float32, True), ("cuda", torch.bfloat16, True),
                                              ("cuda", torch.float16, True), ("cuda", torch.float32, False)])
def test_repeat_kv_kept_where_cuda_has_no_gqa_kernel(device, dtype, gqa):
    """fp32 q on CUDA keeps its repeated k / v (measured on an H100: is_causal + enable_gqa in fp32
    ran the math backend); fp16 / bf16 on CUDA and the CPU take enable_gqa. The graph is traced on
    the CPU and its q given the meta value of a CUDA tensor (fake: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxfuse.attention import causal_attention

    def attn(q, k, v):
        mask = hf517_mask(q.shape[0], q.shape[2], q.device)
        return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask)

    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    gm = make_fx(attn, pre_dispatch=True)(q, k, v)
    with FakeTensorMode():
        fake_q = torch.empty(q.shape, dtype=dtype, device=device)
    next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"] = fake_q
    done, left = causal_attention(gm)
    assert [s.variant for s in done] == ["sdpa_causal_gqa" if gqa else "sdpa_causal"] and not left
    (call,) = sdpa_calls(gm)
    assert call.kwargs["is_causal"] and call.kwargs["attn_mask"] is None and bool(call.kwargs["enable_gqa"]) == gqa
    assert call.args[1].meta["val"].shape[1] == (2 if gqa else 4)
    assert torch.allclose(gm(q, k, v), attn(q, k, v), atol=1e-6)
