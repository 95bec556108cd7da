"""A kernel launch as the specialisation `JITFunction.run` would compile on an sm_90 GPU.

`specialise(fn, args, kwargs)` applies Triton's own binder to the launch arguments: the same
`create_function_from_signature` JITFunction.run builds (with the CUDA backend of an sm_90
target, no GPU needed) and the same `_pack_args`, so the signature (pointer dtypes, i32 / i64),
the constexprs (ints equal to 1 included), the 16-divisibility of pointers and ints and the
launch options (num_warps, num_stages, enable_fp_fusion, ...) are exactly what a GPU would
compile. `_pack_args` is a private API; its form is the same in Triton 3.6 to 3.9 (the versions the
gate runs under, design_notes/triton-versions.md).
A KernelSpec is plain data (JSON), so the compile worker can rebuild the ASTSource in a process
without TRITON_INTERPRET."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

TARGET = ("cuda", 90, 32)  # H100 / H200: sm_90a, warp size 32
# Knobs JITFunction.run adds to a launch's keywords before binding: 3.6-3.8 pass
# instrumentation_mode; 3.9 added fpsan_homomorphic_casts (knob and option together)
RUN_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")


@dataclass(frozen=True)
class KernelSpec:
    """One compile: the jit function `kernel` ("module:name") and what specialises it."""

    kernel: str
    signature: tuple  # ((param name, "*bf16" | "i32" | "fp32" | "constexpr" ...), ...)
    constexprs: tuple  # ((path, JSON value), ...): {"dtype": "bf16"} for a tl.dtype
    attrs: tuple  # ((path, [["tt.divisibility", 16]] or []), ...)
    options: tuple  # ((name, value), ...): launch keywords that are not parameters
    grid: tuple = field(default=(1, 1, 1), compare=False)  # one launch's grid (not part of the compile)

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[1]

    def constexpr(self, param: str):
        """The value of a constexpr parameter by name (None when absent)."""
        names = [p for p, _ in self.signature]
        if param not in names:
            return None
        index = names.index(param)
        return dict((tuple(p), v) for p, v in self.constexprs).get((index,))

    def short(self) -> str:
        """The constexprs and option values that tell this kernel's specs apart."""
        names = [p for p, _ in self.signature]
        parts = []
        for path, v in self.constexprs:
            v = v["dtype"] if isinstance(v, dict) else v
            parts.append(f"{names[path[0]]}={v}")
        parts += [f"{k}={v}" for k, v in self.options if k in ("num_warps", "num_stages", "enable_fp_fusion")]
        return " ".join(parts)

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "signature": [list(x) for x in self.signature],
                "constexprs": [[list(p), v] for p, v in self.constexprs],
                "attrs": [[list(p), a] for p, a in self.attrs], "options": [list(x) for x in self.options],
                "grid": list(self.grid)}

    @staticmethod
    def from_json(d: dict) -> "KernelSpec":
        return KernelSpec(d["kernel"], tuple(tuple(x) for x in d["signature"]),
                          tuple((tuple(p), v) for p, v in d["constexprs"]),
                          tuple((tuple(p), a) for p, a in d["attrs"]), tuple(tuple(x) for x in d["options"]),
                          tuple(d.get("grid", (1, 1, 1))))

    def key(self) -> str:
        """Identity of the compile (the grid left out)."""
        d = self.to_json()
        d.pop("grid")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:20]


def _plain(value):
    """A constexpr value as JSON: ints, floats, bools, None as they are; a tl.dtype by name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if type(value).__name__ == "dtype":
        return {"dtype": str(value)}
    if hasattr(value, "value"):  # tl.constexpr
        return _plain(value.value)
    raise TypeError(f"constexpr value {value!r} of type {type(value).__name__} has no JSON form")


def constexpr_value(v):
    """The inverse of _plain, in the compiling process."""
    if isinstance(v, dict):
        import triton.language as tl

        return tl.dtype(v["dtype"])
    return v


class Specialiser:
    """Triton's binder for an sm_90 target, per jit function (built once per function)."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.backend = make_backend(GPUTarget(*TARGET))
        self._jit = {}  # python function -> (JITFunction, binder)

    def _binder(self, fn, jit_options):
        if fn not in self._jit:
            from triton.runtime.jit import JITFunction, create_function_from_signature

            # a fresh JITFunction over the raw function, also under the interpreter, with the
            # kernel's own do_not_specialize lists (what specialises an int argument)
            keep = ("do_not_specialize", "do_not_specialize_on_alignment")
            jf = JITFunction(fn, **{k: v for k, v in (jit_options or {}).items() if k in keep})
            self._jit[fn] = (jf, create_function_from_signature(jf.signature, jf.params, self.backend))
        return self._jit[fn]

    def __call__(self, fn, args, kwargs, grid=(1,), jit_options=None) -> KernelSpec:
        """fn: the kernel's python function (InterpretedFunction.fn / JITFunction.fn); jit_options:
        the keywords its @triton.jit was given (InterpretedFunction.kwargs)."""
        from triton import knobs

        jf, binder = self._binder(fn, jit_options)
        kwargs = dict(kwargs)
        # what JITFunction.run adds before binding
        kwargs["debug"] = kwargs.get("debug", jf.debug) or knobs.runtime.debug
        for name in RUN_KNOBS:  # the compilation knobs this Triton's JITFunction.run passes as options
            if hasattr(knobs.compilation, name):
                kwargs[name] = getattr(knobs.compilation, name)
        bound, specialization, options = binder(*args, **kwargs)
        _, signature, constexprs, attrs = jf._pack_args(self.backend, kwargs, bound, specialization, options)
        given = {k: v for k, v in kwargs.items() if k not in signature}
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        return KernelSpec(
            kernel=f"{fn.__module__}:{fn.__qualname__}",
            signature=tuple(signature.items()),
            constexprs=tuple(sorted((tuple(p), _plain(v)) for p, v in constexprs.items())),
            attrs=tuple(sorted((tuple(p), [list(a) for a in v]) for p, v in attrs.items())),
            options=tuple(sorted((k, _plain(v)) for k, v in given.items())),
            grid=grid)
