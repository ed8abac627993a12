"""Chunk sizes and fp32-output matmuls of the chunked lm_head + cross-entropy
(kernels/linear_cross_entropy.py, its module doc gives the design; the fast algorithm in
kernels/linear_cross_entropy_fast.py reads ``_CHUNK_OVERRIDE`` too).

Each size is chosen so that the one scratch buffer it governs stays within a fixed budget above
the dW + dx floor: the fp32 dx accumulator of a pass (64 MiB), one fp32 logits chunk (16 MiB), one
logits-gradient group (24 MiB).
"""
import functools

import torch
import triton

from ._dispatch import INTERPRETER_TILE

_DX_ACC_BYTES = 64 << 20
_LOGITS_BYTES = 16 << 20
_GRAD_BYTES = 24 << 20
_CHUNK_OVERRIDE = None  # (rows, cols, group cols): tests force small chunks (fast: rows/pass, cols/tile)
_ROWS_PER_PROGRAM_OVERRIDE = None  # tests run the interpreter with the GPU's 1 row per program too


@functools.lru_cache(maxsize=256)  # called per chunk: hundreds of times per op call
def _block(cols: int) -> int:
    # One tile covers a 1024-wide chunk row; wider chunks loop (4 warps x 8 fp32 per thread).
    return min(triton.next_power_of_2(cols), 1024)


def _num_warps(block: int) -> int:
    # >= 8 elements per thread keeps loads vectorised; small tiles need few warps.
    return max(1, min(8, block // 256))


def _rows_per_program(rows: int, block: int, device: torch.device) -> int:
    # Rows per program of the row kernels. GPU: 1 (a row's sweep over V streams whole tiles; rows
    # spread over the SMs). Triton's interpreter: as many as fit an INTERPRETER_TILE [rows, block] tile.
    if _ROWS_PER_PROGRAM_OVERRIDE is not None:
        return _ROWS_PER_PROGRAM_OVERRIDE
    if device.type != "cpu":
        return 1
    return min(triton.next_power_of_2(max(rows, 1)), max(1, INTERPRETER_TILE // block))


def _rows_per_pass(n: int, h: int) -> int:
    # Tokens whose fp32 dx accumulator [R, H] fits in 64 MiB: the one buffer above the dx+dW floor.
    if _CHUNK_OVERRIDE is not None:
        return _CHUNK_OVERRIDE[0]
    return max(1, min(n, _DX_ACC_BYTES // (4 * h)))


def _cols_per_chunk(rows: int, v: int) -> int:
    # Vocab columns whose fp32 logits chunk [R, C] fits in 16 MiB; a multiple of 128 (GEMM tile).
    if _CHUNK_OVERRIDE is not None:
        return _CHUNK_OVERRIDE[1]
    return min(v, max(128, (_LOGITS_BYTES // (4 * rows)) // 128 * 128))


def _cols_per_group(rows: int, cols: int, v: int, element_size: int) -> int:
    # Vocab columns whose [R, G] logits-gradient buffer fits in 24 MiB, a multiple of cols: the
    # dx matmul reduces over G, so a wide G means few read-modify-writes of the fp32 dx accumulator.
    if _CHUNK_OVERRIDE is not None:
        return _CHUNK_OVERRIDE[2]
    return min(triton.cdiv(v, cols), max(1, _GRAD_BYTES // (element_size * rows * cols))) * cols


def _view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Contiguous [rows, cols] view of the start of a flat scratch buffer (reused across chunks)."""
    return buf[: rows * cols].view(rows, cols)


# torch >= 2.8: CUDA mm/addmm with an fp32 out_dtype (looked up once: a failed lookup is slow).
_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype_out")
_HAS_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, P] fp32 = a [M, K] @ b [K, P], accumulated in fp32 with no rounding to a's dtype."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif a.is_cuda and _HAS_MM_OUT_DTYPE:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif a.is_cuda:
        out.copy_(a @ b)  # torch < 2.8: cuBLAS rounds to a's dtype, as eager does
    else:
        torch.mm(a.float(), b.float(), out=out)


def _raw_logits(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, v0: int, buf: torch.Tensor,
                low: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([R, C] raw logits x [R, H] @ w [C, H].T in the fp32 scratch buffer buf, the [V] bias still to
    add to them). fp32 sums, or, where eager's roundings are reproduced (low: x's bf16 / fp16), eager's
    own low-precision F.linear (bias included) into the front of buf's bytes, so each logit rounds as
    eager's does (an fp32 matmul rounded afterwards sums in another order: near a softcap's saturation
    one unit of difference shows in dx)."""
    if low in (torch.bfloat16, torch.float16):
        z = _view(buf.view(low), x.shape[0], w.shape[0])
        if bias is None:
            torch.mm(x, w.T, out=z)
        else:
            torch.addmm(bias[v0:v0 + w.shape[0]].to(low), x, w.T, out=z)
        return z, None
    z = _view(buf, x.shape[0], w.shape[0])
    _mm_f32(x, w.T, z)
    return z, bias


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc [M, P] fp32 += a [M, K] @ b [K, P]."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda and _HAS_ADDMM_OUT_DTYPE:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    elif a.is_cuda:
        acc.add_(a @ b)
    else:
        acc.addmm_(a.float(), b.float())


def _dense(x, weight, target, bias):
    """The inputs the kernels index with unit strides (rows of x and weight, target, bias[v0:]) made
    contiguous; a strided bias (bias[::2], a view of a wider buffer) was read as its first V elements."""
    return x.contiguous(), weight.contiguous(), target.contiguous(), None if bias is None else bias.contiguous()
