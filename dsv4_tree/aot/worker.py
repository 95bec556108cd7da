"""The compile worker: compiles KernelSpecs for sm_90a with Triton's own compiler, no GPU.

    python -m dsv4_tree.aot.worker      (never under TRITON_INTERPRET=1: triton.jit must compile)

Reads one JSON request per line on stdin, {"spec": KernelSpec JSON, "cache": dir | null,
"smem_limit": bytes}, and answers on its protocol stream (the original stdout; anything Triton
or ptxas print goes to stderr) with `AOT-START <cache key>` and then `AOT-RESULT <json>`:
status "ok" | "smem" (stopped at shared-memory allocation: more than smem_limit) | "error",
the seconds of each stage, and for a compiled kernel what the H200 would see: dynamic shared
memory (metadata.shared, the value Triton checks at launch), cuobjdump's REG / STACK / SHARED
(static) / LOCAL, ptxas -v's spill stores and loads, and the SASS opcode counts (MMA, FFMA,
LDL / STL). `compiler.py` runs it under a time and memory bound and keeps the cache.

The cache key is the jit function's own source hash (`JITFunction.cache_key`: its source, the
jit helpers it calls, the constexpr globals it reads), the spec, the Triton version and this
file's READER version; a result is stored only when it does not depend on time (not a timeout)."""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsv4_tree.kernels._version import TRITON

READER = 1  # bump when what a result holds changes: old cache entries stop matching
MMA_OPS = ("HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA")
_SASS = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


class SharedMemoryTooLarge(Exception):
    def __init__(self, shared: int):
        super().__init__(f"{shared} bytes of shared memory")
        self.shared = shared


def _early_shared(ttgir, backend, options, capability: int) -> int:
    """Shared memory the kernel will allocate: a copy of the TTGIR through make_llir's passes up
    to add_allocate_shared_memory_nv (the value make_llir records as metadata["shared"])."""
    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir", delete=False) as f:
        f.write(str(ttgir))
    try:
        mod = ir.parse_mlir_module(f.name, ctx)
    finally:
        os.unlink(f.name)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    if TRITON >= (3, 8):  # 3.8 added the consan flag (off: the gate compiles without instrumentation)
        passes.ttgpuir.add_allocate_warp_groups(pm, False)
    else:
        passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, capability, get_ptx_version_from_options(options, 90))
    pm.run(mod, "aot_gate_shared")
    return int(mod.get_int_attr("ttg.shared") or 0)


def _stage_hook(times: dict, smem_limit: int):
    """knobs.runtime.add_stages_inspection_hook: times every stage; stops after the TTGIR when the
    kernel's shared memory is over smem_limit (nothing after it can make it launch)."""

    def hook(*args):
        if not args:  # compile() asks for a key suffix
            return "aot_gate", "aot_gate"
        backend, stages, options, _language, capability = args
        for name, stage in list(stages.items()):
            def timed(src, metadata, _name=name, _stage=stage):
                if _name == "llir" and smem_limit:
                    t = time.perf_counter()
                    shared = _early_shared(src, backend, options, capability)
                    times["shared_check"] = time.perf_counter() - t
                    if shared > smem_limit:
                        raise SharedMemoryTooLarge(shared)
                t = time.perf_counter()
                out = _stage(src, metadata)
                times[_name] = time.perf_counter() - t
                return out

            stages[name] = timed

    return hook


def _tool(name: str) -> str:
    from triton import knobs

    return {"cuobjdump": knobs.nvidia.cuobjdump, "ptxas": knobs.nvidia.ptxas_blackwell}[name].path


def read_cubin(cubin: bytes) -> dict:
    """cuobjdump's resource usage and the SASS opcode counts of one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    names = {"REG": "reg", "STACK": "stack", "SHARED": "static_shared", "LOCAL": "local"}
    out = {names[k]: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    ops = [m.group(1) for m in _SASS.finditer(sass)]
    out["sass"] = len(ops)
    out["mma"] = sum(op in MMA_OPS for op in ops)
    out["ffma"] = sum(op == "FFMA" for op in ops)
    out["ldl_stl"] = sum(op in ("LDL", "STL") for op in ops)
    out["mma_ops"] = sorted({op for op in ops if op in MMA_OPS})
    return out


def read_ptxas_log(log: str) -> dict:
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.findall(r"Used (\d+) registers", log)
    return {"spill_stores": max((int(s) for s, _ in spills), default=0),
            "spill_loads": max((int(ld) for _, ld in spills), default=0),
            "ptxas_regs": max((int(r) for r in regs), default=0)}


def cache_key(spec, smem_limit: int) -> str:
    import triton

    fn = _jit_function(spec.kernel)
    text = json.dumps([READER, triton.__version__, fn.cache_key, spec.key(), smem_limit])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _jit_function(kernel: str):
    module, name = kernel.split(":")
    return getattr(importlib.import_module(module), name)


def compile_spec(spec, smem_limit: int) -> dict:
    """Compile one spec for sm_90a; never raises for a kernel's own failure (status "error")."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .spec import TARGET, constexpr_value

    fn = _jit_function(spec.kernel)
    src = ASTSource(fn, dict(spec.signature), {tuple(p): constexpr_value(v) for p, v in spec.constexprs},
                    {tuple(p): a for p, a in spec.attrs})
    times: dict = {}
    result = {"status": "ok", "times": times}
    log = io.StringIO()
    knobs.runtime.add_stages_inspection_hook = _stage_hook(times, smem_limit)
    t = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # ptxas -v's log (knobs.nvidia.dump_ptxas_log)
            kernel = triton.compile(src, target=GPUTarget(*TARGET), options=dict(spec.options))
    except SharedMemoryTooLarge as exc:
        result.update(status="smem", shared=exc.shared)
    except Exception as exc:  # a kernel that does not compile is a finding, not a worker failure
        result.update(status="error", error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
    finally:
        knobs.runtime.add_stages_inspection_hook = None
    result["seconds"] = time.perf_counter() - t
    if result["status"] == "ok":
        md = kernel.metadata
        result.update(shared=int(md.shared), num_warps=int(md.num_warps), num_stages=int(md.num_stages),
                      ptx_bytes=len(kernel.asm.get("ptx", "")), target=kernel.asm["ptx"].split(".target", 1)[1].split()[0])
        result.update(read_ptxas_log(log.getvalue()))
        result.update(read_cubin(kernel.asm["cubin"]))
    return result


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("dsv4_tree.aot.worker must run without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever Triton, MLIR or ptxas print goes to stderr
    sys.stdout = sys.stderr
    from triton import knobs

    from .spec import KernelSpec

    knobs.compilation.always_compile = True
    knobs.nvidia.dump_ptxas_log = True
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        spec = KernelSpec.from_json(req["spec"])
        smem_limit = int(req.get("smem_limit", 0))
        try:
            key = cache_key(spec, smem_limit)
        except Exception as exc:  # the kernel's module does not import
            proto.write("AOT-RESULT " + json.dumps({"status": "error", "error": f"{type(exc).__name__}: {exc}",
                                                    "seconds": 0.0, "times": {}}) + "\n")
            continue
        proto.write(f"AOT-START {key}\n")
        cached = Path(req["cache"]) / f"{key}.json" if req.get("cache") else None
        if cached is not None and cached.exists():
            result = dict(json.loads(cached.read_text()), cached=True)
        else:
            result = dict(compile_spec(spec, smem_limit), cached=False)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(result))
                tmp.replace(cached)
        result["key"] = key
        proto.write("AOT-RESULT " + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
