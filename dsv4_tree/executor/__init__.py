"""The per-layer executor: one forward over a verify plan's rows (forward.py) and its CUDA-graph
capture and replay (graphs.py). It reads the plan, the pools and the model; it decides nothing."""
