"""Triton kernels of dsv4-tree, installed as `dsv4_tree.kernels` (never as a top-level
`kernels` package: Hugging Face's `kernels` package owns that import name).

Each kernel is paired with a torch reference in `dsv4_tree/reference/`:
  pool_entries           <-> ref_pool_entries           (kernels/compressor.py; reference in reference/ops.py)
  compress_entries       <-> ref_compress_entries       (kernels/compress_entries.py; reference in reference/compress_entries.py;
                         compressor_write = write_compressor_rows + compress_entries, AttentionOps.compressor_write)
  sparse_decode          <-> ref_sparse_decode          (kernels/sparse_decode.py; reference in reference/sparse_decode.py)
  indexer_gather_scores  <-> ref_indexer_gather_scores  (kernels/indexer_gather.py; reference in reference/sparse_decode.py)
  indexer_paged_scores   <-> ref_indexer_paged_scores   (kernels/indexer_gather.py; reference in reference/sparse_decode.py)
  indexer_topk           <-> ref_indexer_topk           (kernels/tree_indexer.py; reference in reference/indexer_topk.py)
  hc_pre / hc_post       <-> ref_hc_pre / ref_hc_post   (kernels/hc.py; reference in reference/hc.py)
  fp8_store              <-> the torch FP8 writer       (kernels/fp8_store.py; serving/records.py: quantize_rows + KVPool's scatter)
  move_records           <-> the torch commit           (kernels/commit_moves.py; serving/commit.py: apply_moves)
  norm_rope / kv_write   <-> ref_norm_rope / ref_kv_write (kernels/norm_rope.py, kv_write.py; reference in reference/norm_rope.py)
  step_tables / apply_page_updates <-> the torch table build (kernels/table_build.py; serving/tables.py: build_tables,
                         itself checked against reference/tables.py)
Data movement and the FP8 codec have their readable torch path in serving/ (the torch backend
runs it); those kernels are compared with it byte for byte.
indexer_topk scores, selects (the tie rule, as torch_ops.topk_order) and maps slots in one kernel.
On CPU they run under TRITON_INTERPRET=1 (set before triton is imported).

Importing this package imports nothing else: the kernel modules (and Triton) load on first
attribute access (PEP 562). Run from the repository root, this folder is importable as a
top-level `kernels`, and transformers probes that name at import time; an eager import here
would make `import transformers` pay for Triton, or fail where Triton is not installed."""
import importlib
import sys
import types

_MODULE_OF = {
    "compress_entries": "compress_entries",
    "compressor_write": "compress_entries",
    "fp8_store": "fp8_store",
    "hc_post": "hc",
    "hc_pre": "hc",
    "indexer_gather_scores": "indexer_gather",
    "indexer_paged_scores": "indexer_gather",
    "indexer_topk": "tree_indexer",
    "indexer_topk_scores": "tree_indexer",
    "kv_write": "kv_write",
    "move_records": "commit_moves",
    "norm_rope": "norm_rope",
    "pool_entries": "compressor",
    "sparse_decode": "sparse_decode",
    "write_compressor_rows": "compress_entries",
    "apply_page_updates": "table_build",
    "step_tables": "table_build",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_MODULE_OF))


class _Package(types.ModuleType):
    """Importing a submodule binds it on its package under its own name; where that name is also a
    kernel's (fp8_store, sparse_decode, norm_rope), a kernel module importing another (kv_write
    imports fp8_store's jit helpers) would shadow the kernel with its module. The kernel keeps it."""

    def __setattr__(self, name, value):
        if name in _MODULE_OF and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
