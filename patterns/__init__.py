"""Pattern definitions, one module per fused op. ``all_patterns()`` lists them in rewrite order."""
from __future__ import annotations


def all_patterns():
    """Every pattern fxfuse knows, in the order they are rewritten."""
    from . import linear_cross_entropy, rms_norm, rope, swiglu

    return (rms_norm.PATTERN, swiglu.PATTERN, rope.PATTERN, linear_cross_entropy.PATTERN)
