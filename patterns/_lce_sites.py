"""The loss head's candidate sites beyond the pattern's own matches, and why each stays unfused: log-probs
of a linear's logits that no cross_entropy stands for, logits from another graph, a per-row loop."""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def _from_linear(n, hops: int = 6) -> bool:
    """n is computed from an aten.linear through a few ops on their first operand (casts, reshapes, a
    scale or softcap): the logits of a loss head."""
    for _ in range(hops):
        if not isinstance(n, fx.Node) or n.op != "call_function" or not n.args:
            return False
        if n.target == aten.linear.default:
            return True
        n = n.args[0]
    return False


def is_candidate(n: fx.Node) -> bool:
    """A cross_entropy, or a log_softmax of a linear's output (log-probs of a loss head read another way)."""
    return n.target == aten.cross_entropy_loss.default or (
        n.target == aten.log_softmax.int and _from_linear(n.args[0]))


_LOG_PROBS = ("a log_softmax of a linear layer's logits that no cross_entropy stands for (its log-probs read by "
              "an entropy or KL term, gathered at more than the one taken token per row, or taken over another "
              "dim than the classes): the [N, V] "
              "logits and log-probs are written; the fused head computes F.cross_entropy, or F.nll_loss of "
              "log_softmax over the classes, of the logits alone")


_PER_ROW = ("the logits are indexed one row at a time (a Python loop over the batch, as TRL's bf16 "
            "selective_log_softmax): each row's loss reads the whole lm_head output, so no row's head can be "
            "fused; compute the log-probs of the whole batch at once (log_softmax(z, -1).gather(-1, t[..., None]) "
            "or z.gather(...) - z.logsumexp(-1))")


def miss_reason(ce: fx.Node) -> str | None:
    """Log-probs of a head read another way; logits that arrive as a graph input (the lm_head ran in
    another graph)."""
    if ce.target == aten.log_softmax.int:
        return _LOG_PROBS
    n = ce.args[0]
    while isinstance(n, fx.Node) and n.op == "call_function" and len(n.all_input_nodes) == 1:
        if n.target == aten.select.int and _from_linear(n.args[0]):
            return _PER_ROW
        n = n.all_input_nodes[0]
    if isinstance(n, fx.Node) and n.op == "placeholder":
        return ("the logits are an input of this graph: the lm_head ran in another graph (a graph break "
                "between them: the report's graph breaks say where and why), so the head cannot be fused")
    return None
