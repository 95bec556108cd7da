"""Ahead-of-time check of the Triton kernels for an H200 (sm_90a), on a machine without a GPU.

    record.py     LaunchRecorder: the launches of a block of code (run, or recorded and skipped)
    spec.py       KernelSpec: what JITFunction.run would compile for one launch on an sm_90 GPU
    worker.py     the compile worker (`python -m dsv4_tree.aot.worker`, no TRITON_INTERPRET)
    compiler.py   runs specs through the worker: time bound, memory bound, on-disk cache
    checks.py     the limits (shared memory, spills, MMA, compile time) and the summary table
    scenarios.py  the launches the library makes: tiny, V4-Flash and V4-Pro verify, prefill, commit
    controls.py   negative controls (control_kernels.py: kernels built to spill and to exceed smem)
    gate.py       run_gate: record, compile, check -> GateReport
    __main__.py   `python -m dsv4_tree.aot` (scripts/aot_gate)

Nothing here runs at import; Triton is imported by the functions that need it.
design_notes/aot-gate.md says what the gate checks and why."""
