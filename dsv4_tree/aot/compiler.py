"""Run KernelSpecs through the compile worker, one at a time, each under a time and memory bound.

    results = compile_specs(specs, time_limit=120, cache_dir=None)   # [CompileResult], same order

One worker process (`python -m dsv4_tree.aot.worker`, started without TRITON_INTERPRET, in its
own session with a private TRITON_CACHE_DIR) compiles the specs in turn: on a 2-core machine one
compile at a time is all there is room for. A compile over `time_limit` seconds, or whose
process group (the worker and its ptxas) grows over `memory_limit` bytes resident, is killed and
reported as "timeout" / "memory"; a fresh worker takes the rest. With `cache_dir`, results are
kept on disk keyed by the kernel's source (worker.cache_key), so a second run only compiles
kernels whose source, spec or Triton version changed."""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from .checks import H200_SMEM  # the most shared memory one block may use on an H100 / H200
from .spec import KernelSpec


@dataclass
class CompileResult:
    spec: KernelSpec
    status: str  # ok | smem | error | timeout | memory | crash
    seconds: float
    data: dict = field(default_factory=dict)  # the worker's answer (see worker.compile_spec)

    def get(self, name: str, default=0):
        return self.data.get(name, default)


def _group_rss(pgid: int) -> int:
    """Resident bytes of every process in a process group (the worker and its ptxas)."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of stat: the process group
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss in pages
        except (OSError, IndexError, ValueError):
            continue
    return total


class _Worker:
    def __init__(self, python: str, env: dict):
        self.proc = subprocess.Popen([python, "-m", "dsv4_tree.aot.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        self.err: list = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, None), daemon=True).start()

    def _pump(self, stream, into) -> None:
        for line in stream:
            if into is not None:
                into.put(line)
            else:
                self.err = (self.err + [line])[-40:]
        if into is not None:
            into.put(None)  # the worker is gone

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def compile_specs(specs, time_limit: float = 120.0, memory_limit: int = 8 << 30, cache_dir=None,
                  smem_limit: int = H200_SMEM, progress=None, python: str | None = None) -> list:
    """Compile every spec (sm_90a); progress(i, result) after each. Returns [CompileResult]."""
    scratch = tempfile.mkdtemp(prefix="dsv4_aot_")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DSV4_TREE_GPU")}
    env.update(TRITON_CACHE_DIR=scratch, TRITON_DEFAULT_FP_FUSION=env.get("TRITON_DEFAULT_FP_FUSION", "1"))
    python = python or sys.executable
    worker, results = None, []
    try:
        for i, spec in enumerate(specs):
            if worker is None:
                worker = _Worker(python, env)
            req = {"spec": spec.to_json(), "cache": str(cache_dir) if cache_dir else None, "smem_limit": smem_limit}
            worker.proc.stdin.write(json.dumps(req) + "\n")
            worker.proc.stdin.flush()
            res = _await(worker, spec, time_limit, memory_limit)
            if res.status in ("timeout", "memory", "crash"):
                worker.kill()
                worker = None
            results.append(res)
            if progress is not None:
                progress(i, res)
    finally:
        if worker is not None:
            worker.proc.stdin.close()
            worker.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def _await(worker: _Worker, spec: KernelSpec, time_limit: float, memory_limit: int) -> CompileResult:
    t0 = time.monotonic()
    started = None
    while True:
        # time counts from the worker's AOT-START (its imports and a cache lookup are not the kernel's)
        left = (started or t0) + time_limit - time.monotonic() + (0 if started else 120)
        if left <= 0:
            return CompileResult(spec, "timeout", time.monotonic() - (started or t0))
        try:
            line = worker.lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            if _group_rss(worker.proc.pid) > memory_limit:
                return CompileResult(spec, "memory", time.monotonic() - (started or t0))
            continue
        if line is None:
            return CompileResult(spec, "crash", time.monotonic() - t0, {"error": "".join(worker.err)[-3000:]})
        if line.startswith("AOT-START "):
            started = time.monotonic()
        elif line.startswith("AOT-RESULT "):
            data = json.loads(line[len("AOT-RESULT "):])
            return CompileResult(spec, data["status"], data.get("seconds", 0.0), data)
