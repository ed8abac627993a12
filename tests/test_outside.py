"""What ran outside every compiled graph (fxfuse/outside.py): ``fxfuse.explain`` names the graph
breaks and lists the site modules that ran eagerly, unfused, as unmatched sites with a reason;
without the census they were simply missing from the report.

Two hand-written mechanisms: a ``torch.compiler.disable``d call of a norm, and transformers 5.25's
(a checkpointed layer whose forward mutates an object from outside the checkpoint: Dynamo refuses
the side effect inside the checkpoint call, so the whole layer runs eagerly).
"""
from __future__ import annotations

import copy
import logging
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fxfuse
from fxfuse import outside
from fxfuse.checkpoint import skip_checkpoint_side_effect_replay
from fxfuse.harness import check
from fxfuse.outside import OUTSIDE_LOSS_REASON, OUTSIDE_REASON, Census, break_line
from tests.helpers import batch, hf_model
from tests.models import TitanLM

FULL = {"rms_norm": 5, "rope": 2, "swiglu": 2, "linear_cross_entropy": 1}  # TitanLM: 2 layers + norm + head


@torch.compiler.disable
def _eager_norm(norm, x):
    return norm(x)


class DisabledNormTitan(TitanLM):
    """The final norm is called through a compiler-disabled function: a graph break."""

    def forward(self, input_ids, labels=None):
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, self.freqs_cis[: input_ids.shape[1]])
        logits = self.output(_eager_norm(self.norm, x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class _Collector:
    """Stands in for transformers 5.25's output collector (a context variable set in forward)."""

    last = None


COLLECT = _Collector()


class SideEffectTitan(TitanLM):
    """Every block checkpointed, and each block's forward records its input on an outside object."""

    def forward(self, input_ids, labels=None):
        x = self.tok_embeddings(input_ids)
        freqs = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            x = checkpoint(self._block, layer, x, freqs, use_reentrant=False)
        logits = self.output(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    @staticmethod
    def _block(layer, x, freqs):
        COLLECT.last = x.shape
        return layer(x, freqs)


class LoopBreakTitan(TitanLM):
    """A graph break in the layer loop: Dynamo skips forward and compiles TitanBlock.forward as a
    frame of its own, once, then reuses that graph for the second block (as in JetMoE and DBRX)."""

    def forward(self, input_ids, labels=None):
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, self.freqs_cis[: input_ids.shape[1]])
            torch._dynamo.graph_break()
        logits = self.output(self.norm(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _titan(cls):
    torch.manual_seed(0)
    return cls()


def test_no_graph_break_means_nothing_outside():
    report = fxfuse.explain(_titan(TitanLM), **batch())
    assert report.counts() == FULL and not report.unmatched
    assert report.graph_breaks == [] and report.outside == []
    assert "outside" not in str(report) and "graph break" not in str(report)


def test_disabled_call_is_reported_outside_with_its_graph_break():
    report = fxfuse.explain(_titan(DisabledNormTitan), **batch())
    assert report.counts() == FULL | {"rms_norm": 4}  # the head's graph starts from the norm's output
    outside = [s for s in report.unmatched if s.graph == -1]
    assert [(s.pattern, s.module, s.reason) for s in outside] == [("rms_norm", "norm", OUTSIDE_REASON)]
    assert outside[0].source.startswith("normalization.py:")  # nn.RMSNorm.forward
    assert report.outside == ["norm (RMSNorm) x1"]
    assert any("disable" in b.lower() for b in report.graph_breaks), report.graph_breaks
    text = str(report)
    assert "ran eagerly, outside every compiled graph (module forwards; modules they call may still compile): norm (RMSNorm) x1" in text
    assert "graph break: " in text and OUTSIDE_REASON in text
    assert "outside" in report.to_json() and "graph_breaks" in report.to_json()


def test_checkpointed_side_effect_layers_are_reported_outside():
    report = fxfuse.explain(_titan(SideEffectTitan), **batch())
    outside = sorted((s.pattern, s.module) for s in report.unmatched if s.graph == -1)
    # both blocks ran eagerly: their norms, and each block is a rope site (wq, wk) and a swiglu site
    # (w1, w3); the break sits in forward's loop, so Dynamo skips that whole frame and the final
    # nn.RMSNorm, called from it, runs eagerly too (Dynamo does not compile a torch.nn forward alone)
    assert outside == sorted([("rms_norm", f"layers.{i}.{n}") for i in (0, 1) for n in ("attention_norm", "ffn_norm")]
                             + [(p, f"layers.{i}") for i in (0, 1) for p in ("rope", "swiglu")] + [("rms_norm", "norm")]
                             + [("linear_cross_entropy", "")])  # the loss, in the skipped forward too
    assert report.counts() == report.calls == dict.fromkeys(FULL, 0)
    assert report.outside == ["(root) (SideEffectTitan) x1", "tok_embeddings (Embedding) x1", "layers.* (TitanBlock) x2",
                              "norm (RMSNorm) x1", "output (Linear) x1"]
    hop = [b for b in report.graph_breaks if b.startswith("HOP: ") and "side effect" in b]
    assert hop and "frame skipped: forward" in hop[0], report.graph_breaks


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"),
                    reason="this torch has no skip_fwd_side_effects_in_bwd_under_checkpoint")
def test_dynamos_hint_brings_checkpointed_side_effect_layers_back():
    torch._dynamo.reset()  # torch 2.11 keeps the frame skip of an earlier test's compile of this forward
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        report = fxfuse.explain(_titan(SideEffectTitan), **batch())
    assert report.counts() == FULL and not report.unmatched and not report.outside


def test_census_sees_eager_forwards_only_and_leaves_the_model_as_it_was():
    model = _titan(TitanLM)
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    with Census(model) as census:
        torch.compile(model, backend="aot_eager")(**batch())
    assert census.eager == [] and sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks
    eager_model = _titan(DisabledNormTitan)
    with Census(eager_model) as census:
        eager_model(**batch())  # not compiled at all: every module forward runs eagerly
    # every module called once, eagerly; the ModuleList itself is never called
    assert sorted(n for n, _ in census.eager) == sorted(n for n, _ in eager_model.named_modules() if n != "layers")
    # eager submodules fold into an eager block, never into the root
    assert census.apply(fxfuse.Report()).outside == [
        "(root) (DisabledNormTitan) x1", "tok_embeddings (Embedding) x1", "layers.* (TitanBlock) x2",
        "norm (RMSNorm) x1", "output (Linear) x1"]
    assert sys.getprofile() is None


def test_census_changes_nothing_dynamo_compiles():
    """With a forward hook on it, Dynamo compiles a torch.nn module's forward called from a skipped
    frame (the final nn.RMSNorm here), which without one it runs eagerly: a census built on hooks
    reported that norm fused though a plain run never fuses it."""
    plain = fxfuse.Report.merge(_compiled_reports(lambda model, call: call(**batch())))
    censused = fxfuse.Report.merge(_compiled_reports(lambda model, call: Census(model).around(call)(**batch())))
    assert plain.counts() == censused.counts() == {"rms_norm": 2, "rope": 1, "swiglu": 1, "linear_cross_entropy": 0}
    assert plain.graphs == censused.graphs


def _compiled_reports(run) -> list:
    torch._dynamo.reset()
    n0 = len(fxfuse.compiled_reports())
    model = _titan(LoopBreakTitan)
    run(model, torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"}))
    return fxfuse.compiled_reports()[n0:]


def test_a_graph_reused_for_every_layer_counts_its_fused_calls_per_run():
    report = fxfuse.explain(_titan(LoopBreakTitan), **batch())
    # one block graph (2 norms, rope, swiglu): sites per graph miss the second block, which reuses it
    assert report.counts() == {"rms_norm": 2, "rope": 1, "swiglu": 1, "linear_cross_entropy": 0}
    # the final norm and the cross-entropy run in forward's skipped frame, eagerly: no fused call
    assert report.calls == FULL | {"rms_norm": 4, "linear_cross_entropy": 0}
    assert [(s.pattern, s.module) for s in report.unmatched if s.graph == -1] == [("rms_norm", "norm"),
                                                                                 ("linear_cross_entropy", "")]
    assert "fused calls at run time (a compiled graph ran more than once, or not at all): rms_norm 4" in str(report)
    result = check("loop-break", lambda: _titan(LoopBreakTitan), batch(), loss_of=lambda out: out, bf16_steps=0)
    assert result.matched == report.calls and result.gaps == ["rms_norm", "linear_cross_entropy"]
    assert OUTSIDE_REASON in result.reasons["rms_norm"] and result.parity_ok
    assert result.reasons["linear_cross_entropy"] == [OUTSIDE_LOSS_REASON]


def test_runs_are_counted_only_inside_a_census():
    model = _titan(LoopBreakTitan)
    compiled = torch.compile(model, backend="fxfuse", options={"inner": "aot_eager"})
    compiled(**batch())  # compiles and runs with no census: nothing counts
    with Census(model) as census:
        compiled(**batch())  # the graphs compiled above, reused
    assert census.apply(fxfuse.Report()).calls == FULL | {"rms_norm": 4, "linear_cross_entropy": 0}
    assert fxfuse.Report().calls is None and '"calls": null' in fxfuse.Report().to_json()


def test_backend_warns_once_when_dynamo_runs_a_frame_eagerly(monkeypatch):
    monkeypatch.setattr(outside, "_WARNED", set())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("fxfuse").addHandler(handler)
    try:
        for cls in (TitanLM, LoopBreakTitan, LoopBreakTitan):  # the second LoopBreakTitan: a new model, same break
            torch.compile(_titan(cls), backend="fxfuse", options={"inner": "aot_eager"})(**batch())
            if cls is TitanLM:
                assert not records
    finally:
        logging.getLogger("fxfuse").removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert len(messages) == 1 and "frame skipped: forward" in messages[0], messages
    assert "fxfuse.explain(model, *inputs) lists the sites that ran eagerly" in messages[0]


def test_harness_names_the_reason_of_a_gap_outside_any_graph():
    result = check("disabled-norm", lambda: _titan(DisabledNormTitan), batch(), loss_of=lambda out: out,
                   bf16_steps=0)
    assert result.gaps == ["rms_norm"]
    assert OUTSIDE_REASON in result.reasons["rms_norm"]
    assert any("disable" in b.lower() for b in result.reasons["graph_breaks"])


def test_break_line_keeps_headline_context_and_hint_only():
    key = ("HOP: Unsafe side effect\n  Explanation: Mutating a variable.\n  Hint: try X.\n\n"
           "  Developer debug context: Attempted to mutate Y\n\n For more details, please visit: https://x\n\n"
           "*** While handling this graph break, another graph break occurred: ***\n\ngraph break in loop\n")
    assert break_line(key) == ("HOP: Unsafe side effect [developer debug context: Attempted to mutate Y] [hint: try X.]"
                               "; then: graph break in loop")
    assert break_line("") == ""


def test_hf_checkpointed_llama_reports_no_outside_site_when_all_fused():
    model = hf_model("llama", num_hidden_layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    report = fxfuse.explain(copy.deepcopy(model), **batch())
    # transformers < 5.25: every layer traced into the graph; >= 5.25 needs Dynamo's hint (README Limits)
    with skip_checkpoint_side_effect_replay():
        hinted = fxfuse.explain(model, **batch())
    for r in (report, hinted) if _transformers_below("5.25") else (hinted,):
        assert r.counts() == FULL and not r.outside
    if not _transformers_below("5.25"):
        assert len([s for s in report.unmatched if s.graph == -1]) == 8  # 2 layers x (2 norms, rope, mlp)


def _transformers_below(version: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) < Version(version)


_LOSS_LOG = logging.getLogger("tests.loss_fn")


class LoggedLossTitan(TitanLM):
    """The loss comes through a property that logs, as transformers' ``loss_function`` does while
    ``loss_type`` is None: Dynamo cannot trace the logging call, a break between head and loss."""

    @property
    def loss_fn(self):
        _LOSS_LOG.debug("loss_fn looked up")
        return _flat_cross_entropy

    def forward(self, input_ids, labels=None):
        logits = super().forward(input_ids)
        return self.loss_fn(logits, labels)


def _flat_cross_entropy(logits, labels):
    """A Python function (as transformers' ForCausalLMLoss): Dynamo compiles it as a frame of its own
    after the break, so the cross-entropy is in a graph whose logits are an input."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def test_each_graph_report_names_the_break_that_ended_it():
    torch._dynamo.reset()
    n0 = len(fxfuse.compiled_reports())
    torch.compile(_titan(DisabledNormTitan), backend="fxfuse", options={"inner": "aot_eager"})(**batch())
    first, *rest = fxfuse.compiled_reports()[n0:]
    assert len(first.graph_breaks) == 1 and all(r.graph_breaks == [] for r in rest), fxfuse.compiled_reports()[n0:]
    line = first.graph_breaks[0]
    at = f"; at test_outside.py:{_line_of('_eager_norm(self.norm, x)')} in forward"
    assert "disable" in line.lower() and at in line
    assert line.endswith("`logits = self.output(_eager_norm(self.norm, x))`")
    # explain's census sees the same break in Dynamo's counters: one line, the graph's (with its place)
    report = fxfuse.explain(_titan(DisabledNormTitan), **batch())
    assert [b for b in report.graph_breaks if "disable" in b.lower()] == [line]


def test_a_break_between_head_and_loss_is_placed_and_the_head_says_so():
    report = fxfuse.explain(_titan(LoggedLossTitan), **batch())
    assert report.counts() == FULL | {"linear_cross_entropy": 0}
    [head] = [s for s in report.unmatched if s.pattern == "linear_cross_entropy"]
    assert "the report's graph breaks say where and why" in head.reason
    placed = [b for b in report.graph_breaks if f"; at test_outside.py:{_line_of('return self.loss_fn(')}" in b]
    assert len(placed) == 1, report.graph_breaks
    assert placed[0].endswith("`return self.loss_fn(logits, labels)`")
    assert not any("loss_type" in b for b in report.graph_breaks)  # not a transformers model: no such hint


def test_hf_gpt2_break_names_its_fix_and_the_fix_fuses_with_parity():
    model = hf_model("gpt2")
    assert model.loss_type is None  # GPT2LMHeadModel: a class name with no known loss
    report = fxfuse.explain(model, **batch())
    assert report.counts()["linear_cross_entropy"] == 0
    hinted = [b for b in report.graph_breaks if 'model.loss_type = "ForCausalLM"' in b]
    assert len(hinted) == 1, report.graph_breaks
    assert "; at modeling_gpt2.py:" in hinted[0] and "self.loss_function(" in hinted[0]

    def fixed():
        m = hf_model("gpt2")
        m.loss_type = "ForCausalLM"
        return m

    result = check("gpt2-loss-type", fixed, batch(), bf16_steps=0)
    assert result.matched["linear_cross_entropy"] == 1 and not result.gaps and result.parity_ok, result
    assert "graph_breaks" not in result.reasons


@torch.compiler.disable
def _eager_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


class EagerLossTitan(TitanLM):
    """The loss through a compiler-disabled function: it runs in Python, outside every graph."""

    def forward(self, input_ids, labels=None):
        return _eager_loss(super().forward(input_ids), labels)


def test_a_loss_run_eagerly_is_an_unmatched_head_placed_at_the_models_line():
    report = fxfuse.explain(_titan(EagerLossTitan), **batch())
    assert report.counts() == FULL | {"linear_cross_entropy": 0}
    heads = [(s.module, s.source, s.reason, s.graph) for s in report.unmatched if s.pattern == "linear_cross_entropy"]
    assert heads == [("", f"test_outside.py:{_line_of('return _eager_loss(super()')}", OUTSIDE_LOSS_REASON, -1)]
    result = check("eager-loss", lambda: _titan(EagerLossTitan), batch(), loss_of=lambda out: out, bf16_steps=0)
    assert result.gaps == ["linear_cross_entropy"] and result.reasons["linear_cross_entropy"] == [OUTSIDE_LOSS_REASON]


def test_a_loss_in_an_unfused_graph_run_by_the_eager_inner_compiler_is_not_outside():
    """inner "eager" runs a graph left unfused as Dynamo's own GraphModule, whose code calls
    F.cross_entropy in Python: inside a graph, not outside one."""
    model = _titan(TitanLM)
    with Census(model) as census:
        torch.compile(model, backend="fxfuse", options={"inner": "eager", "patterns": []})(**batch())
    assert census.losses == {}


def test_the_fused_heads_own_reduction_is_not_an_eager_loss():
    """The fast loss head (Inductor's default) reduces its rows with F.nll_loss in Python, inside its
    op, as eager sums them: called from fxfuse's kernels during a compiled graph's run, it is no loss
    outside the graphs. (The lean head's reduction is traced into the graph.)"""
    model = _titan(TitanLM)
    with Census(model) as census:
        torch.compile(model, backend="fxfuse", options={"inner": "aot_eager", "loss_head": "fast"})(**batch())
    assert census.losses == {}
    assert [s for s in census.apply(fxfuse.Report()).unmatched if s.pattern == "linear_cross_entropy"] == []


def _line_of(text: str) -> int:
    """Line number of the first line of this file holding text."""
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if text in line and "_line_of" not in line)
