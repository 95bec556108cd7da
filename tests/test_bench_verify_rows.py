"""bench_verify verifies the N it reports: each tree size runs on an engine with
num_draft_tokens = N, so the bucketed (CUDA-graphed) step of an N = 8 tree holds 8 rows per
request, not the 64 of the run's largest tree."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_verify  # noqa: E402

from dsv4_tree.serving.buckets import step_shapes  # noqa: E402
from dsv4_tree.tree.simulate import eagle_tree  # noqa: E402


@pytest.mark.parametrize("n", [1, 8, 16])
def test_bucketed_step_rows_are_the_tree_size(n):
    model = bench_verify.bench_model(3, "cpu", None, "tiny")
    engine = bench_verify.bench_engine(model, n, 256, "auto", "torch")
    tree = eagle_tree(5, n)
    shapes = step_shapes([tree.num_nodes], [200], engine.runtime.layout, engine.runtime.max_nodes)
    assert tree.num_nodes == n and shapes.rows == n and shapes.nodes == n, shapes
