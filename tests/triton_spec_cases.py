"""Two small kernels for tests/test_triton_specs.py: one the GPU compiler accepts, one it rejects
although Triton's interpreter runs it (a loop-carried variable that changes shape, as the fast
loss head's frozen-scale sweep did before 9447c09)."""
import triton
import triton.language as tl


@triton.jit
def scale_rows_kernel(
    x_ptr,  # [M, N] contiguous, in / out
    factor,  # fp32 scalar
    N,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * N + cols, mask=cols < N)
        tl.store(x_ptr + row * N + cols, x * factor, mask=cols < N)


@triton.jit
def loop_carried_shape_kernel(
    x_ptr,  # [M, N] contiguous, in / out
    factor,  # fp32 scalar
    N,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    _ = tl.zeros([1], tl.float32)
    for n0 in range(0, N, BLOCK):
        cols = n0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * N + cols, mask=cols < N)
        _ = x * factor  # [BLOCK] where it was [1]: the compiler refuses, the interpreter does not
        tl.store(x_ptr + row * N + cols, _, mask=cols < N)
