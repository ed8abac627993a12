"""fxfuse/fold_add.py: a pre-norm block's residual-gradient add and the sum of its branch gradients
folded into fxfuse::rms_norm_backward_add (Inductor post-grad pass), and the op itself, the Triton
kernel under the interpreter and the CPU reference."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from fxfuse.kernels.rms_norm import rms_norm_backward, rms_norm_backward_add
from tests.helpers import hf_model, inductor_in_place
from tests.rms_norm_cases import EPS


@pytest.mark.interpreter
@pytest.mark.parametrize("m,d", [(1, 40), (199, 64), (3, 136), (2, 8200)])  # 8200: split backward, then add_
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_op_is_backward_then_eager_add(monkeypatch, m, d, dtype, with_weight, on_triton):
    """(dx + residual, dw) bit for bit: the kernel rounds the sum once, as eager's add."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(m * d)
    x, dy, r = (torch.randn(m, d, generator=g).to(dtype) for _ in range(3))
    w = torch.randn(d, generator=g).to(dtype) if with_weight else None
    dx, dw = rms_norm_backward(dy, x, w, EPS, 0.0, with_weight)
    got, got_dw = rms_norm_backward_add(dy, x, w, r, EPS, 0.0, with_weight)
    assert torch.equal(got, dx + r) and torch.equal(got_dw, dw)
    assert not torch.equal(got, dx)


@pytest.mark.interpreter
@pytest.mark.parametrize("m,d", [(1, 40), (199, 64), (2, 8200)])  # 8200: split backward, dy summed first
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts,residual", [(2, True), (3, False)])
@pytest.mark.parametrize("on_triton", [True, False], ids=["triton", "reference"])
def test_op_sums_dy_as_eager(monkeypatch, m, d, dtype, parts, residual, on_triton):
    """The backward of (dy + dy2) + dy3, each add rounded as eager's, bit for bit; with a residual too."""
    if not on_triton:
        monkeypatch.delenv("TRITON_INTERPRET")
    g = torch.Generator().manual_seed(m * d + parts)
    x, r, *dys = (torch.randn(m, d, generator=g).to(dtype) for _ in range(2 + parts))
    w = torch.randn(d, generator=g).to(dtype)
    dy = dys[0] + dys[1] if parts == 2 else (dys[0] + dys[1]) + dys[2]
    dx, dw = rms_norm_backward(dy, x, w, EPS, 0.0, True)
    got, got_dw = rms_norm_backward_add(dys[0], x, w, r if residual else None, EPS, 0.0, True, False, *dys[1:])
    assert torch.equal(got, dx + r if residual else dx) and torch.equal(got_dw, dw)
    if dtype == torch.bfloat16 and parts == 3:  # eager's two roundings, not one: a sum rounded once differs
        once = (dys[0].float() + dys[1].float() + dys[2].float()).to(dtype)
        assert not torch.equal(rms_norm_backward(once, x, w, EPS, 0.0, True)[0], got)


@pytest.mark.interpreter
def test_opcheck_and_bad_residual():
    g = torch.Generator().manual_seed(0)
    x, dy, r = (torch.randn(3, 4, 40, generator=g) for _ in range(3))
    w = torch.randn(40, generator=g)
    for compute_dw in (True, False):
        torch.library.opcheck(rms_norm_backward_add, (dy, x, w, r, EPS, 0.0, compute_dw))
    with pytest.raises(ValueError, match="residual .* must have x's shape and dtype"):
        rms_norm_backward_add(dy, x, w, r.double(), EPS, 0.0, True)
    with pytest.raises(ValueError, match="residual .* must have x's shape and dtype"):
        rms_norm_backward_add(dy, x, w, r[:, :1], EPS, 0.0, True)
    torch.library.opcheck(rms_norm_backward_add, (dy, x, w, None, EPS, 0.0, True, False, r, x))
    with pytest.raises(ValueError, match="dy3 .* must have dy's shape and dtype"):
        rms_norm_backward_add(dy, x, w, None, EPS, 0.0, True, False, r, x.half())


class PreNorm(nn.Module):
    """A hand-written pre-norm stack (nn.RMSNorm, residual adds written both ways round)."""

    def __init__(self, d=48, layers=3):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(d, eps=EPS) for _ in range(layers))
        self.mixes = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.final = nn.RMSNorm(d, eps=EPS)
        self.head = nn.Linear(d, 7)

    def forward(self, x, labels):
        for i, (norm, mix) in enumerate(zip(self.norms, self.mixes)):
            x = x + mix(norm(x)) if i % 2 else mix(norm(x)) + x
        logits = self.head(self.final(x))
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_hand_written_stack_folds_every_block_norm():
    """Each block's norm input gradient meets the residual stream's in one add: 3 folds; the final
    norm's dx also feeds the last block's matmul backward, so it keeps its add. Loss and every
    gradient as eager (fp32)."""
    g = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(2, 5, 48, generator=g, requires_grad=True),
              "labels": torch.randint(0, 7, (2, 5), generator=g)}
    model = PreNorm()
    _, loss_err, grad_err = inductor_in_place(model, inputs)
    assert counters["fxfuse"]["residual_adds_folded"] == 3 and loss_err < 1e-5 and grad_err < 1e-5


class Branches(nn.Module):
    """Pre-norm blocks whose norm output feeds two or three linears: its gradient is a sum."""

    def __init__(self, d=40, layers=2):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(d, eps=EPS) for _ in range(layers))
        self.proj = nn.ModuleList(nn.ModuleList(nn.Linear(d, d) for _ in range(2 + i % 2)) for i in range(layers))
        self.head = nn.Linear(d, 7)

    def forward(self, x, labels):
        for norm, proj in zip(self.norms, self.proj):
            n = norm(x)
            x = x + proj[0](n) * torch.sigmoid(proj[1](n)) + (proj[2](n) if len(proj) > 2 else 0)
        return SimpleNamespace(loss=nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten()))


def test_branch_gradient_sums_fold():
    """Two and three branch gradients summed at the norms' outputs: both sums fold, and both
    residual adds; loss and every gradient as eager (fp32)."""
    g = torch.Generator().manual_seed(2)
    inputs = {"x": torch.randn(2, 5, 40, generator=g, requires_grad=True),
              "labels": torch.randint(0, 7, (2, 5), generator=g)}
    _, loss_err, grad_err = inductor_in_place(Branches(), inputs)
    folded = counters["fxfuse"]["gradient_sums_folded"], counters["fxfuse"]["residual_adds_folded"]
    assert folded == (2, 2) and loss_err < 1e-5 and grad_err < 1e-5


@pytest.mark.parametrize("options,folds", [({}, 4), ({"inplace_backward": False}, 0)])
def test_llama_folds_with_parity(options, folds):
    """HF Llama, 2 layers: input and post-attention norms of both layers fold their residual add (4),
    the final norm does not; each of the four also folds its dy, the sum of the q, k, v or the gate,
    up input gradients (the final norm's dy comes from the loss head alone). inplace_backward=False
    leaves every add in place. Loss and gradients as eager."""
    model = hf_model("llama", num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    _, loss_err, grad_err = inductor_in_place(model, {"input_ids": ids, "labels": ids}, options)
    folded = counters["fxfuse"]["residual_adds_folded"], counters["fxfuse"]["gradient_sums_folded"]
    assert folded == (folds, folds) and loss_err < 1e-5 and grad_err < 1e-5


def test_llama_dynamic_shapes_folds_in_the_one_graph():
    """dynamic=True: one graph for two sequence lengths, its backward folds both kinds of add (4 + 4,
    symbolic sizes compared as such), loss and gradients as eager at both lengths."""
    import copy

    from tests.helpers import loss_and_grads, rel_err

    model = hf_model("llama", num_hidden_layers=2)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    # causal_attention off: its is_causal variant of the graph would compile (and fold) a second time
    compiled = torch.compile(model, backend="fxfuse", dynamic=True, options={"inner": "inductor",
                                                                              "causal_attention": False})
    g = torch.Generator().manual_seed(3)
    with torch._inductor.config.patch(force_disable_caches=True):
        for length in (9, 13):
            ids = torch.randint(0, model.config.vocab_size, (2, length), generator=g)
            loss, grads = loss_and_grads(model, {"input_ids": ids, "labels": ids}, call=compiled)
            ref_loss, ref_grads = loss_and_grads(ref, {"input_ids": ids, "labels": ids})
            assert rel_err(loss, ref_loss) < 1e-5 and max(rel_err(grads[k], ref_grads[k]) for k in ref_grads) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1
    assert (counters["fxfuse"]["residual_adds_folded"], counters["fxfuse"]["gradient_sums_folded"]) == (4, 4)
