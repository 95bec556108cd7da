"""Rounding fp32 to a storage dtype inside a kernel, the same on a GPU and in the interpreter.

triton 3.9's interpreter converts fp32 to bf16 by truncation (a GPU rounds to nearest even), so
a kernel that must round as torch does rounds in fp32 first: `round_to(x, tl.bfloat16)` is the
fp32 value of x rounded to nearest even at bf16's 8 significant bits, computed on the bits
(NaN is not produced by the kernels that use it); the later `.to(tl.bfloat16)` of that value
is then exact under either conversion. fp16 conversion rounds to nearest in both; fp32 is as is."""
import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to DTYPE's precision, returned as fp32."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x
