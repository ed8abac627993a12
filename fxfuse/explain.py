"""``fxfuse.explain``: trace exactly as the backend would, run the matcher, return the report."""
from __future__ import annotations

import torch

from .options import Options
from .report import Report


def explain(model_or_fn, *args, fxfuse_options: dict | None = None, **kwargs) -> Report:
    """Report what fxfuse would fuse in model_or_fn(*args, **kwargs). Runs the call once (eagerly,
    after Dynamo traced it); no GPU needed for a CPU model. ``fxfuse_options`` takes the backend's
    options (``patterns``, ``debug_dir``); the rewritten graph is checked but not used.

    Also reports what ran outside every compiled graph (fxfuse/outside.py): ``graph_breaks``, the
    eager module calls in ``outside``, and each site module among them in ``unmatched``."""
    from .backend import transform
    from .outside import Census, counted

    opts = Options.parse(fxfuse_options)
    report = Report()

    def capture(gm, example_inputs):
        _, r = transform(gm, example_inputs, opts)
        report.extend(r)
        return counted(gm.forward, r)

    with Census(model_or_fn) as census:
        torch.compile(model_or_fn, backend=capture)(*args, **kwargs)
    return census.apply(report)
