"""Triton kernels of dsv4-tree, installed as `dsv4_tree.kernels` (never as a top-level
`kernels` package: Hugging Face's `kernels` package owns that import name).

Each kernel is paired with a torch reference in `dsv4_tree/reference/ops.py`; the torch
references are the `torch` attention backend."""
