"""Kernels built to break the gate's limits: its negative controls (controls.py)."""
import triton
import triton.language as tl


@triton.jit
def spill_control(x_ptr, y_ptr, BLOCK: tl.constexpr):
    """A BLOCK-long fp32 row live across its own sum: at BLOCK = 65536 and 4 warps, 512 values
    per thread, more than 255 registers hold: ptxas must spill."""
    r = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r)
    s = tl.sum(x, axis=0)
    tl.store(y_ptr + r, x * s)


@triton.jit
def smem_control(a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A bf16 GEMM tile BM x BN x BK, software-pipelined: at 256 x 256 x 128 with 4 stages its
    operand buffers need about 513 KB of shared memory, over the H200's 227 KB."""
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * BN + rn[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], acc)
