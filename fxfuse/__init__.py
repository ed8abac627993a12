"""fxfuse: a torch.compile backend that fuses RMSNorm, RoPE, SwiGLU and lm_head + cross-entropy in any
traced model. ``torch.compile(model, backend="fxfuse")``; ``fxfuse.explain(model, *args)`` for a report.
"""
from __future__ import annotations

from .checkpoint import skip_checkpoint_side_effect_replay
from .explain import explain
from .patch import patch, patch_report
from .report import PATTERN_NAMES, Report, Site

__all__ = ["explain", "Report", "Site", "PATTERN_NAMES", "last_report", "compiled_reports", "patch", "patch_report",
           "skip_checkpoint_side_effect_replay"]


def last_report() -> Report:
    """Report of the graph the fxfuse backend compiled last (``compiled_reports()`` has them all)."""
    from .backend import last_report as _last

    return _last()


def compiled_reports() -> list[Report]:
    from .backend import compiled_reports as _all

    return _all()
