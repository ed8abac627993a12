"""fxfuse.reinplace: gated-MLP gradients written over buffers the backward graph no longer reads.

The *_into kernels with each output over the input it is computed from (Triton under the
interpreter) give the functional op's bits; the pass on traced backward graphs places a gradient
only over fresh storage nobody reads afterwards, and the rewritten graph computes what it did; a
checkpointed HF Llama compiled with Inductor places both gradients of every layer (one without
checkpointing), Phi-3 and gpt-oss their packed d gate_up, and all keep eager's loss and gradients.
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxfuse.kernels.clamped_swiglu  # noqa: F401
import fxfuse.kernels.swiglu  # noqa: F401
from fxfuse.options import Options
from fxfuse.reinplace import ReinplacePass, reinplace
from tests.helpers import batch, hf_model, inductor_in_place, random_biases

OPS = torch.ops.fxfuse
SHAPES = [(1, 7), (199, 33), (3, 5, 130), (4, 1100)]


def _rand(shape, dtype, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def _backward(kind, dout, gate, up, need):
    if kind == "swiglu":
        return OPS.swiglu_backward(dout, gate, up, "silu", *need)
    return OPS.clamped_swiglu_backward(dout, gate, up, 1.702, 7.0, *need)


def _backward_into(kind, dout, gate, up, dgate, dup, need):
    if kind == "swiglu":
        return OPS.swiglu_backward_into(dout, gate, up, "silu", dgate, dup, *need)
    return OPS.clamped_swiglu_backward_into(dout, gate, up, 1.702, 7.0, dgate, dup, *need)


@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)])
def test_into_over_its_inputs_matches_the_functional_op(kind, shape, dtype, need):
    gate, up, dout = (_rand(shape, dtype, s) for s in range(3))
    dgate, dup = _backward(kind, dout, gate, up, need)
    g, d = gate.clone(), dout.clone()
    empty = gate.new_empty(0)
    _backward_into(kind, d, g, up, g if need[0] else empty, d if need[1] else empty, need)
    assert torch.equal(g, dgate if need[0] else gate)
    assert torch.equal(d, dup if need[1] else dout)


def _packed_backward(kind, dout, gate_up, layout):
    if kind == "swiglu":
        return OPS.swiglu_packed_backward(dout, gate_up, "silu", *layout)
    if kind == "softcapped_swiglu":
        return OPS.softcapped_swiglu_packed_backward(dout, gate_up, 3.0, 5.0, *layout)
    return OPS.clamped_swiglu_packed_backward(dout, gate_up, 1.702, 7.0, *layout)


def _packed_backward_into(kind, dout, gate_up, layout):
    if kind == "swiglu":
        return OPS.swiglu_packed_backward_into(dout, gate_up, "silu", *layout)
    if kind == "softcapped_swiglu":
        return OPS.softcapped_swiglu_packed_backward_into(dout, gate_up, 3.0, 5.0, *layout)
    return OPS.clamped_swiglu_packed_backward_into(dout, gate_up, 1.702, 7.0, *layout)


@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu", "softcapped_swiglu"])
@pytest.mark.parametrize("shape", [(1, 14), (199, 66), (3, 5, 260)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [(False, False), (False, True), (True, False), (True, True)])  # interleaved, up_first
def test_packed_into_over_gate_up_matches_the_functional_op(kind, shape, dtype, layout):
    """d gate_up written over gate_up (halves or interleaved columns, gate first or up first)."""
    gate_up, dout = _rand(shape, dtype, 0), _rand((*shape[:-1], shape[-1] // 2), dtype, 1)
    expected = _packed_backward(kind, dout, gate_up, layout)
    gu = gate_up.clone()
    _packed_backward_into(kind, dout, gu, layout)
    assert torch.equal(gu, expected)


N, H, I = 12, 8, 6


def _weights():
    return [_rand(s, torch.float32, k) for k, s in enumerate([(N, H), (I, H), (I, H), (H, I), (N, H)])]


def _layer(body):
    """A checkpointed MLP layer's backward as the partitioner writes it: gate and up recomputed
    from x, dh from dy; body(dh, gate, up) -> what the graph returns."""
    def f(x, wg, wu, wd, dy):
        gate, up, dh = torch.mm(x, wg.t()), torch.mm(x, wu.t()), torch.mm(dy, wd)
        return body(dh, gate, up, x, wg, wu)
    return f


def _tail(dgate, dup, x, wg, wu):
    return torch.mm(dgate, wg) + torch.mm(dup, wu), torch.mm(dgate.t(), x)


def _plain(dh, gate, up, x, wg, wu):
    return _tail(*OPS.swiglu_backward(dh, gate, up, "silu", True, True), x, wg, wu)


def _gate_read_after(dh, gate, up, x, wg, wu):
    return (*_plain(dh, gate, up, x, wg, wu), gate * 2)


def _gate_view_read_after(dh, gate, up, x, wg, wu):
    flat = gate.view(-1)  # a view taken before the call, read after it
    return (*_plain(dh, gate, up, x, wg, wu), flat + 1)


def _dh_returned(dh, gate, up, x, wg, wu):
    return (*_plain(dh, gate, up, x, wg, wu), dh)


def _dup_only(dh, gate, up, x, wg, wu):
    _, dup = OPS.swiglu_backward(dh, gate, up, "silu", False, True)
    return torch.mm(dup, wu), torch.mm(dup.t(), x)


def _packed(dh, gate, up, x, wg, wu):  # gate and up as halves of one matmul: not contiguous
    g, u = torch.cat([gate, up], dim=1).mm(torch.eye(2 * I)).chunk(2, dim=1)
    return _plain(dh, g, u, x, wg, wu)


def _clamped(dh, gate, up, x, wg, wu):
    return _tail(*OPS.clamped_swiglu_backward(dh, gate, up, 1.702, 7.0, True, True), x, wg, wu)


@pytest.mark.parametrize("body,placed", [
    (_plain, 2), (_clamped, 2), (_gate_read_after, 1), (_gate_view_read_after, 1), (_dh_returned, 1),
    (_dup_only, 1), (_packed, 1),
])
def test_pass_places_only_over_dead_fresh_buffers(body, placed):
    f, args = _layer(body), _weights()
    gm = make_fx(f, tracing_mode="fake")(*args)
    expected = gm(*args)
    assert reinplace(gm.graph) == placed
    gm.recompile()
    intos = [n for n in gm.graph.nodes if "backward_into" in str(n.target)]
    assert len(intos) == 1 and not any(str(n.target).endswith("_backward.default") for n in gm.graph.nodes)
    got = gm(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu", "softcapped_swiglu"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("read_after", [False, True])
def test_pass_places_packed_gradient_over_a_dead_gate_up(kind, interleaved, read_after):
    """A packed backward (Phi-3's halves, gpt-oss's interleaved columns, Inkling 2's) on a gate_up recomputed in
    the graph: d gate_up goes over it, unless gate_up is read afterwards."""
    def f(x, wg, wu, wd, dy):
        w = torch.cat([wg, wu])  # [2I, H]
        gate_up = torch.mm(x, w.t())
        d = _packed_backward(kind, torch.mm(dy, wd), gate_up, (interleaved, False))
        out = torch.mm(d, w), torch.mm(d.t(), x)
        return (*out, gate_up * 2) if read_after else out

    args = _weights()
    gm = make_fx(f, tracing_mode="fake")(*args)
    expected = gm(*args)
    assert reinplace(gm.graph) == (0 if read_after else 1)
    gm.recompile()
    assert sum("packed_backward_into" in str(n.target) for n in gm.graph.nodes) == (0 if read_after else 1)
    assert all(torch.equal(a, b) for a, b in zip(gm(*args), expected))


def test_pass_leaves_graph_inputs_alone():
    """Without checkpointing gate and up are saved tensors (backward graph inputs): never
    overwritten; dh, a matmul of the graph, takes dup."""
    def f(gate, up, dy, wd, wu):
        dgate, dup = OPS.swiglu_backward(torch.mm(dy, wd), gate, up, "silu", True, True)
        return dgate * 1, torch.mm(dup, wu)

    args = [_rand(s, torch.float32, k) for k, s in enumerate([(N, I), (N, I), (N, H), (H, I), (I, H)])]
    gm = make_fx(f, tracing_mode="fake")(*args)
    expected = gm(*args)
    saved = [a.clone() for a in args]
    assert reinplace(gm.graph) == 1
    gm.recompile()
    assert all(torch.equal(a, b) for a, b in zip(gm(*args), expected))
    assert all(torch.equal(a, b) for a, b in zip(args, saved))


def test_pass_gives_a_fresh_gradient_its_input_dtype():
    """A mixed-dtype swiglu (an fp32 gate computed in the graph, a bf16 up, as under autocast): dgate
    goes over the dead gate; dup (bf16) cannot go over the fp32 grad_out and gets a fresh buffer of up's
    dtype, not gate's."""
    def f(x, wg, up, dy, wd):
        gate = torch.mm(x, wg.t())
        dgate, dup = OPS.swiglu_backward(torch.mm(dy, wd), gate, up, "silu", True, True)
        return torch.mm(dgate, wg), dup * 1

    args = [_rand(s, torch.float32, k) for k, s in enumerate([(N, H), (I, H), (N, I), (N, H), (H, I)])]
    args[2] = args[2].bfloat16()
    gm = make_fx(f, tracing_mode="fake")(*args)
    expected = gm(*args)
    assert reinplace(gm.graph) == 1
    gm.recompile()
    got = gm(*args)
    assert [t.dtype for t in got] == [torch.float32, torch.bfloat16]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _compiled_llama(checkpointing: bool, options: dict, model_type: str = "llama"):
    from fxfuse.zoo import HF_ZOO

    model = random_biases(hf_model(model_type, **{**HF_ZOO.get(model_type, {}), "num_hidden_layers": 2}))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return inductor_in_place(model, batch(), options)


@pytest.mark.hf_checkpointing
@pytest.mark.parametrize("checkpointing,placed", [(True, 4), (False, 2)])
def test_llama_inductor_places_gradients_with_parity(checkpointing, placed):
    n, loss_err, grad_err = _compiled_llama(checkpointing, {})
    assert n == placed and loss_err < 1e-5 and grad_err < 1e-5


@pytest.mark.hf_checkpointing
@pytest.mark.parametrize("model_type", ["phi3", "gpt_oss", "inkling2_text"])
def test_packed_models_place_d_gate_up_under_checkpointing(model_type):
    """Phi-3 (halves, SiLU), gpt-oss (interleaved, clamped) and Inkling 2 (halves, softcapped): each
    checkpointed layer's d gate_up is written over its recomputed gate_up; eager's loss and every
    gradient kept."""
    n, loss_err, grad_err = _compiled_llama(True, {}, model_type)
    assert n == 2 and loss_err < 1e-5 and grad_err < 1e-5


@pytest.mark.hf_checkpointing
def test_option_off_and_user_pass_kept():
    """A user's post-grad pass given in inductor_config runs after fxfuse's, on the backward graph
    too (AOTAutograd compiles it at the first backward, after fxfuse's compile call has returned:
    the options travel as compile_fx's config_patches); inplace_backward=False places nothing."""
    seen = []

    class Mine(ReinplacePass):  # a user's own post-grad pass: still runs, after fxfuse's
        def __call__(self, graph):
            seen.append(sum(1 for n in graph.nodes if "backward_into" in str(n.target)))

    n, loss_err, grad_err = _compiled_llama(True, {"inductor_config": {"post_grad_custom_post_pass": Mine()}})
    assert n == 4 and 2 in seen and loss_err < 1e-5 and grad_err < 1e-5
    n, loss_err, grad_err = _compiled_llama(True, {"inplace_backward": False})
    assert n == 0 and loss_err < 1e-5 and grad_err < 1e-5
    assert "post_grad_custom_post_pass" not in Options.parse({"inplace_backward": False}).inductor_patches()
    with pytest.raises(ValueError, match="inplace_backward"):
        Options.parse({"inplace_backward": "yes"})


def test_off_and_refused_before_the_verified_torch(monkeypatch):
    """Before TESTED_TORCH (torch 2.6 gave a wrong tied-embedding gradient with the pass) the
    default is off and asking for it is a clear error; from it on the default is on."""
    from fxfuse import options

    assert options.tested_torch() == (options.torch_version() >= options.TESTED_TORCH)
    monkeypatch.setattr(options, "torch_version", lambda: (2, 6))
    assert not Options.parse({}).inplace_backward
    assert "post_grad_custom_post_pass" not in Options.parse({}).inductor_patches()
    with pytest.raises(ValueError, match=r"needs torch >= 2\.11 \(this is 2\.6\)"):
        Options.parse({"inplace_backward": True})
    monkeypatch.setattr(options, "torch_version", lambda: options.TESTED_TORCH)
    assert Options.parse({}).inplace_backward and "post_grad_custom_post_pass" in Options.parse({}).inductor_patches()


def test_recompute_tags_carry_a_region_id_before_the_tested_torch(monkeypatch):
    """Before TESTED_TORCH a fused call tagged for recomputation also gets the largest checkpoint
    region id (torch 2.6's partitioner reads one on every tagged node next to another: KeyError);
    from it on no id is added (later partitioners skip untagged nodes)."""
    import torch.fx as fx

    from fxfuse import options
    from fxfuse.rewrite import _tag_recompute

    def graph():
        def f(x, w):
            return torch.ops.fxfuse.rms_norm.default(x, w, 1e-6, 0.0, True, torch.float32) * 2

        return fx.symbolic_trace(f).graph

    for version, tagged in (((2, 6), True), (options.TESTED_TORCH, False)):
        monkeypatch.setattr(options, "torch_version", lambda v=version: v)
        g = graph()
        _tag_recompute(g.nodes)
        fused = [n for n in g.nodes if "fxfuse" in str(n.target)]
        assert len(fused) == 1 and "recompute" in fused[0].meta
        assert (fused[0].meta.get("ac_graph_id") == float("inf")) == tagged
        assert all("ac_graph_id" not in n.meta for n in g.nodes if n not in fused)
