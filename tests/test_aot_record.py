"""The launch recorder's fast form (dsv4_tree/aot/record.py): dense products answered with zeros
and the step tables taken from the torch build record exactly the specialisations, and the
launches, of a recording with the table kernels and products run for real, and (slow) of a run
where every kernel runs."""
import os

import pytest
import torch

from dsv4_tree.aot.record import LaunchRecorder, _ShapeOnly
from dsv4_tree.aot.steps import Prefill, Verify

pytestmark = pytest.mark.skipif(os.environ.get("DSV4_TREE_GPU") == "1", reason="records under the interpreter")

STEPS = (Verify(8, (40, 53, 66), "auto", bucketed=True, max_requests=4),  # a tree batch padded to its bucket
         Verify(4, (41,), "fp8_e4m3"),  # a chain over FP8 pools
         Prefill(16 + 3, 16, "fp8_e4m3", prompts=2, max_requests=4, n=4))  # two prompts, a 3-row tail


@pytest.fixture(scope="module")
def tiny_model():
    from dsv4_tree.aot.scenarios import model_for

    return model_for("tiny")


def _record(model, **kw) -> LaunchRecorder:
    from dsv4_tree.aot.scenarios import _run_step

    with LaunchRecorder(where="t", **kw) as rec:
        for step in STEPS:
            _run_step(model, step)
    return rec


def _same(fast: LaunchRecorder, other: LaunchRecorder) -> None:
    assert len(other.seen) >= 20
    assert list(fast.seen) == list(other.seen), "the same specialisations, in the same order"
    assert {k: r.launches for k, r in fast.seen.items()} == {k: r.launches for k, r in other.seen.items()}


def test_fast_recording_sees_every_spec_and_launch_of_one_with_real_tables_and_products(tiny_model):
    _same(_record(tiny_model), _record(tiny_model, shapes_only=False))


@pytest.mark.slow  # ~3 min: every kernel interpreted
def test_fast_recording_sees_every_spec_and_launch_of_a_run_where_everything_runs(tiny_model):
    _same(_record(tiny_model), _record(tiny_model, run=None))


def test_shape_only_products_are_zeros_of_their_own_shape_and_dtype():
    a = torch.randn(3, 5, 4, dtype=torch.bfloat16)
    w = torch.randn(6, 4, dtype=torch.bfloat16)
    with _ShapeOnly():
        lin = torch.nn.functional.linear(a, w)
        bmm = torch.bmm(a, a.transpose(1, 2))
        mat = a @ w.t()
        other = a + 1  # not a product: computed
    for got, want in ((lin, (3, 5, 6)), (bmm, (3, 5, 5)), (mat, (3, 5, 6))):
        assert got.shape == want and got.dtype == torch.bfloat16 and not got.any()
    assert torch.equal(other, a + 1)
    assert torch.nn.functional.linear(a, w).any(), "the mode is gone after its block"


def test_the_recorder_puts_back_what_it_patched_even_on_an_error():
    from triton.runtime.interpreter import InterpretedFunction

    from dsv4_tree.serving import step

    before = (step.build_from, InterpretedFunction.run)
    with pytest.raises(ZeroDivisionError):
        with LaunchRecorder():
            assert step.build_from is not before[0]
            1 / 0
    assert (step.build_from, InterpretedFunction.run) == before
    x = torch.ones(2, 2)
    assert torch.mm(x, x).sum() == 8, "dense products compute again"


def test_the_pools_sizes_make_no_compile_variants(tiny_model):
    """The table kernels' layout ints (page-table width, scratch, committed and trash slots) and the
    page updates' counts are not specialised (kernels/table_build.py _LAYOUT_INTS): engines with
    other pool sizes launch the very same specs, so the gate's set covers every memory configuration."""
    import dsv4_tree as dt
    from dsv4_tree.serving.synth import synthetic_request
    from dsv4_tree.tree.simulate import eagle_tree

    keys = []
    for total in (1 << 12, 5000, 8247):  # C128 committed slots 64, 72, 98 (page 256: 2 per page)
        spec = dt.SpecConfig(eagle_topk=4, num_steps=3, num_draft_tokens=8, max_total_tokens=total,
                             attention_backend="triton")
        eng = dt.Engine(tiny_model, spec)
        with LaunchRecorder() as rec:
            reqs = [synthetic_request(eng, 40 + 13 * i, seed=i) for i in range(2)]
            trees = [eagle_tree(5, 8, seed=i) for i in range(2)]
            out = eng.verify(reqs, trees)
            eng.commit(reqs, eng.accept_greedy(reqs, trees, out), out)
        layout = eng.runtime.layout
        keys.append((sorted(rec.seen), layout.committed_entry_slots(128) % 16, layout.trash_entry_slot(128) % 16))
    assert len({k[1:] for k in keys}) > 1, "the sizes reach both divisibility classes"
    assert keys[0][0] == keys[1][0] == keys[2][0]


def test_the_recorder_honours_a_kernels_do_not_specialize():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def _fill(x_ptr, n, m, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, n + m, mask=i < BLOCK)

    x = torch.zeros(16, dtype=torch.int32)
    with LaunchRecorder(run=None) as rec:
        for n in (1, 16, 17):
            _fill[(1,)](x, n, 17, BLOCK=16)
    assert len(rec.seen) == 1, "n (not specialised) makes no variants"
    with LaunchRecorder(run=None) as rec:
        for m in (1, 16, 17):
            _fill[(1,)](x, 17, m, BLOCK=16)
    assert len(rec.seen) == 3, "m (specialised: == 1, divisible by 16, neither) makes three"
