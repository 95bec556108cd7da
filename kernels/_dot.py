"""The one place the kernels choose a dot's operand precision.

Two forms, picked per launch by a `MMA` constexpr the launcher sets:
  MMA = True   both operands rounded to bf16 (round to nearest even), products accumulated in
               fp32: tensor cores on a GPU (wgmma / mma.sync). The launchers choose it only where
               the operands already hold bf16 values (a bf16 model's queries; bf16 pools and FP8
               records, whose e4m3 code x power-of-two scale is exact in bf16) or where rounding
               to bf16 is the model's own precision (sparse decode's softmax weights P, as a bf16
               model's attention rounds them). A product of two bf16 values is exact in fp32, so
               the dot equals the fp32 dot of the same values up to the order of the fp32 sums.
  MMA = False  fp32 operands, `input_precision="ieee"`: FFMA on a GPU, never TF32 (Triton's
               default, ~1e-3 relative). fp32 models and fp32 pools.

Triton 3.9's interpreter computes a bf16 `tl.dot` wrongly (garbage), so under TRITON_INTERPRET=1
`mma` takes the operands as fp32 tensors holding the bf16-rounded values (`to_mma` rounds with
`_rounding.round_to`, bit arithmetic that rounds to nearest even, as the GPU's conversion does)
and runs the ieee fp32 dot: exact products, fp32 sums, which is what the tensor core computes up
to summation order. Tests of the MMA form therefore check, on a CPU, the values the GPU form
computes, within the summation-order bound; the compiled form itself is checked by the
ahead-of-time gate (dsv4_tree/aot: it must contain MMA instructions) and on a GPU."""
import triton
import triton.language as tl
from triton import knobs

from ._rounding import round_to

INTERPRETED = tl.constexpr(knobs.runtime.interpret)  # what triton.jit itself decided at import


@triton.jit
def to_mma(x):
    """x as a tensor-core operand: bf16 on a GPU; fp32 holding the bf16-rounded values in the
    interpreter."""
    if INTERPRETED:
        return round_to(x.to(tl.float32), tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def mma(a, b):
    """a @ b of two `to_mma` operands, fp32 accumulation."""
    if INTERPRETED:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def dot_fp32(a, b):
    """a @ b in fp32 (ieee: never TF32)."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def operand(x, MMA: tl.constexpr):
    """x in the form `dot` takes: to_mma(x) for MMA, fp32 otherwise."""
    if MMA:
        return to_mma(x)
    else:
        return x.to(tl.float32)


@triton.jit
def dot(a, b, MMA: tl.constexpr):
    """a @ b of two `operand(., MMA)` tiles, fp32 result."""
    if MMA:
        return mma(a, b)
    else:
        return dot_fp32(a, b)
