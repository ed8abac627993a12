"""The RMSNorm backward's dw reduction (kernels/rms_norm.py): the row backward's programs each leave
an fp32 [D] partial sum of dy * xhat over their rows in partial[pid, :]; this kernel sums the [P, D]
partials over P (a fixed tree per column: deterministic, no atomics) and rounds to weight.dtype.
On sm_90+ it is a programmatic dependent launch (launch.dw_pdl) that waits for the partials on the GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _rms_norm_launch as launch
from ._round import rne_by_bits, round_dtype


@triton.jit
def _dw_reduce_kernel(
    partial_ptr,  # [P, D] fp32, contiguous
    dw_ptr,  # [D] weight.dtype, contiguous
    P,
    D,
    RNE_BY_BITS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,  # launched dependent on the backward: wait until its partials are written
):
    if PDL:
        tl.extra.cuda.gdc_wait()
    # BLOCK_D columns per program; the [BLOCK_P, BLOCK_D] tiles are summed elementwise and reduced
    # once at the end, so the loads of a column block do not wait on each other (latency-bound).
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < D
    acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        mask = (ps < P)[:, None] & col_mask[None, :]
        acc += tl.load(partial_ptr + ps.to(tl.int64)[:, None] * D + cols[None, :], mask=mask, other=0.0)
    dw = round_dtype(tl.sum(acc, axis=0), dw_ptr.dtype.element_ty, RNE_BY_BITS).to(dw_ptr.dtype.element_ty)
    tl.store(dw_ptr + cols, dw, mask=col_mask)


def reduce_dw(partial: torch.Tensor, dtype: torch.dtype, pdl: bool) -> torch.Tensor:
    """dw [D] dtype: the sum over P of partial [P, D] fp32; pdl: launched as a dependent launch."""
    p, d = partial.shape
    dw = torch.empty((d,), dtype=dtype, device=partial.device)
    programs, block_p, block_d = launch.dw_launch(p, d)
    _dw_reduce_kernel[(programs,)](partial, dw, p, d, RNE_BY_BITS=rne_by_bits(partial.device), BLOCK_P=block_p,
                                   BLOCK_D=block_d, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    return dw
