"""Eager's roundings inside a kernel: an fp32 value stored in a low-precision dtype and read back.

An eager bf16 op computes in fp32 and stores bf16, so a chain of eager ops rounds after every op;
a fused kernel that keeps fp32 in registers rounds once. Where fxfuse reproduces eager's numerics
(option ``numerics="eager"``) a kernel calls ``round_to`` at each point where the graph it replaces
stores a low-precision tensor. ROUND codes: 0 keep fp32, 1 bfloat16, 2 float16.
"""
import torch
import triton
import triton.language as tl

_CODE = {torch.bfloat16: 1, torch.float16: 2}


def round_code(dtype: torch.dtype, enabled: bool = True) -> int:
    """The ROUND constexpr for results stored in dtype (0 when off or dtype is fp32 / fp64)."""
    return _CODE.get(dtype, 0) if enabled else 0


def rne_by_bits(device: torch.device) -> bool:
    """Triton's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: under it
    (CPU tensors) bf16 is rounded by hand on the bits, so CPU tests see the GPU's numerics."""
    return device.type == "cpu"


@triton.jit
def round_to(x, ROUND: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """fp32 x rounded to nearest even in the ROUND dtype, returned as fp32 (NaN stays NaN)."""
    if ROUND == 1:
        if RNE_BY_BITS:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x != x, x, b.to(tl.float32, bitcast=True))
        else:
            x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def round_dtype(v, DTYPE: tl.constexpr, RNE_BY_BITS: tl.constexpr):
    """fp32 v rounded (to nearest, ties to even) to DTYPE's precision, returned as fp32; the final
    .to(DTYPE) of the result is then exact. RNE_BY_BITS (CPU: Triton's interpreter truncates on
    fp32 -> bf16 casts) rounds bf16 with integer ops, the GPU's cvt.rn rounding, so tests on CPU
    see the GPU's numerics; on the GPU the cast itself (fewer instructions per element)."""
    if DTYPE == tl.bfloat16 and RNE_BY_BITS:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(DTYPE).to(tl.float32)


def round_ref(x: torch.Tensor, dtype: torch.dtype, enabled: bool) -> torch.Tensor:
    """PyTorch twin of round_to for the reference paths (x fp32 or wider)."""
    return x.to(dtype).to(x.dtype) if enabled and dtype in _CODE else x


@triton.jit
def add_rounded(a, b, DTYPE: tl.constexpr, RNE_BY_BITS: tl.constexpr, ADD_RN: tl.constexpr):
    """a + b as eager's add of two DTYPE tensors: an fp32 sum rounded once to DTYPE, returned as
    DTYPE. ADD_RN (CUDA): an inline add.rn.f32, which ptxas never contracts with a product that
    feeds it into one fma (1 ulp off eager's two operations); libdevice's add_rn is add.rn.ftz,
    which flushes denormals. The interpreter runs no PTX and its numpy add is not contracted."""
    if ADD_RN:
        s = tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a.to(tl.float32), b.to(tl.float32)],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = a.to(tl.float32) + b.to(tl.float32)
    return round_dtype(s, DTYPE, RNE_BY_BITS).to(DTYPE)
