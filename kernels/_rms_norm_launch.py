"""Launch choices of the RMSNorm kernels (kernels/rms_norm.py): tile sizes, warps, stages, grids.

Each choice is a named function with the measurement behind it (H200, bf16, CUDA-graph replay:
bench/tune_rms_norm.py sweeps launch parameters, bench/probe_rms_norm.py kernel structures;
numbers in bench/RESULTS.md). The *_launch functions are cached: they run on every call's host path.
"""
from __future__ import annotations

import functools

import torch
import triton

from ._dispatch import num_sms


def block_n(d: int) -> int:
    """Whole row in one register tile: a power of two >= D, at least one 16-byte vector."""
    return max(triton.next_power_of_2(d), 16)


def block_m(bn: int, m: int) -> int:
    """Several rows per tile for narrow rows (per-head q/k norms), so a tile is ~4K elements."""
    return max(1, min(4096 // bn, triton.next_power_of_2(m)))


def fwd_num_warps(tile_elems: int) -> int:
    """Forward: ~64 elements per thread (H200 sweep: 4 warps best up to 8K elements, 8 at 16K)."""
    return max(4, min(16, tile_elems // (32 * 64)))


def fwd_persistent(bn: int) -> bool:
    """Rows of 8K+ elements run the persistent row forward, which loads the next rows while one is
    reduced (H200, 4096x8192: 40.0 us vs 48.1 one row per program); narrower rows one tile per
    program (16384x4096: 73.9 us vs 74.8 persistent, same run)."""
    return bn >= 8192


def fwd_row_num_warps(bn: int) -> int:
    """Persistent row forward: 4 warps at 8K-element rows, 8 wider (H200, interleaved A/B of CUDA-graph
    replays, 3 programs per SM, 4 stages: 4096x8192 39.1 us vs 40.2 at 8 warps; 2048x16384 at 8
    warps 41.3 us, 16 warps 41.2)."""
    return 4 if bn <= 8192 else 8


def fwd_row_stages(row_bytes: int) -> int:
    """Persistent row forward: 4 rows in flight for rows up to 16 KiB (H200, 4096x8192 bf16, 4 warps,
    3 per SM: 39.1 us vs 39.8 at 3 stages), else as the backward (row_stages)."""
    return 4 if row_bytes <= 16 << 10 else row_stages(row_bytes)


def fwd_programs_per_sm(staged_bytes: int) -> int:
    """Persistent row forward: at most 3 programs per SM, fewer when their staged rows would not fit
    one SM's shared memory together. The grid must be one wave of resident programs: at 4096x8192
    Nsight Compute showed the former 4 per SM (8 warps, 80 registers per thread) fitting only 3,
    and a persistent grid with a partial second wave runs its last rows one program per SM
    (4 warps, 4 stages: 3 per SM 39.1 us, 4 per SM 42.4, 6 per SM = two full waves 39.6); wider
    rows stage more (2048x16384, 96 KiB each: 2 per SM)."""
    return max(1, min(3, (224 << 10) // staged_bytes))


def fwd_chunked(d: int) -> bool:
    """Rows wider than 16K elements run the chunked forward (kernels/_rms_norm_chunked.py) where the
    row forward's power-of-two tile would be under 7/8 full or 64K lanes (H200 bf16, CUDA-graph A/B,
    bench/probe_rms_wide.py --pass fwd: 2048x18432 50.5 us vs 60.7, 2048x24576 67.3 vs 70.1,
    512x65536 53.3 vs 119.3; full 32K tiles keep the row forward, 1024x32768 46.7 vs 48.5)."""
    bn = block_n(d)
    return bn > 16384 and (bn > 32768 or 8 * d <= 7 * bn)


def fwd_chunked_config(d: int, elem: int) -> tuple[int, int, int]:
    """(BLOCK, num_warps, num_stages) of the chunked forward: 4K-column chunks (8K past 32K columns),
    32 bytes per thread per chunk, 4 chunks in flight (same probe: bf16 2048x18432 4K / 8 warps 50.5 us,
    8K / 8 warps 54.8; 512x65536 8K / 16 warps 53.3, 2K / 4 warps 56.8; fp32 2048x18432 4K / 16 warps
    91.7, 4K / 8 warps 95.0)."""
    block = 8192 if d > 32768 else 4096
    return block, max(4, min(16, block * elem // 1024)), 4


def row_stages(row_bytes: int, per_row: int = 1) -> int:
    """Rows in flight per persistent program: 3 (H200: 3 beat 2, 4 within 1%) while their loads fit
    in 192 KiB (the pipeliner stages them in shared memory; an H200 block has 227 KiB), fewer for
    wider rows."""
    return max(1, min(3, (192 << 10) // (row_bytes * per_row)))


def bwd_num_warps(tile_elems: int) -> int:
    """Backward holds x, dy, w and the dw sum per element: ~32 elements per thread (H200 sweep)."""
    return max(4, min(16, tile_elems // (32 * 32)))


def bwd_programs_per_sm(tile_elems: int) -> int:
    """Persistent backward: about as many programs as fit resident (H200: 2 at 4K-element tiles, 1 above)."""
    return max(1, min(8, 8192 // tile_elems))


def bwd_independent_sums(bn: int) -> bool:
    """Row backward on 8K-lane rows: both row sums straight from the loaded row (sum(g * xhat) as
    rstd * sum(g * xf)), so the second block-wide reduction does not wait on the first (H200 bf16,
    interleaved A/B of CUDA-graph replays, bench/probe_rms_onesum.py: 4096x8192 60.1 us vs 60.9 in
    two calls, 2048x8192 36.5 vs 37.2); 4K-lane rows, two programs per SM, keep the dependent sums
    (16384x4096 107.4 vs 107.3 and 108.1 vs 107.6)."""
    return bn >= 8192


def bwd_split_parts(d: int) -> int:
    """Backward programs per row once a row's tile reaches 16K lanes (rows wider than 8K elements),
    where a whole row and its dw sum outgrow one program's registers: parts of 8K lanes (H200, bf16,
    backward pair with the dw kernel, interleaved A/B, bench/probe_rms_wide.py: 2048x16384 2 parts
    70.9 us, whole rows 82.9-98.4; 2048x12288 65.5 vs 70.1; wider rows: bwd_two_pass)."""
    return 1 if block_n(d) < 16384 else triton.cdiv(d, 8192)


def bwd_two_pass(parts: int) -> bool:
    """Past 2 parts the row sums come from a first kernel instead of each program re-reading the
    other parts (H200 bf16, same probe: 2048x18432 two passes 109.9 us, one pass 178.2; 1024x32768
    103.6 vs 158.8 at 16K-lane parts; 512x65536 95.0 vs 327.1; at 2048x16384 two passes lose, 97.0
    vs 70.7)."""
    return parts > 2


def row_sums_config() -> tuple[int, int, int]:
    """(BLOCK, num_warps, num_stages) of the two-pass path's row sums: one program per row looping
    over 1K-element column blocks, 4 in flight (H200 bf16, same probe, whole backward: 2048x18432
    108.3 us vs 109.8 at 2K blocks / 3 stages and 113.2 at 4K / 8 warps / 2; 1024x32768 96.4 vs 103.6
    and 99.3; 512x65536 95.5 vs 95.2 and 104.7)."""
    return 1024, 4, 4


def bwd_split_num_warps(part: int) -> int:
    """Split backward: 8 warps for parts of 8K lanes (H200, same probe: 2048x16384 70.8 us vs 82.5
    at 16 warps; 2048x18432 one pass 178.2 vs 191.0)."""
    return 8


def dw_block_d(d: int, programs: int) -> int:
    """dw reduction: columns per program, so the grid covers ~2 programs per SM. The reduction of
    the [P, D] partials is latency-bound (H200, 4096x8192: 64 programs of 128 columns, each looping
    over P in steps of 32, took 12.1 us for 4.3 MB)."""
    target = max(1, 2 * programs)
    bd = 128
    while bd > 16 and triton.cdiv(d, bd) < target:
        bd //= 2
    return bd


def dw_block_p(p: int, bd: int) -> int:
    """dw reduction: all P partials of a column block in one [BLOCK_P, BLOCK_D] load while that tile
    stays within 8K fp32 elements (64 per thread at 4 warps); larger P loops."""
    return max(1, min(triton.next_power_of_2(p), 8192 // bd))


@functools.lru_cache(maxsize=1024)
def fwd_launch(m: int, d: int, elem: int, device: torch.device) -> tuple[bool, int, int, int, int, int]:
    """(persistent, programs, BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward on [m, d]
    rows of elem-byte elements."""
    bn = block_n(d)
    if fwd_persistent(bn):
        stages = fwd_row_stages(bn * elem)
        programs = min(m, num_sms(device) * fwd_programs_per_sm(stages * bn * elem))
        return True, programs, 1, bn, fwd_row_num_warps(bn), stages
    bm = block_m(bn, m)
    return False, triton.cdiv(m, bm), bm, bn, fwd_num_warps(bm * bn), 1


@functools.lru_cache(maxsize=1024)
def fwd_chunked_launch(d: int, elem: int) -> tuple[int, int, int] | None:
    """fwd_chunked_config where the forward walks each row in chunks (fwd_chunked), else None."""
    return fwd_chunked_config(d, elem) if fwd_chunked(d) else None


@functools.lru_cache(maxsize=1024)
def bwd_launch(m: int, d: int, elem: int, device: torch.device, loads: int = 2) -> tuple[int, int, int, int, int]:
    """(persistent programs, BLOCK_M, BLOCK_N, num_warps, num_stages) of the row backward (rows up to
    8K elements; wider: bwd_split_launch); its pipelined loads are x and dy, and in
    rms_norm_backward_add the residual gradient and dy's other addends (loads rows per row of the tile)."""
    bn = block_n(d)
    bm = block_m(bn, m)
    tile = bm * bn
    grid = max(1, min(triton.cdiv(m, bm), num_sms(device) * bwd_programs_per_sm(tile)))
    return grid, bm, bn, bwd_num_warps(tile), row_stages(tile * elem, per_row=loads)


@functools.lru_cache(maxsize=1024)
def bwd_split_launch(m: int, d: int, elem: int, device: torch.device) -> tuple | None:
    """(row groups, S, PART, num_warps, num_stages, row_sums) of the split backward
    (kernels/_rms_norm_split.py; row_sums: row_sums_config() on the two-pass path, else None), or
    None where one program takes whole rows (bwd_launch). One program per SM; each row's stage
    holds x and dy of the program's part, and in one pass also of the other parts."""
    s = bwd_split_parts(d)
    if s == 1:
        return None
    part = block_n(triton.cdiv(d, s))
    groups = max(1, min(m, num_sms(device) // s))
    two_pass = bwd_two_pass(s)
    stages = row_stages(part * elem, per_row=2 if two_pass else 2 * s)
    return groups, s, part, bwd_split_num_warps(part), stages, row_sums_config() if two_pass else None


@functools.lru_cache(maxsize=None)
def dw_pdl(device: torch.device) -> bool:
    """The dw reduction as a programmatic dependent launch (sm_90+): the row backward lets its blocks
    launch at its start and they wait in griddepcontrol.wait for the partials, hiding the launch gap
    (H100, bf16, interleaved CUDA-graph A/B, bench_rms_norm.py --pdl off: 16384x4096 fwd+bwd 93.7% of
    the copy ceiling vs 93.4-93.5 in every round; 4096x8192 87.4-87.8 vs 87.6-88.0, within noise; over
    three sessions' calls +0.3-0.4 points at 16384x4096, 0 to -0.4 at 4096x8192)."""
    # ROCm reports its own capabilities as "cuda" ones (MI300: 9.4) and has no griddepcontrol.
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=1024)
def dw_launch(p: int, d: int) -> tuple[int, int, int]:
    """(programs, BLOCK_P, BLOCK_D) of the dw reduction over P partials of D columns."""
    bd = dw_block_d(d, p)
    return triton.cdiv(d, bd), dw_block_p(p, bd), bd
