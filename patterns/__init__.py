"""Pattern definitions, one module per fused op. ``all_patterns()`` lists them in rewrite order."""
from __future__ import annotations


def all_patterns():
    """Every pattern fxfuse knows, in the order they are rewritten."""
    from . import rms_norm, swiglu

    return (rms_norm.PATTERN, swiglu.PATTERN)
