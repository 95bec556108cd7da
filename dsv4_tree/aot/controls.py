"""Negative controls: specs the gate must flag, or its checks prove nothing.

    CONTROLS = [(KernelSpec, expected flag), ...]

* spill_control at BLOCK = 65536 (control_kernels.py): must be flagged SPILL.
* smem_control, a bf16 256 x 256 x 128 GEMM tile with 4 stages and 8 warps: SMEM>227K (the
  compile stops at shared-memory allocation, before ptxas).
"""
from __future__ import annotations

from .spec import KernelSpec

_MOD = "dsv4_tree.aot.control_kernels"
_BASE = (("debug", False), ("fpsan_homomorphic_casts", False), ("instrumentation_mode", ""))
_DIV = [["tt.divisibility", 16]]

CONTROLS = [
    (KernelSpec(f"{_MOD}:spill_control", (("x_ptr", "*fp32"), ("y_ptr", "*fp32"), ("BLOCK", "constexpr")),
                (((2,), 65536),), (((0,), _DIV), ((1,), _DIV)), _BASE + (("num_warps", 4),)), "SPILL"),
    (KernelSpec(f"{_MOD}:smem_control", (("a_ptr", "*bf16"), ("b_ptr", "*bf16"), ("c_ptr", "*fp32"), ("K", "i32"),
                                         ("BM", "constexpr"), ("BN", "constexpr"), ("BK", "constexpr")),
                (((4,), 256), ((5,), 256), ((6,), 128)), (((0,), _DIV), ((1,), _DIV), ((2,), _DIV), ((3,), _DIV)),
                _BASE + (("num_stages", 4), ("num_warps", 8))), "SMEM>227K"),
]
